"""KV cache tensors as one shared pool of token slots.

Problem: phase 3 gave every batch row a cache as long as the longest request, and the batch could
not change. Continuous batching (phase 4) needs sequences to come and go, so their keys/values must
live in one shared pool that sequences borrow from and give back.
Idea: per layer one (num_slots, num_kv_heads, head_dim) tensor for keys and one for values. Which
slots belong to which sequence is the block manager's business (block_manager.py); this file only
stores and holds tensors, and copies a region's keys/values when the block manager moves it. The
model writes through a flat `slot_mapping`: slot = region start + position.
"""

import torch

from .block_manager import RegionMove


class KVCache:
    """The slot pool's tensors: keys and values of every layer, indexed by slot."""

    def __init__(self, num_layers, num_slots, num_kv_heads, head_dim, dtype, device):
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """Writes new keys/values (N, H_kv, D) into their slots (N,)."""
        self.k[layer][slot_mapping] = k
        self.v[layer][slot_mapping] = v

    def move(self, moves: list[RegionMove]) -> None:
        """Copies moved regions' keys/values, in order (a later move may reuse an earlier one's
        old slots)."""
        for m in moves:
            src = slice(m.src_start, m.src_start + m.num_slots)
            dst = slice(m.dst_start, m.dst_start + m.num_slots)
            for k, v in zip(self.k, self.v, strict=True):
                k[dst] = k[src].clone()  # clone: the two ranges may overlap
                v[dst] = v[src].clone()
