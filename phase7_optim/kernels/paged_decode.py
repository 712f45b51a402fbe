"""Paged decode attention: one new query token per sequence against its whole paged context.

Problem: a decode step does almost no arithmetic (one query row per head) but must read every
cached K and V byte of every sequence: it is bound by HBM bandwidth, and the only goal is to
stream the cache at the copy rate. Two things stand in the way. GQA: with H query heads on Hkv
KV heads, a per-query-head program reads each K/V byte H/Hkv times. Few long sequences: one
program per (sequence, KV head) gives batch 1 only Hkv programs, a handful of the GPU's 132 SMs.

Idea (vLLM's PagedAttention v2, FlashDecoding):
- one program per (sequence, KV head, split) loads the QUERY_GROUP_SIZE query heads that share
  that KV head as one `[BLOCK_H, D]` tile, so each K/V tile read from HBM serves all of them
  (tl.dot needs 16 rows on a GPU: the group is padded to BLOCK_H >= 16 with masked rows);
- split-K: the context is cut into `num_splits` ranges processed by separate programs, each
  running the online softmax (m_i, l_i, acc) over its range and writing its normalized partial
  output and log-sum-exp; a second, tiny kernel merges the splits with weights exp2(lse - max).
  `num_splits` comes from a heuristic that aims for a few programs per SM without host syncs.
  With a single split the program normalizes and stores the output itself: no merge launch.
- the key loop is `attn_tiles` (online_softmax.py), the prefill kernel's loop, with this
  kernel's rows being the query heads of one KV head. The newest query sees every key, so only
  a split's last, partial tile needs bounds: the whole tiles before it run the loop without
  masks (`whole_tiles`), a third fewer instructions a tile, which matters where the SMs, not
  the memory, are the bound (an fp8 cache, widened in registers; small batches).
- early loads: launched with programmatic dependent launch (kernels/pdl.py), a program may start
  while the kernel before it (q/k norm + RoPE + the newest key's store) still runs. Every key but
  the newest was stored by an earlier step, and the inputs that locate them (seq_lens, order,
  block tables) were copied in before the step, so the program loads its split's first key tile
  before it waits, then only the newest key if its tile holds it (`early_loads`). At batch 1 a
  split is one tile: the whole read overlaps the kernel before.
- longest first: a program's work is its sequence's context over num_splits, and W's contexts
  span 100-2,000 tokens, so in batch order a long sequence whose programs start last finishes
  alone while most SMs idle (the tail of the launch). Given `order` (the sequences sorted by
  context, longest first, which the model runner computes on the host with the other inputs),
  the grid runs (split, KV head, rank) and programs start in that order: the longest-processing-
  time-first rule of scheduling, which leaves only short programs for the end.

Tuning (`DecodeConfig`, `tuned` vs `baseline`) is measured at workload W's mix, contexts of
100-2,000 tokens at batch 1-256, inside CUDA graphs (benchmarks/phase7_kernels.py).

Invariants:
- the query of sequence i is position seq_len_i - 1: it sees keys 0 … seq_len_i - 1, all of them.
  A padded row (seq_len 0, what fills a CUDA graph's fixed batch) reads no key and outputs 0.
- split s covers positions [s * tokens_per_split, min((s + 1) * tokens_per_split, seq_len)), with
  tokens_per_split = seq_len / num_splits rounded up to whole key tiles, per sequence: the
  launch fixes only the number of splits, so a CUDA graph captured for the longest context still
  spreads a short one over all its splits; a split past the end of a sequence (one shorter than
  num_splits key tiles) is empty, writes lse = -inf and gets weight 0.
- lse is in log2 units, like the scores (scale is pre-multiplied by log2(e)).
- `order` is a permutation of the batch: it changes when programs start, never what they compute.
- before its wait a program reads only the inputs and keys at positions < seq_len - 1, never q
  or the newest key (the previous kernel's writes), and writes nothing.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .online_softmax import attn_tiles, operand_query, softmax_step
from .pdl import launch_dependents, pdl_launch, supports_pdl, wait_for_previous

LOG2_E = 1.4426950408889634
MIN_BLOCK_H = 16  # tl.dot's smallest M on a GPU
MAX_SPLITS = 64
INTERPRETER_NUM_SMS = 4  # what the heuristic assumes when there is no GPU to ask


@dataclass(frozen=True)
class DecodeConfig:
    """Key tile, launch parameters and the split heuristic's two knobs."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 4  # how many programs the split heuristic aims at per SM
    min_tokens_per_split: int = 256  # below this a split's partial-output traffic stops paying
    direct_single_split: bool = False  # one split: store the output, skip the merge kernel
    pdl: bool = False  # programmatic dependent launch: start while the kernel before finishes
    longest_first: bool = False  # the caller's `order` is used: longest contexts start first
    whole_tiles: bool = False  # a split's whole key tiles without masks, then the partial one
    early_loads: bool = False  # with pdl: a split's first key tile is loaded before the wait

    def __post_init__(self):
        if self.block_n < 16 or self.block_n != triton.next_power_of_2(self.block_n):
            raise ValueError(f"block_n must be a power of two >= 16, got {self}")
        if self.programs_per_sm < 1 or self.min_tokens_per_split < 1:
            raise ValueError(f"the split heuristic's knobs must be >= 1, got {self}")


BASELINE_DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=3)
# The H200 at W's mix (benchmarks/phase7_kernels.py, `run_decode_w_mix`, 2026-12-01), % of
# copy bandwidth, tuned (baseline): batch 256 90 (86), 128 84 (77), 64 77 (72), 32 65 (62),
# 8 25 (30), 1 4.5 (4.5): aiming at 16 programs per SM gives batch 128-256 two or three splits,
# so no sequence's whole long context finishes last; a short context splits finer (a single
# stream's 512-768 tokens in 16 splits, not 4: 4.4 µs a layer, not 7.8); (64, 4, 3) was the best
# tile overall. Batch 8 loses (33 splits are too many for its contexts).
# 2026-12-02, same sweep: two pipeline stages, not three, read faster at every batch of W's mix
# (batch 256 3,939 vs 3,912 GB/s, 128 3,699 vs 3,656, 48 3,177 vs 3,088); launched with
# programmatic dependent launch, like every kernel of the decode path (kernels/pdl.py); and
# longest contexts first, which also wants fewer programs per SM (8: batch 256 one split, 128 two):
# W's mix at batch 256 / 128 / 64 / 16 took 262 / 150 / 82 / 28 µs a layer in batch order, 236 /
# 136 / 76 / 26 longest first (4,381 GB/s at 256: 97 % of what a pure read reaches, 4.5 TB/s).
# 2026-12-06: whole key tiles unmasked (`whole_tiles`; benchmarks/phase7_kv_cache_dtype.py).
TUNED_DECODE_CONFIG = DecodeConfig(
    block_n=64, num_warps=4, num_stages=2, programs_per_sm=8, min_tokens_per_split=64,
    direct_single_split=True, pdl=True, longest_first=True, whole_tiles=True,
)  # fmt: skip


# An fp8 cache (2026-12-06, H100, the same sweep, benchmarks/phase7_kv_cache_dtype.py
# --decode-sweep-only): with half the bytes a tile, the instructions, not the reads, bound the
# kernel, and a 2-warp program of 32 keys issues the fewest a key without spilling registers
# (benchmarks/phase7_kernel_sass.py): batch 256 / 128 / 64 took 207 / 119 / 65 µs against the
# bf16 tile's 215 / 128 / 72. A bf16 cache reads at the copy rate either way. In the engine
# (the tile at every batch), W on an fp8 cache: 26,988 -> 27,871 tok/s; but batch 1 (single
# stream) went 0.922 -> 0.968 ms a token, so below FP8_TILE_MIN_SEQS sequences the bf16 tile stays.
TUNED_FP8_DECODE_CONFIG = replace(TUNED_DECODE_CONFIG, block_n=32, num_warps=2)
FP8_TILE_MIN_SEQS = 16  # the smallest batch the sweep measured the fp8 tile faster at

# Early loads (2026-12-07, H100, benchmarks/phase7_optim.py's ablation, six A/B pairs in one
# process each, benchmarks/results/phase7_optim_ablation_early_decode_loads_h100.json): single
# stream 0.836-0.911 ms a token with them, 0.938-0.948 without; the kernel's share of a batch-1
# step 6.0-6.5 -> 4.9-5.0 µs a layer. Holding the first tile across the wait takes registers
# (~90 -> ~140 a thread with a bf16 cache, compiled for sm_90), so fewer programs fit an SM, and
# at batch 64 the kernel was no faster with them (53.4-54.3 µs a layer against 52.6-53.8): only
# small batches, whose steps are latency, not bandwidth, take them. W was unchanged either way
# (20.3-20.8k tok/s). Only measured with a bf16 cache: an fp8 one keeps its configs.
FEW_SEQS_DECODE_CONFIG = replace(TUNED_DECODE_CONFIG, early_loads=True)
# Qwen3.5's 256-wide heads: a 64-key tile of K and V held across the wait spills registers on
# sm_90 (benchmarks/phase7_kernel_sass.py counts local-memory loads and stores): no early loads.
EARLY_LOADS_MAX_HEAD_DIM = 128
# Qwen3-8B (32 heads of 128) runs its single stream slower with early loads: 5.95 / 5.96 ms a
# token against 5.79 / 5.80 under this rule (H100, alternating, benchmarks/results/
# phase7_tp_qwen3_8b_width_rule_h100.json). Not profiled; the guess: with early loads a program
# holds 147 registers a thread, not 94 (benchmarks/phase7_kernel_sass.py, Triton 3.9), so an SM
# takes three programs, not five: batch 1's 512 (64 splits x 8 KV heads) need two waves, and no
# o_proj program (168 registers at 8B's 4,096-wide rows) fits beside them to load o_proj's weight
# during attention, 33 MB at 8B against 4 MB at 0.6B, whose 16 heads gained.
EARLY_LOADS_MAX_WIDTH = 2048  # query heads x head_dim: Qwen3-0.6B's attention output


def early_loads_apply(config: DecodeConfig, num_heads: int, head_dim: int) -> bool:
    """Whether a launch with `config` loads its first key tile before the wait (see above)."""
    return (
        config.early_loads
        and head_dim <= EARLY_LOADS_MAX_HEAD_DIM
        and num_heads * head_dim <= EARLY_LOADS_MAX_WIDTH
    )


def default_decode_config(
    device: torch.device,
    tuned: bool = True,
    cache_dtype: torch.dtype | None = None,
    num_seqs: int | None = None,
) -> DecodeConfig:
    if device.type != "cuda":  # the interpreter: small tiles keep the CPU tests quick
        return DecodeConfig(
            block_n=32, num_warps=4, num_stages=1, direct_single_split=tuned,
            longest_first=tuned, whole_tiles=tuned, early_loads=tuned,
        )  # fmt: skip
    if not tuned:
        return BASELINE_DECODE_CONFIG
    fp8 = cache_dtype == torch.float8_e4m3fn
    if num_seqs is not None and num_seqs < FP8_TILE_MIN_SEQS:  # few: the bf16 tile, and early
        return TUNED_DECODE_CONFIG if fp8 else FEW_SEQS_DECODE_CONFIG  # loads where measured
    return TUNED_FP8_DECODE_CONFIG if fp8 else TUNED_DECODE_CONFIG


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int,
    config: DecodeConfig = BASELINE_DECODE_CONFIG,
) -> int:  # fmt: skip
    """Enough splits for ~programs_per_sm programs per SM, each split >= min_tokens_per_split."""
    wanted = triton.cdiv(config.programs_per_sm * num_sms, num_seqs * num_kv_heads)
    longest_useful = triton.cdiv(max_context, config.min_tokens_per_split)
    return max(1, min(wanted, longest_useful, MAX_SPLITS))


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    order_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qs,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_btb,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_lses,
    stride_lseh,
    QUERY_GROUP_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: part_out_ptr is the output, (seq, head) rows, its dtype
    ORDERED: tl.constexpr,  # grid (split, head, rank): the rank-th sequence is order[rank]
    WHOLE_TILES: tl.constexpr,  # [lo, whole_hi) unmasked, then [whole_hi, hi) masked
    EARLY: tl.constexpr,  # the first key tile's older keys are loaded before the wait
    PDL: tl.constexpr,
):
    launch_dependents(PDL)  # the merge (or o_proj's GEMV) may be scheduled as this one drains
    if not EARLY:
        wait_for_previous(PDL)  # q and the newest key are the previous kernel's writes
    if ORDERED:  # programs start in grid order: every program of the longest sequence first
        split, num_splits = tl.program_id(0), tl.num_programs(0)
        seq = tl.load(order_ptr + tl.program_id(2))
    else:
        split, num_splits = tl.program_id(2), tl.num_programs(2)
        seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * tokens_per_split
    hi = tl.minimum(seq_len, lo + tokens_per_split)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    if EARLY:  # the inputs (seq_lens, order, block tables) were copied in before the step
        offs_n = lo + tl.arange(0, BLOCK_N)
        first = offs_n < hi
        block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=first, other=0)
        k_ptrs = k_cache_ptr + block.to(tl.int64)[:, None] * stride_kcb
        k_ptrs += (offs_n % BLOCK_SIZE)[:, None] * stride_kcs + kv_head * stride_kch
        v_ptrs = v_cache_ptr + block.to(tl.int64)[:, None] * stride_vcb
        v_ptrs += (offs_n % BLOCK_SIZE)[:, None] * stride_vcs + kv_head * stride_vch
        # keys before the newest were stored by earlier steps: read while the kernel before
        # this one (which stores the newest) still runs
        older = (first & (offs_n < seq_len - 1))[:, None]
        k_first = tl.load(k_ptrs + offs_d[None, :], mask=older, other=0.0)
        v_first = tl.load(v_ptrs + offs_d[None, :], mask=older, other=0.0)
        wait_for_previous(PDL)
        newest = (first & (offs_n == seq_len - 1))[:, None]  # in the last split's tile only
        k_first = tl.where(newest, tl.load(k_ptrs + offs_d[None, :], mask=newest), k_first)
        v_first = tl.where(newest, tl.load(v_ptrs + offs_d[None, :], mask=newest), v_first)

    heads = kv_head * QUERY_GROUP_SIZE + offs_h  # the query heads sharing this KV head
    head_mask = (offs_h < QUERY_GROUP_SIZE)[:, None]
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    q_pos = seq_len - 1 + tl.zeros([BLOCK_H], dtype=tl.int32)  # the newest position: sees all
    if EARLY:
        if lo < hi:  # an empty split folds nothing: all -inf scores would make NaNs
            q_op = operand_query(q, k_cache_ptr)
            qk = tl.dot(q_op, tl.trans(k_first.to(q_op.dtype)))
            qk = tl.where(first[None, :], qk, float("-inf"))
            p, alpha, l_i, m_i = softmax_step(qk, m_i, l_i, qk_scale)
            acc = tl.dot(p.to(q_op.dtype), v_first.to(q_op.dtype), acc * alpha[:, None])
        lo += BLOCK_N
    if WHOLE_TILES:  # every key < hi is visible: only the last tile can run past the end
        whole_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = attn_tiles(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            lo, whole_hi, qk_scale,
            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, MASK=False,
        )  # fmt: skip
        lo = whole_hi
    acc, l_i, m_i = attn_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        lo, hi, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        BLOCK_SIZE, HEAD_DIM, BLOCK_N, MASK=True,
    )  # fmt: skip

    # an empty split (lo >= seq_len) keeps l_i == 0: output 0, lse = -inf, merge weight 0
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    part_row = seq.to(tl.int64) * stride_pos + heads * stride_poh + split * stride_pop
    part_ptrs = part_out_ptr + part_row[:, None] + offs_d[None, :]
    if DIRECT:
        tl.store(part_ptrs, out.to(part_out_ptr.dtype.element_ty), mask=head_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_ptrs, out, mask=head_mask)
        lse_ptrs = part_lse_ptr + seq * stride_lses + heads * stride_lseh + split
        tl.store(lse_ptrs, lse, mask=offs_h < QUERY_GROUP_SIZE)


# exercise 7.2: merging split-K partial results
@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_lses,
    stride_lseh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)  # the partial outputs
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_splits
    lse_ptrs = part_lse_ptr + seq * stride_lses + head * stride_lseh + offs_s
    lse = tl.load(lse_ptrs, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # a padded row (seq_len 0) has only empty splits: every weight 0, output 0, never NaN
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2(lse - lse_max)  # an empty split: exp2(-inf) = 0
    part_ptrs = part_out_ptr + seq.to(tl.int64) * stride_pos + head * stride_poh
    part_ptrs += offs_s[:, None] * stride_pop + offs_d[None, :]
    parts = tl.load(part_ptrs, mask=split_mask[:, None], other=0.0)  # (BLOCK_SPLITS, HEAD_DIM)
    weight_sum = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(weight_sum > 0, weight_sum, 1.0)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, `q` `[num_seqs, H, D]`, over its paged context.

    seq_lens: int32 `[num_seqs]`, context length including this step's token (0: a padded row).
    block_tables: int32 `[num_seqs, max_blocks_per_seq]`.
    num_splits: None picks one from the batch and `max_blocks_per_seq * block_size` (an upper
    bound on the context read without a device sync).
    out: where to write (q's shape and dtype), else a new tensor. Returns it.
    order: int32 `[num_seqs]`, a permutation of the sequences, longest context first: their
    programs start in that order (None: batch order).
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power of two"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert seq_lens.shape == (num_seqs,) and block_tables.shape[0] == num_seqs
    config = config or default_decode_config(q.device, True, k_cache.dtype, q.shape[0])
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_sms = (
            torch.cuda.get_device_properties(q.device).multi_processor_count
            if q.device.type == "cuda"
            else INTERPRETER_NUM_SMS
        )
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms, config)

    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_seqs == 0:
        return out
    direct = num_splits == 1 and config.direct_single_split
    if direct:  # the split kernel's (seq, head, split) rows are the output's (seq, head) rows
        part_out, part_lse = out.unsqueeze(2), out.new_empty(1, 1, dtype=torch.float32)
    else:
        part_out = q.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_lse = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    group = num_heads // num_kv_heads
    pdl = config.pdl and supports_pdl(q.device)
    ordered = order is not None
    assert not ordered or order.shape == (num_seqs,)
    grid = (num_splits, num_kv_heads, num_seqs) if ordered else (num_seqs, num_kv_heads, num_splits)
    _paged_decode_split_kernel[grid](
        q, k_cache, v_cache, seq_lens, block_tables, order if ordered else seq_lens,
        part_out, part_lse,
        scale * LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        QUERY_GROUP_SIZE=group,
        BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        DIRECT=direct,
        ORDERED=ordered,
        WHOLE_TILES=config.whole_tiles,
        EARLY=early_loads_apply(config, num_heads, head_dim),
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(pdl),
    )  # fmt: skip
    if direct:
        return out
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        PDL=pdl,
        **pdl_launch(pdl),
    )  # fmt: skip
    return out
