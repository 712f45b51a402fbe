"""The exponential race in one pass: argmax over the vocabulary of logits / T - log(E).

Problem: sampling a batch in torch (sampling.py) makes some ten passes over a (R, V) fp32 tensor:
upcast, scale by temperature, softmax, noise, divide, argmax, plus a greedy argmax. At 256 rows
and Qwen3's 151,936-token vocabulary each pass moves 155 MB; together they cost about as much as
reading the model's weights.
Idea: with E ~ Exponential(1) per token, argmax(probs / E) = argmax(logits / T - log E) (log is
monotonic and the softmax's normalizer is the same for every token of a row), so without top-k,
top-p or min-p no softmax is needed at all. The pass reads each row's logits (in the model's
dtype) once; a greedy row takes the exact argmax of its logits.

The pass draws the noise itself, from Philox-4x32-10, a counter-based generator: ten rounds of
multiplies turn a 128-bit counter and a 64-bit key into four random 32-bit words, the same ones
in any program, in any order, on any device (sampling.py's `philox4x32` is the same function in
numpy). So no (R, V) fp32 noise tensor is written and read back (at 256 rows 155 MB each way,
twice the bf16 logits the pass exists to read), and no row needs a generator of its own. Each row
brings its key and its counter (`SamplingBatch.noise_keys`, `noise_counters`): a seeded request's
are its seed and the index of the token it draws, so its tokens follow from the seed alone,
whatever shares its batch; the other rows share the step's random key and count by row. Token t of
a row takes word t % 4 of the counter (t // 4, the row's counter's two halves, 0): four
neighbouring tokens share one Philox call, and a row's noise does not depend on the pass's tiling.

The pass is spread over the vocabulary, like split-K in decode attention (paged_decode.py): one
program per (row, chunk of `block` tokens) writes its chunk's best score and token, and a second,
tiny kernel picks each row's best chunk. One program per row would leave most of the GPU idle at
small batches and stream a row's 151,936 tokens through one SM at any batch (an H200 step of W
spent 180 µs here at 256 rows, and 125 µs at 18, against ~55 µs of bytes).

Invariants: ties go to the lowest token id, as `torch.argmax` (within a chunk by the index, across
chunks because the merge takes the lowest index among the chunks that reach the maximum); a
drawn u is (2k + 1) / 2**24 for a 23-bit k, exact in fp32 and never 0 or 1, so E is finite and
positive and every finite logit scores finite; a row with no finite score (all NaN) gets token 0,
never an id outside the vocabulary.
"""

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 4096  # tokens per program: Qwen3's vocabulary is 38 chunks a row
# Philox-4x32's constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011)
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)  # the key's increments between rounds
PHILOX_W1 = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)


@triton.jit
def _philox4x32(c0, c1, c2, c3, k0, k1):
    """Four uint32 counter words and a two-word key -> four random uint32 words."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi0, lo0 = tl.umulhi(c0, PHILOX_M0), c0 * PHILOX_M0
        hi2, lo2 = tl.umulhi(c2, PHILOX_M1), c2 * PHILOX_M1
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0 += PHILOX_W0
        k1 += PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def _exponential_noise(keys_ptr, counters_ptr, row, chunk, BLOCK: tl.constexpr):
    """E ~ Exponential(1) for tokens [chunk * BLOCK, (chunk + 1) * BLOCK) of the row."""
    QUARTER: tl.constexpr = BLOCK // 4
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    counter = tl.load(counters_ptr + row).to(tl.uint64, bitcast=True)
    c0 = (chunk * QUARTER + tl.arange(0, QUARTER)).to(tl.uint32)  # token t's word: t // 4
    c1 = tl.full([QUARTER], 0, tl.uint32) + (counter & 0xFFFFFFFF).to(tl.uint32)
    c2 = tl.full([QUARTER], 0, tl.uint32) + (counter >> 32).to(tl.uint32)
    c3 = tl.full([QUARTER], 0, tl.uint32)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = (key >> 32).to(tl.uint32)
    w0, w1, w2, w3 = _philox4x32(c0, c1, c2, c3, k0, k1)
    # token 4i + j of the chunk takes word j of counter i
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK,))
    u = ((w >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)  # (2k + 1) / 2**24, in (0, 1)
    return -tl.log(u)


@triton.jit
def _exponential_race_kernel(
    logits_ptr, keys_ptr, counters_ptr, inv_temperature_ptr, greedy_ptr, best_ptr, best_idx_ptr,
    stride_l, vocab_size, num_chunks, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    if tl.load(greedy_ptr + row) == 0:
        e = _exponential_noise(keys_ptr, counters_ptr, row, chunk, BLOCK)
        x = x * tl.load(inv_temperature_ptr + row) - tl.log(e)
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
    keys: torch.Tensor,
    counters: torch.Tensor,
    block: int = VOCAB_BLOCK,
) -> torch.Tensor:
    """logits (R, V), inv_temperature (R,) fp32, greedy (R,) bool, keys and counters (R,) int64
    (each row's Philox key and counter, as 64 bits) -> token ids (R,) int64.
    `block`: tokens per program (a power of two, at least 4)."""
    rows, vocab_size = logits.shape
    assert keys.shape == counters.shape == (rows,) and keys.dtype == counters.dtype == torch.int64
    assert logits.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab_size, block)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _exponential_race_kernel[(rows, num_chunks)](
        logits, keys, counters, inv_temperature, greedy, best, best_idx,
        logits.stride(0), vocab_size, num_chunks, BLOCK=block,
    )  # fmt: skip
    _race_merge_kernel[(rows,)](
        best, best_idx, out, vocab_size, num_chunks,
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
    )  # fmt: skip
    return out


@triton.jit
def _exponential_noise_kernel(keys_ptr, counters_ptr, out_ptr, stride_o, vocab_size,
                              BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    e = _exponential_noise(keys_ptr, counters_ptr, row, chunk, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, e, mask=cols < vocab_size)


def exponential_noise(
    keys: torch.Tensor, counters: torch.Tensor, vocab_size: int, block: int = VOCAB_BLOCK
) -> torch.Tensor:
    """keys, counters (S,) int64 -> the (S, V) fp32 noise the race draws for those rows: what the
    torch path (filters) reads for seeded rows on CUDA, in one launch."""
    rows = keys.shape[0]
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=keys.device)
    if rows:
        _exponential_noise_kernel[(rows, triton.cdiv(vocab_size, block))](
            keys, counters, out, out.stride(0), vocab_size, BLOCK=block
        )
    return out
