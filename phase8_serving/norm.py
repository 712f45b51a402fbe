"""RMSNorm: keeping activations at a stable scale.

Problem: summing residual branches layer after layer lets the hidden state's magnitude drift.
Idea (Zhang & Sennrich, 2019): divide by the root-mean-square of the vector, multiply by a learned
per-channel gain. Unlike LayerNorm there is no mean subtraction and no bias. The reduction runs in
float32 because bf16 squares overflow and lose precision long before the result does.

Phase 7: on CUDA the same function runs as one fused Triton kernel (kernels/fused.py). Every norm
of the decoder stack follows a residual add, so `forward(x, residual)` takes both, as vLLM's
RMSNorm does: residual <- x + residual, then the norm of it, and returns both; with
`fuse_add_rms_norm` that is one kernel instead of an add and a norm. At one or two rows even
that kernel goes (`fold_norm_into_gemv`): told which linear layer reads it (`into`), the norm
leaves the add and itself to that layer's GEMV, which computes both as it loads its input
(kernels/gemv.py), and hands that layer a `PendingNorm` instead of a tensor.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import DEFAULT_KERNELS, KernelConfig

if TYPE_CHECKING:  # linear.py imports this file
    from .linear import ColumnParallelLinear


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, kernels: KernelConfig = DEFAULT_KERNELS
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.kernels = kernels

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        into: "ColumnParallelLinear | None" = None,
    ) -> torch.Tensor | tuple["torch.Tensor | PendingNorm", torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual). `into`:
        the one layer that reads the norm; where its GEMV computes the add and the norm itself
        (`folds_norm`), the first is a `PendingNorm` for it, and the second the tensor it will
        write the stream into."""
        if residual is None:
            return self._norm(x)
        if into is not None and into.matmul.folds_norm(x, into.weight):
            stream = torch.empty_like(residual)
            return PendingNorm(x, residual, self, stream, into), stream
        if self.kernels.fuse_add_rms_norm and self.kernels.use_triton(x):
            from .kernels.fused import fused_add_rms_norm  # here: CPU-only installs lack Triton

            # the kernel adds into `residual` in place: callers use the returned stream only
            pdl = self.kernels.programmatic_launch
            return fused_add_rms_norm(x, residual, self.weight, self.eps, pdl), residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.use_triton(x):  # one fused kernel instead of seven (kernels/fused.py)
            from .kernels.fused import rms_norm  # here: CPU-only installs may lack Triton

            return rms_norm(x, self.weight, self.eps, self.kernels.programmatic_launch)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass(frozen=True)
class PendingNorm:
    """norm(x + residual), not computed: the input of the layer `into` alone, whose GEMV adds,
    normalizes and writes x + residual into `stream` as it loads x. It has no shape and no
    values, so anything else that tries to read it fails at once."""

    x: torch.Tensor
    residual: torch.Tensor
    norm: RMSNorm
    stream: torch.Tensor
    into: nn.Module
