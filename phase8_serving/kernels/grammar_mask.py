"""Structured outputs' token masks applied to a batch's logits in one pass.

Problem: a row under a grammar (structured_output.py) may sample only the tokens its mask allows,
a bit per token, packed 8 to a byte. In torch, applying the masks is a chain of small kernels:
unpack the bits (a shift, an and, a cast to bool), upcast the logits, gather the grammar rows,
fill, scatter them back. Each costs the host a launch, and at a batch of 64 rows the host, not
the GPU, bounds the step (benchmarks/phase8_structured_output.py times it: the masking was the
largest part of what a grammar adds to a step).
Idea: one kernel reads each row's logits once, in the model's dtype, and writes them upcast to
float32, each token's logit or -inf by its bit. A row says which packed mask is its own
(`mask_of_row`; -1: no grammar, the row is only upcast), so the host sends the masks it has and
one small index, and launches once.
"""

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 4096  # tokens per program: Qwen3's vocabulary is 38 programs a row


@triton.jit
def _grammar_mask_kernel(
    logits_ptr, out_ptr, packed_ptr, mask_of_row_ptr,
    vocab_size, stride_logits, stride_out, stride_packed,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab_size
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=inside, other=0.0).to(tl.float32)
    mask = tl.load(mask_of_row_ptr + row)
    if mask >= 0:
        byte = tl.load(packed_ptr + mask.to(tl.int64) * stride_packed + offs // 8, mask=inside,
                       other=0).to(tl.int32)  # fmt: skip
        x = tl.where((byte >> (offs % 8)) & 1 != 0, x, float("-inf"))  # little-endian bits
    tl.store(out_ptr + row * stride_out + offs, x, mask=inside)


def apply_grammar_masks(
    logits: torch.Tensor, packed: torch.Tensor, mask_of_row: torch.Tensor
) -> torch.Tensor:
    """logits (R, V), any float dtype -> a new float32 (R, V): row r keeps the tokens whose bits
    are set in packed[mask_of_row[r]] ((M, ceil(V / 8)) uint8, bit t of byte t // 8 counted from
    the least significant) and has -inf elsewhere; a row whose mask_of_row is -1 keeps all."""
    rows, vocab_size = logits.shape
    assert packed.shape[-1] * 8 >= vocab_size and mask_of_row.shape == (rows,)
    assert logits.stride(-1) == packed.stride(-1) == 1 and packed.dtype == torch.uint8
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=logits.device)
    if rows:
        grid = (rows, triton.cdiv(vocab_size, VOCAB_BLOCK))
        _grammar_mask_kernel[grid](
            logits, out, packed, mask_of_row,
            vocab_size, logits.stride(0), out.stride(0), packed.stride(0),
            BLOCK=VOCAB_BLOCK,
        )  # fmt: skip
    return out
