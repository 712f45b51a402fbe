"""The inner loop both attention kernels share: paged K/V tiles through the online softmax.

Problem: prefill (flash_prefill.py) and decode (paged_decode.py) attention differ in who the
queries are (BLOCK_M rows of one head, or the QUERY_GROUP_SIZE heads sharing one KV head) and in
which keys they see, but not in how they read keys: walk a range of context positions in BLOCK_N
tiles, find each position's physical slot through the block table, score, and fold the tile into
a running softmax. Written twice, the two copies drift.

Idea (Milakov & Gimelshein 2018, online softmax; FlashAttention-2's loop): keep, per query row, the
running max m_i, the running sum l_i of exp2(score - m_i) and the unnormalized output acc, all
fp32; when a tile raises the max, rescale what was summed under the old one by exp2(m_old - m_new)
before adding the tile's P @ V. The score matrix never leaves the chip.

Invariants:
- scores are in log2 units: `qk_scale` (> 0) is the softmax scale times log2(e), so exp2
  replaces exp; m_i is kept in those units;
- the caches hold q's dtype or fp8 (kv_cache.py), widened in registers for both products;
- a key at position p is read from slot `block_table[p // BLOCK_SIZE] * BLOCK_SIZE +
  p % BLOCK_SIZE` of KV head `kv_head`; positions >= hi are never loaded (masked to 0);
- MASK: scores of keys at positions >= hi or > the row's q_pos become -inf. Without MASK the
  caller guarantees every key of every tile in [lo, hi) is visible to every row (whole tiles):
  then no load is masked either. A mask costs more than its compare: each masked load is a
  predicated copy per row, and the bounds keep the compiler from proving the positions
  non-negative, so `// BLOCK_SIZE` and `% BLOCK_SIZE` become signed-division sequences (a
  decode tile compiled for the H200: 464 instructions a thread masked, 310 unmasked with a bf16
  cache, 671 and 519 with fp8; benchmarks/phase7_kernel_sass.py);
- every row sees at least one key of the first tile it folds (key 0 in prefill, the split's first
  key in decode), so m_i is finite from then on and no exp2(-inf - -inf) = NaN arises; with an
  empty range [lo, hi) nothing changes; acc / l_i is the attention output once all are folded.
"""

import triton
import triton.language as tl


@triton.jit
def operand_query(q, k_cache_ptr):
    """q in the dtype both products run in. An fp8 cache is widened in registers, and under a
    bf16 query to fp16, not bf16: e4m3 -> fp16 is exact and one instruction per two values,
    e4m3 -> bf16 three (through fp16 and fp32), enough conversions to make the kernel
    compute-bound. The query goes to fp16 with it (exact for |q| in 2^-14 .. 65504); p, in
    [0, 1], loses nothing either."""
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


# exercise 7.1: one key tile of the online softmax
@triton.jit
def softmax_step(qk, m_i, l_i, qk_scale):
    """One tile's scores `qk` (rows, keys; unscaled, -inf where hidden) into the running max and
    sum: the tile's probabilities p, the factor alpha that rescales what was summed under the
    old max, and the new l_i and m_i. The caller adds p @ V to acc * alpha."""
    # the scale goes on the row max (qk_scale > 0: it commutes with max) and into exp2's
    # argument as one fused multiply-add per score, not a multiply and a subtract
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_ij


@triton.jit
def attn_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    lo,
    hi,
    qk_scale,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    q = operand_query(q, k_cache_ptr)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # key positions
        # paged gather: position -> (physical block, offset in block)
        if MASK:
            in_ctx = offs_n < hi
            block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_ctx, other=0)
            in_block = offs_n % BLOCK_SIZE
        else:  # whole tiles of non-negative positions: unsigned division is a shift
            block = tl.load(block_table_ptr + offs_n.to(tl.uint32) // BLOCK_SIZE)
            in_block = offs_n.to(tl.uint32) % BLOCK_SIZE
        k_ptrs = k_cache_ptr + block.to(tl.int64)[:, None] * stride_kcb
        k_ptrs += in_block[:, None] * stride_kcs + kv_head * stride_kch + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=in_ctx[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))  # (rows, BLOCK_N), unscaled
        if MASK:
            visible = in_ctx[None, :] & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        p, alpha, l_i, m_ij = softmax_step(qk, m_i, l_i, qk_scale)
        v_ptrs = v_cache_ptr + block.to(tl.int64)[:, None] * stride_vcb
        v_ptrs += in_block[:, None] * stride_vcs + kv_head * stride_vch + offs_d[None, :]
        if MASK:
            v = tl.load(v_ptrs, mask=in_ctx[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i
