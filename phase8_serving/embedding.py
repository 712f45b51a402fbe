"""Token embedding: turning token ids into vectors.

Problem: a token id is an arbitrary integer; 1017 is not "close" to 1018 in any useful sense.
Idea: give every id its own learned row in a `(vocab_size, hidden_size)` table. Looking a token up
is the same as multiplying its one-hot vector by the table, only without materializing the
one-hot (that is what the tests check against).
"""

import torch
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        # Unit-variance rows: after RMSNorm the scale does not matter, and N(0, 1) keeps logits of a
        # random model far from ties, which makes greedy decoding comparable across phases.
        self.weight = nn.Parameter(torch.randn(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]  # (..., ) -> (..., hidden_size)
