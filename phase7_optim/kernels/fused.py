"""Fused element-wise kernels: RMSNorm (alone, or after the residual add), SiLU-and-multiply,
per-head q/k RMSNorm + RoPE (alone, or with the KV-cache store), an attention output's sigmoid
gate.

Problem: in torch each line of norm.py, rope.py and mlp.py is its own kernel: an RMSNorm is seven
(upcast, square, mean, add eps, rsqrt, multiply, downcast, gain), q/k norm + RoPE on both q and k
about thirty. A decode step of a 28-layer model launches some 1,800 kernels, each a few
microseconds however little it does: at small batch, and even inside a CUDA graph, they take longer
than the matmuls. Measured on the H200 before these kernels: 4.4 ms per token single-stream
(CUDA graphs), 6.7 ms per decode step at <= 64 sequences against 1.7 ms of bytes to read.
Idea: one program per row (per token: all its heads at once for q/k) loads it once, does all the
arithmetic in fp32 registers, and stores the result once: one kernel instead of seven or thirty,
each byte read and written once. Neighbours that read what the other wrote fuse further (vLLM's
`fused_add_rms_norm`, and its rotary + cache-write kernels): the residual add with the norm after
it, and q/k norm + RoPE with the store of k and v into the paged cache. The torch modules stay the
readable definition; these kernels are checked against them (tests/phase7/test_fused.py).

Invariants:
- the last dimension of every input is contiguous; rows may be strided (q, k and v are views into
  the fused qkv projection's output);
- `rms_norm`: y = x / sqrt(mean(x^2) + eps) * weight, in fp32, stored in x's dtype; with
  `offset` the gain is 1 + weight (Qwen3.5 stores w - 1), added in fp32 inside the kernel so the
  gain is no extra launch;
- `fused_add_rms_norm`: residual <- x + residual (rounded to the dtype, as torch's add), then
  y = rms_norm(residual): bit for bit the unfused add followed by `rms_norm`'s arithmetic;
- `silu_and_mul`: x = [gate | up] along the last dim -> silu(gate) * up;
- `qk_norm_rope`: each head vector is RMS-normalized with its gain (q's or k's; skipped when the
  model has no q/k norm), then rotated by its token's position with the half-split (HF) pairing
  of rope.py: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); with `rotary_dim` < head_dim
  (partial RoPE) only the first rotary_dim dims rotate, the rest are normalized only;
- `qk_norm_rope_store`: the same for q and k, and k (rotated) and v go to the paged cache at
  `slot_mapping` (kv_store.py's contract: PAD_SLOT_ID writes nothing); returns q only;
- `sigmoid_gate_mul`: x (N, H * D) times sigmoid(gate), gate (N, H, D) a strided view (Qwen3.5's
  q projection interleaves [q | gate] per head).
"""

import torch
import triton
import triton.language as tl

from . import PAD_SLOT_ID
from .kv_store import store_cast
from .pdl import launch_dependents, pdl_launch, supports_pdl, wait_for_previous

SILU_BLOCK = 1024  # columns of SiLU-and-multiply per program


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr,
    OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # a GEMV after it may start loading its weights (kernels/pdl.py)
    wait_for_previous(PDL)  # x: the previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # Qwen3.5's gain 1 + w, in fp32
        w += 1.0
    tl.store(
        out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True, offset: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (..., C) -> same shape and dtype. `pdl`: launched with
    programmatic dependent launch where the GPU has it (kernels/pdl.py); `offset`: gain 1 + w."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    assert x2.stride(-1) == 1 and weight.shape == (n_cols,)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    pdl = pdl and supports_pdl(x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), n_cols, eps,
            BLOCK=triton.next_power_of_2(n_cols), OFFSET=offset, PDL=pdl,
            **pdl_launch(pdl),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, residual_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
    BLOCK: tl.constexpr,
    OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded like torch's `x + residual`
    tl.store(residual_ptr + row * stride_r + offs, h, mask=mask)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # Qwen3.5's gain 1 + w, in fp32
        w += 1.0
    tl.store(
        out_ptr + row * stride_o + offs, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl: bool = True,
    offset: bool = False,
) -> torch.Tensor:
    """residual += x (in place), then RMSNorm of it -> a new tensor; x, residual (N, C) alike."""
    n_rows, n_cols = residual.shape
    assert x.shape == residual.shape and x.dtype == residual.dtype and weight.shape == (n_cols,)
    assert x.stride(-1) == residual.stride(-1) == 1
    out = torch.empty_like(residual)
    pdl = pdl and supports_pdl(x.device)
    if n_rows:
        _fused_add_rms_norm_kernel[(n_rows,)](
            x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n_cols, eps,
            BLOCK=triton.next_power_of_2(n_cols), OFFSET=offset, PDL=pdl,
            **pdl_launch(pdl),
        )  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x (N, 2 * I) = [gate | up] -> silu(gate) * up, (N, I)."""
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    assert x.stride(-1) == 1 and x.shape[1] == 2 * n_cols
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    pdl = pdl and supports_pdl(x.device)
    if n_rows:
        grid = (n_rows, triton.cdiv(n_cols, SILU_BLOCK))
        _silu_and_mul_kernel[grid](
            x, out, x.stride(0), out.stride(0), n_cols, BLOCK=SILU_BLOCK, PDL=pdl, **pdl_launch(pdl)
        )  # fmt: skip
    return out


@triton.jit
def _gain(w_ptr, offs, mask, OFFSET: tl.constexpr):
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        w += 1.0
    return w


@triton.jit
def _norm_rope_heads(
    src, dst, w_ptr, cos, sin, rows, eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    NORM: tl.constexpr,
    OFFSET: tl.constexpr,
):  # fmt: skip
    """Head vectors at `src` (pointers to each row's first element), `rows` masking the padded
    ones, into `dst`: RMSNorm each over HEAD_DIM with the gain at `w_ptr` (if NORM; 1 + w if
    OFFSET), then RoPE on its first 2 * HALF dims; the TAIL (a power of two >= HEAD_DIM - 2 *
    HALF, 0 when every dim rotates) is normalized only. Arithmetic in fp32."""
    offs = tl.arange(0, HALF)
    m = rows[:, None]
    x1 = tl.load(src[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src[:, None] + HALF + offs[None, :], mask=m, other=0.0).to(tl.float32)
    if TAIL:  # partial RoPE: the dims past the rotated ones
        t_offs = 2 * HALF + tl.arange(0, TAIL)
        t_in = t_offs < HEAD_DIM
        x3 = tl.load(src[:, None] + t_offs[None, :], mask=m & t_in[None, :], other=0.0)
        x3 = x3.to(tl.float32)
    if NORM:
        square_sum = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if TAIL:
            square_sum += tl.sum(x3 * x3, 1)
        rstd = 1.0 / tl.sqrt(square_sum / HEAD_DIM + eps)
        x1 = x1 * rstd[:, None] * _gain(w_ptr, offs, offs < HALF, OFFSET)[None, :]
        x2 = x2 * rstd[:, None] * _gain(w_ptr + HALF, offs, offs < HALF, OFFSET)[None, :]
        if TAIL:
            x3 = x3 * rstd[:, None] * _gain(w_ptr, t_offs, t_in, OFFSET)[None, :]
    # rounded to the input's dtype first, as the unfused path (rotate, then store) rounds, so an
    # fp8 cache holds the same bytes either way
    y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(src.dtype.element_ty)
    y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(src.dtype.element_ty)
    out = dst[:, None] + offs[None, :]
    tl.store(out, store_cast(y1, out), mask=m)
    tl.store(out + HALF, store_cast(y2, out), mask=m)
    if TAIL:
        t_out = dst[:, None] + t_offs[None, :]
        tl.store(t_out, store_cast(x3.to(src.dtype.element_ty), t_out), mask=m & t_in[None, :])


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, positions_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos,
    n_heads, eps,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    NORM: tl.constexpr,
    OFFSET: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs, heads = tl.arange(0, HALF), tl.arange(0, BLOCK_H)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_cos + offs)
    sin = tl.load(sin_ptr + position * stride_cos + offs)
    src = x_ptr + token * stride_xt + heads * stride_xh
    dst = out_ptr + token * stride_ot + heads * stride_oh
    _norm_rope_heads(
        src, dst, w_ptr, cos, sin, heads < n_heads, eps, HEAD_DIM, HALF, TAIL, NORM, OFFSET
    )


def rope_layout(head_dim: int, cos: torch.Tensor) -> dict:
    """The kernels' HEAD_DIM, HALF (rotated pairs: cos's columns) and TAIL (unrotated dims, as a
    power of two; 0 for full RoPE)."""
    half = cos.shape[-1]
    assert 0 < 2 * half <= head_dim and half == triton.next_power_of_2(half), "tl.arange: 2^k"
    tail = head_dim - 2 * half
    return dict(HEAD_DIM=head_dim, HALF=half, TAIL=triton.next_power_of_2(tail) if tail else 0)


def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    offset: bool = False,
) -> torch.Tensor:
    """x (N, heads, D): per-head RMSNorm with `weight` (None: none; `offset`: gain 1 + weight),
    then RoPE at `positions` (N,) with the (max_pos, R / 2) fp32 tables `cos`, `sin` on the first
    R dims of each head (R = D: all of them) -> a new contiguous (N, heads, D)."""
    n_tokens, n_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.stride() == sin.stride()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_tokens:
        _qk_norm_rope_kernel[(n_tokens,)](
            x, weight if weight is not None else x, out, cos, sin, positions,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            n_heads, eps,
            BLOCK_H=triton.next_power_of_2(n_heads),
            NORM=weight is not None,
            OFFSET=offset,
            **rope_layout(head_dim, cos),
        )  # fmt: skip
    return out


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos,
    n_heads, n_kv_heads, eps,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    NORM: tl.constexpr,
    OFFSET: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # decode attention may be scheduled as this one drains
    # The position, its cos and sin, and the slot are the step's inputs and a fixed table: read
    # before the wait, the two dependent loads (position, then cos/sin) overlap the kernel before.
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_cos + offs)
    sin = tl.load(sin_ptr + position * stride_cos + offs)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    wait_for_previous(PDL)  # q, k, v: the qkv projection's output
    heads = tl.arange(0, BLOCK_H)
    src = q_ptr + token * stride_qt + heads * stride_qh
    dst = q_out_ptr + token * stride_ot + heads * stride_oh
    _norm_rope_heads(
        src, dst, q_w_ptr, cos, sin, heads < n_heads, eps, HEAD_DIM, HALF, TAIL, NORM, OFFSET
    )

    if slot != PAD_SLOT:  # a CUDA graph's padded row writes nowhere
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        kv_heads = tl.arange(0, BLOCK_KV)
        kv_rows = kv_heads < n_kv_heads
        k_src = k_ptr + token * stride_kt + kv_heads * stride_kh
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kv_heads * stride_kch
        _norm_rope_heads(
            k_src, k_dst, k_w_ptr, cos, sin, kv_rows, eps, HEAD_DIM, HALF, TAIL, NORM, OFFSET
        )
        dims = tl.arange(0, HEAD_DIM)
        v_src = v_ptr + token * stride_vt + kv_heads * stride_vh
        v = tl.load(v_src[:, None] + dims[None, :], mask=kv_rows[:, None])
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kv_heads * stride_vch
        v_out = v_dst[:, None] + dims[None, :]
        tl.store(v_out, store_cast(v, v_out), mask=kv_rows[:, None])


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: bool = True,
    offset: bool = False,
) -> torch.Tensor:
    """q (N, H, D), k and v (N, Hkv, D): `qk_norm_rope` of q and k, with k and v stored into the
    paged caches at `slot_mapping` (N,) in the same launch -> the rotated q, (N, H, D)."""
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    assert k.shape == v.shape == (n_tokens, n_kv_heads, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (n_kv_heads, head_dim)
    assert (q_weight is None) == (k_weight is None) and slot_mapping.shape == (n_tokens,)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and cos.stride() == sin.stride()
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power of two"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    pdl = pdl and supports_pdl(q.device)
    if n_tokens:
        norm = q_weight is not None
        _qk_norm_rope_store_kernel[(n_tokens,)](
            q, k, v, q_weight if norm else q, k_weight if norm else k, out, k_cache, v_cache,
            cos, sin, positions, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.stride(0),
            n_heads, n_kv_heads, eps,
            BLOCK_H=triton.next_power_of_2(n_heads),
            BLOCK_KV=triton.next_power_of_2(n_kv_heads),
            BLOCK_SIZE=k_cache.shape[1],
            NORM=norm,
            OFFSET=offset,
            PAD_SLOT=PAD_SLOT_ID,
            PDL=pdl,
            **rope_layout(head_dim, cos),
            **pdl_launch(pdl),
        )  # fmt: skip
    return out


@triton.jit
def _sigmoid_gate_mul_kernel(
    x_ptr, gate_ptr, out_ptr, stride_x, stride_gt, stride_gh, stride_o,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # o_proj's GEMV may start loading its weights
    wait_for_previous(PDL)  # x: the attention output
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + row * stride_x + head * HEAD_DIM + offs).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_gt + head * stride_gh + offs).to(tl.float32)
    y = x / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + head * HEAD_DIM + offs, y.to(out_ptr.dtype.element_ty))


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x (N, H * D) contiguous rows, gate (N, H, D) with a contiguous last dim -> x * sigmoid(gate)
    as (N, H * D) in x's dtype (one launch where torch takes a copy, a sigmoid and a product)."""
    n_rows, n_heads, head_dim = gate.shape
    assert x.shape == (n_rows, n_heads * head_dim) and x.stride(-1) == gate.stride(-1) == 1
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power of two"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    pdl = pdl and supports_pdl(x.device)
    if n_rows:
        _sigmoid_gate_mul_kernel[(n_rows, n_heads)](
            x, gate, out, x.stride(0), gate.stride(0), gate.stride(1), out.stride(0),
            HEAD_DIM=head_dim, PDL=pdl, **pdl_launch(pdl),
        )  # fmt: skip
    return out
