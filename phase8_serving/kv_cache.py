"""KV cache tensors as a pool of fixed-size blocks.

Problem: phase 4 kept each sequence's keys/values in one contiguous region of a flat slot pool;
regions fragment the pool and are reserved for a sequence's maximum length.
Idea: per layer one (num_blocks, block_size, num_kv_heads, head_dim) tensor for keys and one for
values. Which blocks belong to which sequence is the block manager's business (block_manager.py);
this file only stores and holds tensors, and copies whole blocks between two pools (the GPU pool
and the CPU pool that swapped-out sequences wait in). A token's slot is
block_id * block_size + offset, so the model writes through a flat `slot_mapping` as in phase 4.

Invariant: slot s lives at [s // block_size, s % block_size].

Phase 7: the cache also carries the attention backend that writes and reads it
(attention_backend.py), chosen once from its device: the kernels on CUDA, the torch path elsewhere.
"""

import torch

from .attention_backend import AttentionBackend, select_attention_backend


class KVCache:
    """The block pool's tensors: keys and values of every layer, and the backend using them."""

    def __init__(
        self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
        attention_backend: AttentionBackend | None = None,  # None: the device's default
    ):  # fmt: skip
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.attention_backend = attention_backend or select_attention_backend(torch.device(device))


def copy_blocks(src: KVCache, dst: KVCache, copies: list[tuple[int, int]]) -> None:
    """Copies every layer's (src block, dst block) pairs, e.g. GPU -> CPU to swap a sequence out.
    One gather and one scatter per tensor: a GPU <-> CPU copy is one transfer, not one per block."""
    if not copies:
        return
    src_ids = torch.tensor([s for s, _ in copies], device=src.k[0].device)
    dst_ids = torch.tensor([d for _, d in copies], device=dst.k[0].device)
    for src_pool, dst_pool in zip(src.k + src.v, dst.k + dst.v, strict=True):
        dst_pool[dst_ids] = src_pool[src_ids].to(dst_pool.device)
