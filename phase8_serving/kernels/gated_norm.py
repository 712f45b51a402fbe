"""Gated RMSNorm: the output gate of a Gated DeltaNet layer, y = rmsnorm(o) * weight * silu(z).

Problem: gated_delta.py's `gated_rms_norm` is some nine torch kernels (upcast, square, mean, add
eps, rsqrt, multiply, downcast, gain, SiLU of the gate, two products), each reading and writing
the (N, H_v, d_v) output of the rule again: for a decode step they are launches, not bytes.
Idea: as fused.py's `rms_norm`, one program per block of head vectors loads o and the gate z once,
does the arithmetic in fp32 registers and stores y once.

Invariants:
- x and gate (..., d_v) alike, the norm over the last dim (each head on its own, Qwen3.5's
  per-head norm); the last dim is contiguous, rows may be strided;
- the normalized x is rounded to x's dtype before the gain, as the reference rounds it; the rest
  is fp32 and y is stored in x's dtype.
"""

import torch
import triton
import triton.language as tl

from .pdl import launch_dependents, pdl_launch, supports_pdl, wait_for_previous

BLOCK_ROWS = 16  # head vectors per program


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, stride_x, stride_g, stride_o, n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # the out-projection GEMV may start loading its weights
    wait_for_previous(PDL)  # x: the rule's output
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows) & (offs < n_cols)
    x = tl.load(x_ptr + rows * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1, keep_dims=True) / n_cols + eps)
    x = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference rounds it
    z = tl.load(gate_ptr + rows * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    y = w * x * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = True
) -> torch.Tensor:
    """x, gate (..., D), weight (D,) -> rmsnorm(x) * weight * silu(gate), x's shape and dtype.
    `pdl`: kernels/pdl.py."""
    n_cols = x.shape[-1]
    assert gate.shape == x.shape and weight.shape == (n_cols,)
    x2, gate2 = x.reshape(-1, n_cols), gate.reshape(-1, n_cols)  # views unless rows interleave
    assert x2.stride(-1) == gate2.stride(-1) == 1
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    pdl = pdl and supports_pdl(x.device)
    n_rows = x2.shape[0]
    if n_rows:
        _gated_rms_norm_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
            x2, gate2, weight, out, x2.stride(0), gate2.stride(0), out.stride(0), n_rows, n_cols,
            eps, BLOCK_ROWS=BLOCK_ROWS, BLOCK=triton.next_power_of_2(n_cols), PDL=pdl,
            **pdl_launch(pdl),
        )  # fmt: skip
    return out.view(x.shape)
