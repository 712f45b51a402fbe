"""Fused element-wise kernels: RMSNorm, SiLU-and-multiply, per-head q/k RMSNorm + RoPE.

Problem: in torch each line of norm.py, rope.py and mlp.py is its own kernel: an RMSNorm is seven
(upcast, square, mean, add eps, rsqrt, multiply, downcast, gain), q/k norm + RoPE on both q and k
about thirty. A decode step of a 28-layer model launches some 1,800 kernels, each a few
microseconds however little it does: at small batch, and even inside a CUDA graph, they take longer
than the matmuls. Measured on the H200 before these kernels: 4.4 ms per token single-stream
(CUDA graphs), 6.7 ms per decode step at <= 64 sequences against 1.7 ms of bytes to read.
Idea: one program per row (per token, or per token and head) loads it once, does all the
arithmetic in fp32 registers, and stores the result once: one kernel instead of seven or thirty,
each byte read and written once. The torch modules stay the readable definition; these kernels
are checked against them (tests/phase7/test_fused.py).

Invariants:
- the last dimension of every input is contiguous; rows may be strided (q and k are views into
  the fused qkv projection's output);
- `rms_norm`: y = x / sqrt(mean(x^2) + eps) * weight, in fp32, stored in x's dtype;
- `silu_and_mul`: x = [gate | up] along the last dim -> silu(gate) * up;
- `qk_norm_rope`: each head vector is RMS-normalized with its gain (q's or k's; skipped when the
  model has no q/k norm), then rotated by its token's position with the half-split (HF) pairing
  of rope.py: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
"""

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns of SiLU-and-multiply per program


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (..., C) -> same shape and dtype."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    assert x2.stride(-1) == 1 and weight.shape == (n_cols,)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), n_cols, eps,
            BLOCK=triton.next_power_of_2(n_cols),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (N, 2 * I) = [gate | up] -> silu(gate) * up, (N, I)."""
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    assert x.stride(-1) == 1 and x.shape[1] == 2 * n_cols
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    if n_rows:
        grid = (n_rows, triton.cdiv(n_cols, SILU_BLOCK))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n_cols, BLOCK=SILU_BLOCK)
    return out


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, positions_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos,
    eps,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF)
    src = x_ptr + token * stride_xt + head * stride_xh
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        x1 = x1 * rstd * tl.load(w_ptr + offs).to(tl.float32)
        x2 = x2 * rstd * tl.load(w_ptr + HALF + offs).to(tl.float32)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_cos + offs)
    sin = tl.load(sin_ptr + position * stride_cos + offs)
    dst = out_ptr + token * stride_ot + head * stride_oh
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty))
    tl.store(dst + HALF + offs, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty))


def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """x (N, heads, D): per-head RMSNorm with `weight` (None: none), then RoPE at `positions`
    (N,) with the (max_pos, D / 2) fp32 tables `cos`, `sin` -> a new contiguous (N, heads, D)."""
    n_tokens, n_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.shape[-1] * 2 == head_dim and cos.stride() == sin.stride()
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power of two"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_tokens:
        _qk_norm_rope_kernel[(n_tokens, n_heads)](
            x, weight if weight is not None else x, out, cos, sin, positions,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            eps,
            HALF=head_dim // 2,
            NORM=weight is not None,
        )  # fmt: skip
    return out
