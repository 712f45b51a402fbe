"""SwiGLU feed-forward block: the per-token "thinking" between attention layers.

Problem: attention only mixes information across tokens; each token also needs a nonlinear
transformation of its own vector.
Idea (Shazeer, 2020): down(silu(gate(x)) * up(x)). The gate decides, channel by channel, how much of
the up-projection passes. Names match Hugging Face checkpoint keys (down_proj), except that
gate_proj and up_proj are stacked in one matmul, `gate_up_proj` (the loader fills its two halves).

Phase 7 (tensor parallelism, linear.py): gate_up_proj is column-parallel and down_proj
row-parallel, so each rank computes the SwiGLU of its own slice of the intermediate features and
the block needs one all-reduce, inside down_proj.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import DEFAULT_KERNELS, KernelConfig
from .distributed import TensorParallel
from .linear import MergedColumnParallelLinear, RowParallelLinear
from .norm import PendingNorm


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        super().__init__()
        sizes = (intermediate_size, intermediate_size)  # shard ids 0: gate_proj, 1: up_proj
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, tp, kernels=kernels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, kernels)
        self.kernels = kernels

    def forward(self, x: "torch.Tensor | PendingNorm") -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (N, 2 * I / size); x: see norm.PendingNorm
        if self.down_proj.matmul.folds_silu_mul(gate_up, self.down_proj.weight):
            return self.down_proj(gate_up, silu_mul=True)  # no separate kernel (kernels/gemv.py)
        if self.kernels.use_triton(gate_up):  # one fused kernel instead of three (kernels/fused.py)
            from .kernels.fused import silu_and_mul  # here: CPU-only installs may lack Triton

            return self.down_proj(silu_and_mul(gate_up, self.kernels.programmatic_launch))
        gate, up = gate_up.chunk(2, dim=-1)  # (N, I / size) each
        return self.down_proj(F.silu(gate) * up)
