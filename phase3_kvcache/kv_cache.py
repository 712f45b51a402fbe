"""KV cache: remember every layer's keys and values instead of recomputing them.

Problem: in phases 1-2 each new token re-runs the model over the whole history, although the keys
and values of earlier tokens never change (attention is causal: token t only sees 0..t).
Idea: keep them. Prefill runs the prompt once and stores its keys/values; each decode step feeds
one new token per row, appends its key/value, and attends over the stored ones. A step now costs
O(current length) attention plus O(1) everything else, instead of O(length) full forwards.

Layout: per layer one (B, max_len, num_kv_heads, head_dim) tensor for keys and one for values,
allocated up front for the longest sequence the batch may reach. All rows advance together
(static batching), so one `length` describes every row; rows shorter than the longest prompt are
left-padded and their padding slots are masked out of attention.

Invariant: slots [0, length) of every layer hold the keys/values of the tokens fed so far.
"""

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    # exercise 3.1: the KV cache append
    def update(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores (B, T, H_kv, D) new keys/values after the cached ones; returns all of them.

        `length` moves forward only in `advance()`, once every layer has stored this step.
        """
        end = self.length + k_new.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens do not fit in max_len={self.max_len}")
        self.k[layer][:, self.length : end] = k_new
        self.v[layer][:, self.length : end] = v_new
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
