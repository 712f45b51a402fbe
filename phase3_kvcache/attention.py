"""Multi-head causal self-attention with grouped key/value heads (GQA).

Problem: a token's meaning depends on the tokens before it ("bank" after "river" vs "money").
Idea: every token emits a query, a key and a value; it takes a softmax-weighted average of the
values of earlier tokens, weighted by how well its query matches their keys. Several heads do this
in parallel on slices of the hidden vector. Grouped-query attention (Ainslie et al., 2023) lets
`num_heads / num_kv_heads` query heads share one key/value head: less memory for keys and values,
which is what an inference engine spends its memory on (phases 3-5).

Invariant: token t attends to tokens 0..t only (causal); the result for token t never depends on
tokens after it, which is what makes caching keys and values (phase 3) exact.

Phase 3: keys and values come from the KV cache, so the T new queries attend to S >= T keys (the
queries are the last T of them), and left-padded rows mask their padding keys out.
"""

import math

import torch
from torch import nn

from .kv_cache import KVCache
from .rope import RotaryEmbedding


# exercise 3.2: the static batch's causal and padding mask
def hidden_keys_mask(
    T: int, S: int, padding_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """True where query i (the (S - T + i)-th position) must not see key j. -> (B or 1, 1, T, S).

    Future keys are hidden, and so are padding keys (padding_mask: (B, S), True = padding), except
    that a padding query still sees itself: its row then stays finite instead of softmax(all -inf)
    = NaN, which would leak into real rows through 0 * NaN in the next layer.
    """
    query_pos = torch.arange(S - T, S, device=device)[:, None]  # (T, 1)
    key_pos = torch.arange(S, device=device)[None, :]  # (1, S)
    hidden = (key_pos > query_pos)[None, None]  # (1, 1, T, S)
    if padding_mask is not None:
        hidden = hidden | (padding_mask[:, None, None, :] & (key_pos != query_pos))
    return hidden


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Readable reference attention. q: (B, H, T, D); k, v: (B, H_kv, S, D) -> (B, H, T, D).

    Materializes the full (T, S) score matrix: O(T * S) memory, fine for teaching, the reason
    FlashAttention exists (phase 7).
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # each KV head serves `group` query heads
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    hidden = hidden_keys_mask(q.shape[2], k.shape[2], padding_mask, q.device)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        layer_idx: int,
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
        self.layer_idx = layer_idx  # which of the cache's layers this module reads and writes

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, S, H_kv, D): history + new
        out = causal_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), padding_mask
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
