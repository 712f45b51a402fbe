"""Small-batch linear layers as a bandwidth-bound GEMV: y = x @ W^T for a few rows of x.

Problem: at batch 1-16 a linear layer does 2 FLOPs per weight it reads, far below the GPU's
ridge point (~176 FLOP/byte on the H200): its time should be its weight's bytes over the memory
bandwidth. Qwen3-0.6B's layers hold 2-12 MB, 0.5-3 µs at 4.2 TB/s, yet cuBLAS takes 6-8 µs each
on them at batch 1 (0.8-2.0 TB/s, benchmarks/results/roofline_cuda.json): a few hundred KB per SM
is too little work for a kernel tuned for large matrices, and 112 such layers are ~0.7 ms of a
token. The smaller ones (1,024 output features) are also too few rows to keep every SM busy.

Idea: stream W once with every SM pulling, and start pulling early. Two kernels:
- the tile kernel (`tile=True`, every layer of a decoder at 1-16 rows): one program owns
  BLOCK_N output features and one K-range, and loads its whole [BLOCK_N, BLOCK_K] slice of W in
  one go (8-64 KB: one memory latency, many bytes in flight). Launched with programmatic
  dependent launch (kernels/pdl.py), it issues those loads while the kernel before it is still
  finishing, and only then waits for x. At 1-2 rows it multiplies and sums on the CUDA cores
  (8-row tiles are allowed, so narrow layers need no K split); from 3 rows, tl.dot on rows
  padded to 16. With `silu_mul` its input is [gate | up] and x = silu(gate) * up is computed as
  it is loaded: the down projection needs no SiLU-and-mul kernel of its own. With `add_norm` its
  input is the residual add and RMSNorm before it (norm.py): each program loads x and the
  residual stream, adds them and normalizes the whole row itself (a few KB from L2, where every
  program finds them), and the first writes the sum back as the new stream: QKV and gate_up need
  no fused_add_rms_norm kernel of their own. Only where a program's slice spans all of K.
- the K-loop kernel (shapes not swept, but for 1-2 rows of a K in 4,096-wide slices): [BLOCK_N,
  BLOCK_K] tiles of W, software-pipelined, accumulated with tl.dot on rows padded to
  BLOCK_M = 16.
A layer with few output tiles may split K into SPLIT_K ranges so that every SM has work; each
program writes its fp32 partial sum, and the last of a tile's programs to finish (an atomic
counter per tile) adds the partials and stores y: one launch, no separate reduce kernel. The
sweep (benchmarks/phase7_gemv.py) found the split's round trip costs ~1.5 µs, so the tuned configs
avoid it where 8-row tiles give enough programs.

Invariants:
- x (M, K) (or (M, 2K) with `silu_mul`; with `add_norm`, x and the residual alike) with
  M <= BLOCK_M and a contiguous last dim; W (N, K) contiguous (the checkpoint layout); y (M, N)
  in x's dtype; fp32 inputs are multiplied in full fp32 (no TF32);
- before its `gdc_wait` a kernel loads only W (immutable) and writes nothing (kernels/pdl.py);
- `add_norm`: the new stream goes to a new tensor, never the residual read: other programs may
  still be reading the old one while the first writes it;
- `counters` (int32, one per output tile) are zero between calls: a tile's last program resets
  its own, so one buffer serves every call of a layer and every CUDA graph replay; no two calls
  sharing a buffer run at the same time (one stream);
- K-loop: split s covers K positions [s * K / SPLIT_K, (s + 1) * K / SPLIT_K); SPLIT_K * BLOCK_K
  divides K when EVEN_K, so no load along K needs a mask. Tile: BLOCK_K * SPLIT_K == K, or one
  masked slice (SPLIT_K 1, BLOCK_K >= K).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_dependents, pdl_launch, supports_pdl, wait_for_previous

BLOCK_M = 16  # x's rows, padded, for tl.dot: its smallest M on a GPU (config.MAX_GEMV_BATCH)
MIN_BLOCK_N = 8  # the multiply-and-sum path's narrowest tile (tl.dot's is 16)
PROGRAMS_PER_SM = 2  # the split heuristic's aim
WIDE_N = 32768  # output features from which a layer is an LM head: wider tiles
MAX_SUM_ROWS = 2  # rows up to which the untuned rule multiplies and sums (tile kernel, no dot)
MAX_TILE_K = 4096  # the untuned rule's widest slice: [8, 4096] bf16, 64 KB over 4 warps


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes, K split and launch parameters; `default_gemv_config` picks one per shape.

    `tile`: each program loads its whole [block_n, block_k] slice of W at once (block_k *
    split_k == K) instead of looping over K; `dot`: tl.dot on rows padded to 16, or (tile only)
    multiply-and-sum on the CUDA cores; `pdl`: launched with programmatic dependent launch, W's
    loads issued before the wait for the previous kernel (tile only: the loop waits first)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    tile: bool = False
    dot: bool = True
    pdl: bool = False

    def __post_init__(self):
        smallest = 16 if self.dot else MIN_BLOCK_N
        for tile in (self.block_n, self.block_k):
            if tile < smallest or tile != triton.next_power_of_2(tile):
                raise ValueError(f"tiles must be powers of two >= {smallest}, got {self}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self}")
        if not self.dot and not self.tile:
            raise ValueError(f"the K loop multiplies with tl.dot only, got {self}")


def default_gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    if device.type != "cuda":  # the interpreter: few, large programs are quick
        if m <= MAX_SUM_ROWS:  # what a GPU runs at 1-2 rows: the tile kernel, whole rows of x
            return _tile(64, triton.next_power_of_2(k), 1, 4)
        return GemvConfig(block_n=64, block_k=64, split_k=1, num_warps=4, num_stages=1)
    return gemv_config_for(m, n, k, torch.cuda.get_device_properties(device).multi_processor_count)


# The H200 sweep (benchmarks/phase7_gemv.py, 2026-12-02), Qwen3-0.6B's layers, bf16: per (N, K),
# the best tile config at 1 row, at 2 rows (multiply-and-sum on the CUDA cores) and at 3-16 rows
# (tl.dot), all launched with PDL; µs per call at 1 row (the K loop before it; cuBLAS): qkv 3.10
# (5.76; 5.45), o_proj 2.08 (5.28; 12.69), gate_up 4.37 (6.64; 6.45), down 4.16 (5.92; 7.55).
def _tile(block_n, block_k, split_k, num_warps, dot=False) -> GemvConfig:
    return GemvConfig(block_n, block_k, split_k, num_warps, 1, tile=True, dot=dot, pdl=True)


TUNED_H200 = {  # (N, K): (1 row, 2 rows, 3-16 rows)
    (4096, 1024): (_tile(16, 1024, 1, 4), _tile(8, 1024, 1, 4), _tile(16, 1024, 1, 4, True)),
    (1024, 2048): (_tile(8, 2048, 1, 8), _tile(8, 2048, 1, 4), _tile(64, 256, 8, 4, True)),
    (6144, 1024): (_tile(8, 1024, 1, 4), _tile(16, 1024, 1, 4), _tile(32, 512, 2, 4, True)),
    (1024, 3072): (_tile(8, 512, 6, 4), _tile(64, 128, 24, 4), _tile(64, 512, 6, 8, True)),
}
H200_SMS = 132


def gemv_config_for(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """The sweep's best for a shape it measured (on the H200's 132 SMs); otherwise, at 1-2 rows
    of a K that MAX_TILE_K divides, the tile kernel's 8-row slices (`untuned_tile_config`), else the
    K loop with a tile per program narrow enough that the output tiles alone cover the SMs
    (BLOCK_N 16 or 32, 64 for an LM head's vocabulary), and a K split only for layers too narrow
    for that (~2 per SM). What the sweep found: a layer of a few MB is bound by a kernel's start
    and its first loads' latency, not by bytes; loading a program's whole slice of W at once,
    before waiting for the previous kernel (PDL), hides most of it, and a K split costs ~1.5 µs
    (the partial sums' round trip), so layers with few outputs take 8-row tiles instead."""
    tuned = TUNED_H200.get((n, k)) if num_sms == H200_SMS else None
    if tuned is not None:
        return tuned[min(m, 3) - 1]
    untuned_tile = untuned_tile_config(m, k)
    if untuned_tile is not None:
        return untuned_tile
    if n >= WIDE_N:
        block_n, block_k = 64, 128
    elif triton.cdiv(n, 32) < num_sms <= triton.cdiv(n, 16):
        block_n, block_k = 16, 256
    else:
        block_n, block_k = 32, 128
    split_k = 1
    if triton.cdiv(n, block_n) < num_sms:
        split_k = choose_split_k(n, k, block_n, block_k, PROGRAMS_PER_SM * num_sms)
    return GemvConfig(block_n, block_k, split_k, num_warps=4, num_stages=4)


# Qwen3-8B's layers at 1 row on an H100 (2026-12-05; bf16, W cold in L2, in a CUDA graph), µs per
# call, cuBLAS / the K loop / 8-row tiles of up to 4,096 on the CUDA cores: qkv (6144, 4096) 23.6
# / 23.0 / 20.5, o_proj (4096, 4096) 17.8 / 16.1 / 14.6, gate_up (24576, 4096) 78.5 / 76.0 / 72.1,
# down (4096, 12288) 43.3 / 42.9 / 41.5 (split 3), lm_head (151936, 4096) 440.7 / 413.4 / 398.5.
# 16-row slices of 2,048 were slower everywhere, by a hair on down (41.8, split 6). Measured at 1
# row; 2 rows take the same kind of config, as they do in the Qwen3-0.6B sweep above.
def untuned_tile_config(m: int, k: int) -> GemvConfig | None:
    """The tile kernel for 1-2 rows of a shape not swept whose K is a multiple of MAX_TILE_K
    (the K measured above): 8-row slices of W, K split into MAX_TILE_K-wide slices. None for
    other shapes (narrower K, as Qwen3.5's or an LM head over 1,024 features, was not measured
    this way): the K loop."""
    if m > MAX_SUM_ROWS or k % MAX_TILE_K != 0:
        return None
    return _tile(MIN_BLOCK_N, MAX_TILE_K, k // MAX_TILE_K, 4)


def choose_split_k(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """The largest split of K into whole BLOCK_K chunks that keeps the grid near `programs`
    (an uneven K is not split)."""
    chunks = k // block_k if k % block_k == 0 else 1
    wanted = max(1, triton.cdiv(programs, triton.cdiv(n, block_n)))
    return max(s for s in range(1, chunks + 1) if chunks % s == 0 and s <= wanted)


def silu_mul_pays(config: GemvConfig, device: torch.device) -> bool:
    """Whether to fold SiLU-and-mul into x's load under `config`: on the H200 it saves the
    separate kernel's ~3 µs at 1-2 rows (multiply-and-sum), while with tl.dot (3+ rows) the
    fused load measured 2-4x slower than the two kernels. On CPU (the interpreter): always."""
    return device.type != "cuda" or not config.dot


def add_norm_fits(config: GemvConfig, k: int) -> bool:
    """Whether `config` can fold the residual add and RMSNorm into x's load: each program must
    see whole rows of x (one slice over all of K) and multiply on the CUDA cores (1-2 rows)."""
    return config.tile and not config.dot and config.split_k == 1 and config.block_k >= k


def counters_for(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed split-K counter buffer large enough for any config of an n-feature layer."""
    return torch.zeros(triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device)


@triton.jit
def _load_x(ptrs, mask, K, SILU_MUL: tl.constexpr):
    """x's values at `ptrs` in fp32; with SILU_MUL the input is [gate | up] (K each) and x is
    silu(gate) * up, rounded to the input's dtype as fused.silu_and_mul's output would be."""
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype).to(tl.float32)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_add_norm(x_row, res_row, res_out_row, norm_w_ptr, offs_k, k_mask, K, eps, write):
    """norm(x + residual) for one row in fp32, each step rounded as fused.fused_add_rms_norm
    rounds it (the sum to the dtype, then the normed row); with `write` the sum goes to
    `res_out_row` (the new residual stream)."""
    x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
    r = tl.load(res_row + offs_k, mask=k_mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    # `write` broadcast to a vector first: Triton's interpreter takes no scalar in a mask
    tl.store(res_out_row + offs_k, h, mask=k_mask & (tl.zeros_like(offs_k) + write != 0))
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / K + eps)
    gain = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return (h * rstd * gain).to(x.dtype).to(tl.float32)


@triton.jit
def _store_or_reduce(acc, y_ptr, partial_ptr, counters_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_n, split, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """Stores a program's (BLOCK_M, BLOCK_N) fp32 sums as y; with a K split, as a partial sum
    that the tile's last program (an atomic counter) adds up and stores."""
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]  # partial sums: (SPLIT_K, BLOCK_M, N) fp32
        tl.store(partial_ptr + split * BLOCK_M * N + tile, acc, mask=out_mask)
        # every thread's stores are done (barrier) and, by the atomic's release, visible to the
        # GPU before the count; its acquire makes the others' partials visible to the last one
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, offs_n.shape[0]], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # ".cg": from L2, where the other SMs wrote
                total += tl.load(partial_ptr + s * BLOCK_M * N + tile, mask=out_mask,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counters_ptr + pid_n, 0)  # zero again for the next call


@triton.jit
def _gemv_tile_kernel(
    x_ptr, w_ptr, y_ptr, partial_ptr, counters_ptr,
    res_ptr, res_out_ptr, norm_w_ptr, eps,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ADD_NORM: tl.constexpr,
    PDL: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One program, one [BLOCK_N, BLOCK_K] slice of W (BLOCK_K * SPLIT_K >= K), loaded at once."""
    launch_dependents(PDL)  # the next kernel may start: it waits for this one before reading
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    k_mask = offs_k < K  # all true unless K is no power of two (one split, its tail masked)
    w = tl.load(w_ptrs, mask=(offs_n < N)[:, None] & k_mask[None, :], other=0.0)  # no dependency
    wait_for_previous(PDL)  # x: the previous kernel's output (and y's memory: its to read)
    if DOT:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x = _load_x(x_ptrs, (offs_m < M)[:, None] & k_mask[None, :], K, SILU_MUL).to(w.dtype)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w))
    else:  # a few rows: multiply and sum on the CUDA cores, row by row
        wf = w.to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = tl.minimum(m, M - 1)  # a padded row recomputes the last one, never stored
            if ADD_NORM:  # the new stream (rows of K, contiguous): the first program writes it
                xm = _load_add_norm(x_ptr + row * stride_xm, res_ptr + row * K,
                                    res_out_ptr + row * K, norm_w_ptr, offs_k, k_mask, K, eps,
                                    ((pid_n == 0) & (m < M)).to(tl.int32))  # fmt: skip
            else:
                xm = _load_x(x_ptr + row * stride_xm + offs_k, k_mask, K, SILU_MUL)
            ym = tl.sum(wf * xm[None, :], axis=1)
            acc = tl.where(offs_m[:, None] == m, ym[None, :], acc)
    _store_or_reduce(acc, y_ptr, partial_ptr, counters_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_n, split, BLOCK_M, SPLIT_K)  # fmt: skip


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, partial_ptr, counters_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """A K loop over [BLOCK_N, BLOCK_K] tiles of W, software-pipelined (num_stages)."""
    launch_dependents(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    wait_for_previous(PDL)
    for start in range(k_lo, k_hi, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = _load_x(x_ptrs + offs_k[None, :], m_mask[:, None], K, SILU_MUL)
            w = tl.load(w_ptrs + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (offs_k < k_hi)[None, :]
            x = _load_x(x_ptrs + offs_k[None, :], m_mask[:, None] & k_mask, K, SILU_MUL)
            w = tl.load(w_ptrs + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
        if IEEE:
            acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
    _store_or_reduce(acc, y_ptr, partial_ptr, counters_ptr, offs_m, offs_n, M, N, stride_ym,
                     pid_n, split, BLOCK_M, SPLIT_K)  # fmt: skip


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    counters: torch.Tensor,
    config: GemvConfig | None = None,
    silu_mul: bool = False,
    pdl: bool = True,
    add_norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x (M, K), M <= 16, weight (N, K) -> x @ weight^T (M, N). With `silu_mul`, x is (M, 2K) =
    [gate | up] and the product is silu(gate) * up @ weight^T (fused.silu_and_mul folded into the
    load). With `add_norm` = (residual, gain, eps, stream), the product is of RMSNorm(x + residual)
    and x + residual is written to `stream` (not `residual`'s memory): fused.fused_add_rms_norm
    folded into the load, under a config that `add_norm_fits`. `counters`: `counters_for(N)`,
    kept by the caller (zero between calls). `pdl=False` never launches with programmatic
    dependent launch, whatever the config says."""
    m, n, k = x.shape[0], *weight.shape
    assert x.shape[1] == (2 * k if silu_mul else k) and weight.dtype == x.dtype and m <= BLOCK_M
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    config = config or default_gemv_config(m, n, k, x.device)
    tiles = triton.cdiv(n, config.block_n)
    assert counters.dtype == torch.int32 and counters.numel() >= tiles
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if add_norm is not None:
        residual, gain, eps, stream = add_norm
        assert not silu_mul and add_norm_fits(config, k), f"no add + norm under {config}, K={k}"
        assert residual.shape == stream.shape == x.shape and gain.shape == (k,)
        assert residual.is_contiguous() and stream.is_contiguous()
        assert residual.dtype == stream.dtype == x.dtype
        assert stream.data_ptr() != residual.data_ptr(), "never in place: see the invariants"
    else:
        residual = stream = gain = y  # unused (ADD_NORM off)
        eps = 0.0
    if m == 0:
        return y
    split_k = config.split_k
    block_m = BLOCK_M if config.dot else triton.next_power_of_2(m)
    partial = y.new_empty(split_k, block_m, n, dtype=torch.float32) if split_k > 1 else y
    use_pdl = pdl and config.pdl and supports_pdl(x.device)
    args = (x, weight, y, partial, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    common = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  SPLIT_K=split_k, SILU_MUL=silu_mul, PDL=use_pdl, IEEE=x.dtype == torch.float32,
                  num_warps=config.num_warps, num_stages=config.num_stages,
                  **pdl_launch(use_pdl))  # fmt: skip
    if config.tile:
        assert config.block_k * split_k == k or (split_k == 1 and config.block_k >= k), (
            f"a tile config covers K exactly, or in one masked slice: {config}, K={k}"
        )
        _gemv_tile_kernel[(tiles, split_k)](
            *args[:5], residual, stream, gain, eps, *args[5:],
            DOT=config.dot, ADD_NORM=add_norm is not None, **common,
        )  # fmt: skip
    else:
        assert add_norm is None
        even_k = k % (split_k * config.block_k) == 0
        _gemv_kernel[(tiles, split_k)](*args, EVEN_K=even_k, **common)
    return y
