"""The exponential race in one pass: argmax over the vocabulary of logits / T - log(E).

Problem: sampling a batch in torch (sampling.py) makes some ten passes over a (R, V) fp32 tensor:
upcast, scale by temperature, softmax, noise, divide, argmax, plus a greedy argmax. At 256 rows
and Qwen3's 151,936-token vocabulary each pass moves 155 MB; together they cost about as much as
reading the model's weights.
Idea: with E ~ Exponential(1) per token, argmax(probs / E) = argmax(logits / T - log E) (log is
monotonic and the softmax's normalizer is the same for every token of a row), so without top-k,
top-p or min-p no softmax is needed at all. The pass reads each row's logits (in the model's
dtype) and noise once, and clamps the noise on the way (no separate pass for that); a greedy row
ignores the noise and takes the exact argmax of its logits. The noise comes from torch, from each
seeded request's own generator, so reproducibility is sampling.py's.

The pass is spread over the vocabulary, like split-K in decode attention (paged_decode.py): one
program per (row, chunk of `block` tokens) writes its chunk's best score and token, and a second,
tiny kernel picks each row's best chunk. One program per row would leave most of the GPU idle at
small batches and stream a row's 151,936 tokens through one SM at any batch (an H200 step of W
spent 180 µs here at 256 rows, and 125 µs at 18, against ~55 µs of bytes).

Invariants: ties go to the lowest token id, as `torch.argmax` (within a chunk by the index, across
chunks because the merge takes the lowest index among the chunks that reach the maximum); noise
below `TINY` counts as `TINY`; a row with no finite score (all NaN) gets token 0, never an id
outside the vocabulary.
"""

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 4096  # tokens per program: Qwen3's vocabulary is 38 chunks a row
TINY = torch.finfo(torch.float32).tiny


@triton.jit
def _exponential_race_kernel(
    logits_ptr, noise_ptr, inv_temperature_ptr, greedy_ptr, best_ptr, best_idx_ptr,
    stride_l, stride_n, vocab_size, num_chunks, tiny,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    if tl.load(greedy_ptr + row) == 0:
        e = tl.load(noise_ptr + row * stride_n + cols, mask=mask, other=1.0)
        x = x * tl.load(inv_temperature_ptr + row) - tl.log(tl.maximum(e, tiny))
    best = tl.max(x, 0)
    best_idx = tl.min(tl.where(x == best, cols, vocab_size), 0)  # first of the ties
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit
def _race_merge_kernel(
    best_ptr, best_idx_ptr, out_ptr, vocab_size, num_chunks, BLOCK_CHUNKS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_CHUNKS)
    mask = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    best_idx = tl.load(best_idx_ptr + row * num_chunks + offs, mask=mask, other=vocab_size)
    token = tl.min(tl.where(best == tl.max(best, 0), best_idx, vocab_size), 0)
    tl.store(out_ptr + row, tl.where(token < vocab_size, token, 0).to(tl.int64))  # NaN row: 0


def exponential_race(
    logits: torch.Tensor,
    noise: torch.Tensor,
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
    block: int = VOCAB_BLOCK,
) -> torch.Tensor:
    """logits (R, V), noise (R, V) fp32, inv_temperature (R,) fp32, greedy (R,) bool -> token
    ids (R,) int64. `block`: tokens per program (a power of two)."""
    rows, vocab_size = logits.shape
    assert noise.shape == logits.shape and logits.stride(-1) == noise.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab_size, block)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _exponential_race_kernel[(rows, num_chunks)](
        logits, noise, inv_temperature, greedy, best, best_idx,
        logits.stride(0), noise.stride(0), vocab_size, num_chunks, TINY,
        BLOCK=block,
    )  # fmt: skip
    _race_merge_kernel[(rows,)](
        best, best_idx, out, vocab_size, num_chunks,
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
    )  # fmt: skip
    return out
