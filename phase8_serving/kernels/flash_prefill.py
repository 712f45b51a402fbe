"""Varlen causal prefill attention over the paged KV cache (FlashAttention-2 in Triton).

Problem: a prefill step packs the new tokens of many sequences into one `[T, H, D]` batch with
no padding. Sequence i brings q_len_i new queries that sit at the END of its context of seq_len_i
tokens: the first seq_len_i - q_len_i keys were cached by an earlier chunk or shared through the
prefix cache, and live scattered over the paged cache. The torch reference (reference.py) gathers
the context contiguous, repeats K/V per query head and materializes an fp32 `[H, Q, N]` score
matrix: many times the bytes of Q, K and V, and a Python loop over sequences.

Idea (Dao 2023, FlashAttention-2; Triton's fused-attention tutorial): one program owns BLOCK_M
query rows of one head of one sequence, keeps them in registers, and streams that sequence's keys
and values in BLOCK_N tiles straight from the paged cache (a block-table lookup per key row),
with the online softmax (`attn_tiles`, online_softmax.py, shared with the decode kernel). The
score matrix never leaves the chip; HBM sees Q once, the output once and K/V once per query tile.

The key range of a tile splits in two, as in the tutorial: keys every row of the tile may see
(no mask), then the diagonal band where the causal mask `key_pos <= query_pos` applies. Both are
the same `attn_tiles` loop; the mask is a compile-time flag.

Longest first: under the causal mask a query tile's work grows with its position, so the last
tiles of a long prompt cost the most. The grid runs heads fastest and query tiles from the last
to the first, so the long programs start in the first waves and short ones fill the tail (a
scheduler's longest-processing-time-first rule); in launch order, the last tiles of the last
head would start last and run alone. `PrefillConfig.longest_first=False` launches in that order
(the benchmark's ablation). Past `longest_first_max_context` tokens of context (16,384) the
launch goes in that order anyway: a 32,000-token prompt has ~4,000 query tiles of 128 rows, 30
waves on an H100, so the tail is a small share, and launch order measured faster there (4-5 %
for the whole prompt in one launch, 1-2 % for the engine's two 16,384-token chunks of it; equal
at 16k, 7-39 % slower at 2-8k; benchmarks/phase7_prefill.py). Why it wins is not profiled: one
guess is that neighbouring tiles of one head, started together, read the same keys while L2
holds them.

Invariants:
- query row m of sequence i has position seq_len_i - q_len_i + m and sees keys 0 … that position;
  key 0 is visible to every row, so no row's softmax is empty (no NaN).
- GQA: query head h reads KV head h // QUERY_GROUP_SIZE.
- block_tables[i] covers positions 0 … seq_len_i - 1; K/V of this step are already in the cache
  (store_kvcache ran first).
- head_dim is a power of two (64, 128 or Qwen3.5's 256 here); on a GPU, BLOCK_M and BLOCK_N
  are >= 16 (tl.dot).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .online_softmax import attn_tiles

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the fast hardware path


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and launch parameters; `default_prefill_config` picks one per device."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    longest_first: bool = True  # grid (head, query tile last to first); else (tile, head) in order
    longest_first_max_context: int = 16_384  # past it (the longest context), in order anyway

    def __post_init__(self):
        for tile in (self.block_m, self.block_n):
            if tile < 16 or tile != triton.next_power_of_2(tile):
                raise ValueError(f"tiles must be powers of two >= 16, got {self}")


def default_prefill_config(head_dim: int, device: torch.device) -> PrefillConfig:
    if device.type != "cuda":  # the interpreter: small tiles keep the CPU tests quick
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim > 128:  # Qwen3.5's 256: 128-row tiles of q, k and v overflow shared memory
        return PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    # H100 sweep of one prompt of 1k-32k tokens at block size 16 (2026-12-05): a third pipeline
    # stage beat the H200 batch sweep's best of 7 (benchmarks/results/phase7_kernels.json: two
    # stages) at every length, 8-14 % from 4k tokens up
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


# first_seq changes with every mixed step: specialized (on == 1 or % 16), it would compile new
# variants at run time, seconds each, in the middle of serving
@triton.jit(do_not_specialize=["first_seq"])
def _flash_attn_varlen_paged_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    first_seq,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_btb,
    QUERY_GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
):
    if LONGEST_FIRST:  # programs start in grid order: heads fastest, the last query tile first
        head = tl.program_id(0)
        start_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        start_m = tl.program_id(0)
        head = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if start_m * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step
    kv_head = head // QUERY_GROUP_SIZE

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_pos = context_len + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    row_mask = (offs_m < q_len)[:, None]
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_mask
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb

    # keys 0 … context_len + start_m * BLOCK_M - 1 are visible to every row of this tile
    unmasked_hi = (context_len + start_m * BLOCK_M) // BLOCK_N * BLOCK_N
    band_hi = tl.minimum(seq_len, context_len + (start_m + 1) * BLOCK_M)
    acc, l_i, m_i = attn_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        0, unmasked_hi, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        BLOCK_SIZE, HEAD_DIM, BLOCK_N, MASK=False,
    )  # fmt: skip
    acc, l_i, m_i = attn_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        unmasked_hi, band_hi, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        BLOCK_SIZE, HEAD_DIM, BLOCK_N, MASK=True,
    )  # fmt: skip

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def flash_attn_varlen_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
    first_seq: int = 0,
) -> torch.Tensor:
    """Causal attention of packed queries `q` `[T, H, D]` over their paged contexts.

    query_start_loc: int32 `[num_seqs + 1]`, cu_seqlens of the new tokens in `q`.
    seq_lens: int32 `[num_seqs]`, context length including the new tokens.
    block_tables: int32 `[num_seqs, max_blocks_per_seq]`; its width x block size is taken as
    the longest context, which picks the launch order (`longest_first_max_context`).
    max_query_len: the longest q_len (a host int, so the launch needs no device sync).
    out: where to write (q's shape and dtype), else a new tensor. Returns it.
    first_seq: sequences before it are skipped, their rows of `out` left as they are (a mixed
    step's decodes, attended by the decode kernel). An index, not sliced tensors: a slice's
    pointer loses the alignment the compiled kernel was specialized for, and Triton compiles
    another variant on the spot.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power of two"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    config = config or default_prefill_config(head_dim, q.device)
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_tokens == 0 or first_seq == num_seqs:
        return out
    query_tiles = triton.cdiv(max_query_len, config.block_m)
    # the block table is as wide as the batch's longest context (a host int: no device sync)
    longest_context = block_tables.shape[1] * block_size
    longest_first = config.longest_first and longest_context <= config.longest_first_max_context
    if longest_first:
        grid = (num_heads, query_tiles, num_seqs - first_seq)
    else:
        grid = (query_tiles, num_heads, num_seqs - first_seq)
    _flash_attn_varlen_paged_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, first_seq,
        scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        QUERY_GROUP_SIZE=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        LONGEST_FIRST=longest_first,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out
