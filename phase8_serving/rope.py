"""Rotary position embedding (RoPE): telling attention where tokens are.

Problem: attention is a weighted sum over a set; without position information "dog bites man" and
"man bites dog" look the same.
Idea (Su et al., 2021): rotate each (x_i, x_{i + d/2}) pair of a query/key by an angle proportional
to the token's position. The dot product of a rotated query and key then depends only on their
relative distance. Positions are passed explicitly, so later phases can feed any token at any
position (a decode step, a chunk in the middle of a prompt) without changing this file.
The half-split pairing (not interleaved) is the Hugging Face convention, so real checkpoints load
unchanged in phase 6.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        # Not parameters: derived from the config, so not in the state dict.
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (max_pos, d/2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.max_position = max_position

    # exercise 0.3: rotary position embedding (RoPE)
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (..., T, num_heads, head_dim), positions: (..., T) -> same shape as x."""
        cos = self.cos[positions].unsqueeze(-2)  # (..., T, 1, d/2)
        sin = self.sin[positions].unsqueeze(-2)
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)
