"""Multi-head causal self-attention with grouped key/value heads (GQA).

Problem: a token's meaning depends on the tokens before it ("bank" after "river" vs "money").
Idea: every token emits a query, a key and a value; it takes a softmax-weighted average of the
values of earlier tokens, weighted by how well its query matches their keys. Several heads do this
in parallel on slices of the hidden vector. Grouped-query attention (Ainslie et al., 2023) lets
`num_heads / num_kv_heads` query heads share one key/value head: less memory for keys and values,
which is what an inference engine spends its memory on (phases 3-5).

Invariant: token t attends to tokens 0..t only (causal); the result for token t never depends on
tokens after it, which is what makes caching keys and values (phase 3) exact.
"""

import math

import torch
from torch import nn

from .rope import RotaryEmbedding


# exercise 0.4: causal attention with grouped KV heads
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Readable reference attention. q: (B, H, T, D); k, v: (B, H_kv, T, D) -> (B, H, T, D).

    Materializes the full (T, T) score matrix: O(T^2) memory, fine for teaching, the reason
    FlashAttention exists (phase 7).
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # each KV head serves `group` query heads
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
