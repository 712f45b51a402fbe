"""The exponential race in one pass: argmax over the vocabulary of logits / T - log(E).

Problem: sampling a batch in torch (sampling.py) makes some ten passes over a (R, V) fp32 tensor:
upcast, scale by temperature, softmax, noise, divide, argmax, plus a greedy argmax. At 256 rows
and Qwen3's 151,936-token vocabulary each pass moves 155 MB; together they cost about as much as
reading the model's weights.
Idea: with E ~ Exponential(1) per token, argmax(probs / E) = argmax(logits / T - log E) (log is
monotonic and the softmax's normalizer is the same for every token of a row), so without top-k,
top-p or min-p no softmax is needed at all. One program per row streams its logits (in the
model's dtype) and its noise once, keeping a running maximum and its index; a greedy row ignores
the noise and takes the exact argmax of its logits. The noise comes from torch, from each seeded
request's own generator, so reproducibility is sampling.py's.

Invariants: ties go to the lowest token id, as `torch.argmax`; noise > 0 (the caller clamps it).
"""

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 2048  # tokens per loop iteration of a row's program


@triton.jit
def _exponential_race_kernel(
    logits_ptr, noise_ptr, inv_temperature_ptr, greedy_ptr, out_ptr,
    stride_l, stride_n, vocab_size,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(inv_temperature_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    offs = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + offs
        mask = cols < vocab_size
        x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        if not greedy:
            e = tl.load(noise_ptr + row * stride_n + cols, mask=mask, other=1.0)
            x = x * inv_t - tl.log(e)
        block_max = tl.max(x, 0)
        block_idx = tl.min(tl.where(x == block_max, cols, vocab_size), 0)  # first of the ties
        if block_max > best:  # strictly: an earlier block keeps a tie
            best = block_max
            best_idx = block_idx
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def exponential_race(
    logits: torch.Tensor,
    noise: torch.Tensor,
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """logits (R, V), noise (R, V) fp32 > 0, inv_temperature (R,) fp32, greedy (R,) bool ->
    token ids (R,) int64."""
    rows, vocab_size = logits.shape
    assert noise.shape == logits.shape and logits.stride(-1) == noise.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _exponential_race_kernel[(rows,)](
            logits, noise, inv_temperature, greedy, out,
            logits.stride(0), noise.stride(0), vocab_size,
            BLOCK=VOCAB_BLOCK,
        )  # fmt: skip
    return out
