"""Token embedding and the LM head, with the vocabulary split across tensor-parallel ranks.

Problem: a token id is an arbitrary integer; 1017 is not "close" to 1018 in any useful sense.
Idea: give every id its own learned row in a `(vocab_size, hidden_size)` table. Looking a token up
is the same as multiplying its one-hot vector by the table, only without materializing the
one-hot (that is what the tests check against). The LM head is the way back: logits = h @ W^T
against a table of the same shape (for tied models, the same table).

Phase 7 (tensor parallelism): the table is the largest matrix of a small model (Qwen3-0.6B: 156M
of its 596M parameters), so it is split by rows, as vLLM's `VocabParallelEmbedding`: rank r holds
the rows of ids [r * V / size, (r + 1) * V / size).
- lookup: each rank looks up the ids in its range and writes zeros for the others; an all-reduce
  sums the rows, and exactly one rank contributed each;
- LM head (`ParallelLMHead`): each rank computes the logits of its own ids, and an all-gather
  concatenates them in rank order, which is vocabulary order.

Invariant: with `tp.size == 1` both are the plain lookup and matmul, no communication.
"""

import torch
from torch import nn

from .config import DEFAULT_KERNELS, KernelConfig
from .distributed import TensorParallel, all_gather_last_dim, all_reduce
from .linear import LinearKernel, WeightShard, linear_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        rows = tp.split(vocab_size, "vocab_size")
        self.vocab_start, self.vocab_end = tp.rank * rows, (tp.rank + 1) * rows
        self.weight = self.initial_weight(rows, hidden_size)

    def initial_weight(self, rows: int, hidden_size: int) -> nn.Parameter:
        # Unit-variance rows: after RMSNorm the scale does not matter, and N(0, 1) keeps logits of a
        # random model far from ties, which makes greedy decoding comparable across phases.
        return nn.Parameter(torch.randn(rows, hidden_size))

    def shard(self, shard_id: None = None) -> WeightShard:
        rows = self.vocab_end - self.vocab_start
        return WeightShard((self.vocab_size, self.hidden_size), 0, self.vocab_start, rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight[input_ids]  # (..., ) -> (..., hidden_size)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)  # row 0 stands in; zeroed
        rows = self.weight[local_ids] * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(rows, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden (R, C) -> logits (R, vocab_size) on every rank; same row split as the embedding,
    so a tied head shares the embedding's shard."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):  # fmt: skip
        super().__init__(vocab_size, hidden_size, tp)
        self.matmul = LinearKernel(kernels)  # at batch 1 the largest GEMV of the step

    def initial_weight(self, rows: int, hidden_size: int) -> nn.Parameter:
        return linear_weight((rows,), hidden_size)  # an nn.Linear's, as phase 0's head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, self.weight)  # (R, V / size): this rank's ids
        return all_gather_last_dim(logits, self.tp)
