"""The exponential race in one pass: argmax over the vocabulary of logits / T - log(E).

Problem: sampling a batch in torch (sampling.py) makes some ten passes over a (R, V) fp32 tensor:
upcast, scale by temperature, softmax, noise, divide, argmax, plus a greedy argmax. At 256 rows
and Qwen3's 151,936-token vocabulary each pass moves 155 MB; together they cost about as much as
reading the model's weights.
Idea: with E ~ Exponential(1) per token, argmax(probs / E) = argmax(logits / T - log E) (log is
monotonic and the softmax's normalizer is the same for every token of a row), so without top-k,
top-p or min-p no softmax is needed at all. The pass reads each row's logits (in the model's
dtype) once; a greedy row takes the exact argmax of its logits.

The pass draws the noise itself: E = -log(u), u uniform from Philox, a counter-based generator
(a (seed, counter) pair gives the same u in any program, in any order), so no (R, V) fp32 noise
tensor is written and read back: at 256 rows that is 155 MB each way, twice the bf16 logits the
pass exists to read. Philox-4x32 makes four 32-bit words per counter from ten rounds of
multiplies, so four neighbouring tokens share a counter (`tl.rand4x`: `tl.rand` keeps one word
of four and would do four times the integer work). The row of a seeded request is the exception:
it reads its noise from `noise`, drawn by torch from the request's own generator (sampling.py), so
its tokens are the ones that generator dictates, whatever shares its batch.

The pass is spread over the vocabulary, like split-K in decode attention (paged_decode.py): one
program per (row, chunk of `block` tokens) writes its chunk's best score and token, and a second,
tiny kernel picks each row's best chunk. One program per row would leave most of the GPU idle at
small batches and stream a row's 151,936 tokens through one SM at any batch (an H200 step of W
spent 180 µs here at 256 rows, and 125 µs at 18, against ~55 µs of bytes).

Invariants: ties go to the lowest token id, as `torch.argmax` (within a chunk by the index, across
chunks because the merge takes the lowest index among the chunks that reach the maximum); noise
below `TINY` counts as `TINY`, and so does a drawn u of 0 (probability 2**-31 a token), so every
finite logit scores finite; a row with no finite score (all NaN) gets token 0, never an id
outside the vocabulary; a row's drawn noise is a function of the seed, the row's index, V and
`block` alone, never of what else the batch holds or of which program runs first.
"""

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 4096  # tokens per program: Qwen3's vocabulary is 38 chunks a row
TINY = torch.finfo(torch.float32).tiny
NO_NOISE_ROW = -1  # noise_rows entry of a row that reads no noise: the pass draws it (Philox)
# Triton types an int argument by its value (int32 below 2**31, int64 above) and compiles a kernel
# per type: seeds below this keep one kernel
PHILOX_SEED_LIMIT = 2**31


@triton.jit
def _exponential_noise(seed, row, chunk, num_chunks, tiny, BLOCK: tl.constexpr):
    """E ~ Exponential(1) for the chunk's BLOCK tokens: E = -log(u), u uniform in [0, 1)."""
    QUARTER: tl.constexpr = BLOCK // 4
    # one counter per four tokens, unique over (row, chunk): a row's noise depends only on the
    # seed and the row's index in the batch, never on which program runs it or when
    counter = (row * num_chunks + chunk) * QUARTER + tl.arange(0, QUARTER)
    u0, u1, u2, u3 = tl.rand4x(seed, counter)
    # token 4i + j of the chunk takes word j of counter i
    u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK,))
    return -tl.log(tl.maximum(u, tiny))  # u == 0 (p = 2**-31): E = 87, not inf


@triton.jit(do_not_specialize=["seed"])
def _exponential_race_kernel(
    logits_ptr, noise_ptr, noise_rows_ptr, inv_temperature_ptr, greedy_ptr, best_ptr,
    best_idx_ptr, stride_l, stride_n, vocab_size, num_chunks, seed, tiny,
    BLOCK: tl.constexpr, NO_NOISE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    if tl.load(greedy_ptr + row) == 0:
        noise_row = tl.load(noise_rows_ptr + row).to(tl.int64)
        if noise_row == NO_NOISE:
            e = _exponential_noise(seed, row, chunk, num_chunks, tiny, BLOCK)
        else:  # a seeded request's row, drawn by torch from its own generator
            e = tl.load(noise_ptr + noise_row * stride_n + cols, mask=mask, other=1.0)
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
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
    seed: int,
    noise_rows: torch.Tensor,
    noise: torch.Tensor,
    block: int = VOCAB_BLOCK,
) -> torch.Tensor:
    """logits (R, V), inv_temperature (R,) fp32, greedy (R,) bool -> token ids (R,) int64.

    seed: a host int in [0, PHILOX_SEED_LIMIT), the key of this call's drawn noise. noise_rows (R,)
    int32: the row of noise (S, V) fp32 that row reads, or NO_NOISE_ROW: the pass draws it.
    `block`: tokens per program (a power of two, at least 4)."""
    rows, vocab_size = logits.shape
    assert noise_rows.shape == (rows,) and noise.shape[1:] == (vocab_size,)
    assert logits.stride(-1) == noise.stride(-1) == 1 and 0 <= seed < PHILOX_SEED_LIMIT
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab_size, block)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _exponential_race_kernel[(rows, num_chunks)](
        logits, noise, noise_rows, inv_temperature, greedy, best, best_idx,
        logits.stride(0), noise.stride(0), vocab_size, num_chunks, seed, TINY,
        BLOCK=block, NO_NOISE=NO_NOISE_ROW,
    )  # fmt: skip
    _race_merge_kernel[(rows,)](
        best, best_idx, out, vocab_size, num_chunks,
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
    )  # fmt: skip
    return out
