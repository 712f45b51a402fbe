"""Linear layers split across the ranks of a tensor-parallel group (Megatron-LM's scheme).

Problem: a decode step reads every weight once, so one GPU's memory bandwidth bounds it, and a
model larger than one GPU (Llama-3-70B: 141 GB of bf16) does not run at all.
Idea (Shoeybi et al., 2019): a team splitting one matrix. Each of `size` ranks holds a slice of
every weight matrix and computes its slice of the product; one all-reduce per pair of layers
puts the pieces together.
- `ColumnParallelLinear` splits the output features: rank r computes its own columns of y from the
  whole input, with no communication.
- `RowParallelLinear` splits the input features: rank r multiplies its slice of x (exactly what the
  column-parallel layer before it produced) by its rows of W^T and gets a partial sum of y; an
  all-reduce adds the partial sums.
A decoder layer pairs them: QKV (column) -> attention, head by head -> o_proj (row); gate/up
(column) -> SiLU * up -> down_proj (row). Two all-reduces per layer, nothing else.
`MergedColumnParallelLinear` stacks several column-parallel outputs (gate and up) in one matmul;
`QKVParallelLinear` stacks q, k and v, whose head counts differ. With fewer KV heads than ranks,
each KV head is replicated on the ranks whose query heads use it (as vLLM does).

Every layer's product runs through `LinearKernel`: cuBLAS, or below `gemv_max_batch` rows the
bandwidth-bound GEMV kernel (kernels/gemv.py), on the same weight.

Invariants:
- with `tp.size == 1` each layer computes a plain `x @ W^T`: no process group, no communication;
- `weight` has the checkpoint layout (out_features, in_features) of this rank's slice, and
  `shard(shard_id)` says which piece of which checkpoint tensor fills which rows or columns
  (loader.py reads exactly that piece, nothing more).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import DEFAULT_KERNELS, KernelConfig
from .distributed import TensorParallel, all_reduce
from .norm import PendingNorm


@dataclass(frozen=True)
class WeightShard:
    """The piece of one checkpoint tensor that this rank holds, and where it goes in its weight:
    checkpoint[start : start + size] along `dim` -> weight[dest_start : dest_start + size]."""

    full_shape: tuple[int, ...]  # the checkpoint tensor's shape (checked before loading)
    dim: int  # 0: output features (rows), 1: input features (columns)
    start: int
    size: int
    dest_start: int = 0

    @classmethod
    def whole(cls, shape: torch.Size) -> "WeightShard":
        """A replicated tensor (a norm's gain): every rank holds all of it."""
        return cls(tuple(shape), 0, 0, shape[0])


class LinearKernel:
    """y = x @ W^T for one layer's weight: cuBLAS, or for a few rows on the Triton path the GEMV
    kernel, which keeps its split-K counters here (one zeroed buffer per layer, kernels/gemv.py)."""

    def __init__(self, kernels: KernelConfig):
        self.kernels = kernels
        self.counters: torch.Tensor | None = None  # made on the first GEMV, on x's device

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        silu_mul: bool = False,
        add_norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x @ W^T; with `silu_mul` (only where `folds_silu_mul` said so) x is [gate | up] and
        the product is silu(gate) * up @ W^T; with `add_norm` = (residual, gain, eps, stream)
        (only where `folds_norm` said so) it is RMSNorm(x + residual) @ W^T, and the sum goes to
        `stream`."""
        if not self.kernels.use_gemv(x):
            return F.linear(x, weight)
        from .kernels.gemv import counters_for, gemv  # here: CPU-only installs may lack Triton

        if self.counters is None:
            self.counters = counters_for(weight.shape[0], x.device)
        pdl = self.kernels.programmatic_launch
        return gemv(x, weight, self.counters, silu_mul=silu_mul, pdl=pdl, add_norm=add_norm)

    def folds_silu_mul(self, gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this product of `gate_up`'s SiLU-and-mul runs it inside the GEMV's load."""
        if not (self.kernels.fuse_silu_into_gemv and self.kernels.use_gemv(gate_up)):
            return False
        from .kernels.gemv import default_gemv_config, silu_mul_pays

        n, k = weight.shape
        config = default_gemv_config(gate_up.shape[0], n, k, gate_up.device)
        return silu_mul_pays(config, gate_up.device)

    def folds_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this product of RMSNorm(x + residual) runs the add and the norm inside the
        GEMV's load (kernels/gemv.py: 1-2 rows, each program holding whole rows of x)."""
        if not (self.kernels.fold_norm_into_gemv and self.kernels.use_gemv(x)):
            return False
        from .kernels.gemv import add_norm_fits, default_gemv_config

        n, k = weight.shape
        return add_norm_fits(default_gemv_config(x.shape[0], n, k, x.device), k)


def linear_weight(rows: tuple[int, ...], cols: int) -> nn.Parameter:
    """nn.Linear's initialization (uniform, bound 1/sqrt(cols)) of stacked blocks of rows, drawn
    block after block: with one rank, a random model gets the weights separate nn.Linears would
    (phase 0's, given the same seed)."""
    blocks = [torch.empty(n, cols) for n in rows]
    for block in blocks:
        nn.init.kaiming_uniform_(block, a=math.sqrt(5))
    return nn.Parameter(torch.cat(blocks))


class ColumnParallelLinear(nn.Module):
    """y = x @ W^T with W's rows (output features) split across ranks: y stays split."""

    def __init__(
        self,
        input_size: int,
        output_sizes: tuple[int, ...],
        tp: TensorParallel,
        local_sizes: tuple[int, ...] | None = None,  # None: each output split evenly
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        super().__init__()
        self.tp = tp
        self.matmul = LinearKernel(kernels)
        self.input_size = input_size
        self.output_sizes = output_sizes  # one per checkpoint tensor stacked in this weight
        even = (
            tuple(tp.split(n, "output features") for n in output_sizes) if not local_sizes else ()
        )
        self.local_sizes = local_sizes or even
        self.weight = linear_weight(self.local_sizes, input_size)

    def shard(self, shard_id: int = 0) -> WeightShard:
        size = self.local_sizes[shard_id]
        full_shape = (self.output_sizes[shard_id], self.input_size)
        dest_start = sum(self.local_sizes[:shard_id])  # stacked after the shards before it
        return WeightShard(full_shape, 0, self.tp.rank * size, size, dest_start)

    def forward(self, x: "torch.Tensor | PendingNorm") -> torch.Tensor:
        if isinstance(x, PendingNorm):  # norm(x + residual), left to this GEMV (norm.py)
            assert x.into is self, "a PendingNorm is for the layer it was made for"
            add_norm = (x.residual, x.norm.weight, x.norm.eps, x.stream)
            return self.matmul(x.x, self.weight, add_norm=add_norm)
        return self.matmul(x, self.weight)  # (N, in) -> (N, sum(local_sizes))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input in one matmul: gate_proj and up_proj
    (shard ids 0 and 1) are read from their own checkpoint tensors into one weight."""


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj in one matmul, split by heads: rank r holds query heads
    [r * H / size, (r + 1) * H / size) and the KV heads those queries read."""

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TensorParallel,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        local_heads = tp.split(num_heads, "num_heads")
        local_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        # Sized by heads, not total / size: a replicated KV head is not an even split.
        local = (local_heads * head_dim, local_kv_heads * head_dim, local_kv_heads * head_dim)
        super().__init__(hidden_size, (q, kv, kv), tp, local, kernels)
        self.num_heads, self.num_kv_heads, self.head_dim = local_heads, local_kv_heads, head_dim
        self.first_kv_head = tp.rank * num_kv_heads // tp.size  # replicas share a head index

    def shard(self, shard_id: str) -> WeightShard:
        index = self.SHARD_IDS.index(shard_id)
        size = self.local_sizes[index]
        first_row = self.tp.rank * size if shard_id == "q" else self.first_kv_head * self.head_dim
        full_shape = (self.output_sizes[index], self.input_size)
        return WeightShard(full_shape, 0, first_row, size, sum(self.local_sizes[:index]))


def kv_heads_per_rank(num_kv_heads: int, tp: TensorParallel) -> int:
    """Split KV heads like query heads; with fewer KV heads than ranks, each rank keeps one (a
    replica: ranks sharing it write the same keys and values into their own caches)."""
    if num_kv_heads >= tp.size:
        return tp.split(num_kv_heads, "num_kv_heads")
    if tp.size % num_kv_heads != 0:
        raise ValueError(
            f"tensor_parallel_size ({tp.size}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}) to replicate KV heads across ranks"
        )
    return 1


class RowParallelLinear(nn.Module):
    """y = x @ W^T with W's columns (input features) split across ranks: each rank multiplies
    its slice of x, and an all-reduce sums the partial products into the whole y on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TensorParallel,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        super().__init__()
        self.tp = tp
        self.matmul = LinearKernel(kernels)
        self.input_size = input_size
        self.output_size = output_size
        self.weight = linear_weight((output_size,), tp.split(input_size, "input features"))

    def shard(self, shard_id: None = None) -> WeightShard:
        size = self.weight.shape[1]
        return WeightShard((self.output_size, self.input_size), 1, self.tp.rank * size, size)

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """x (N, in / size), or with `silu_mul` [gate | up] (N, 2 * in / size), whose SiLU-and-mul
        the GEMV computes as it loads it (`LinearKernel.folds_silu_mul` says when)."""
        y = self.matmul(x, self.weight, silu_mul)  # -> (N, out): this rank's partial sum
        return all_reduce(y, self.tp)
