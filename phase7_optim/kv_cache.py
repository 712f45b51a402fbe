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
It may hold fp8 instead of the model's dtype (`kv_cache_dtype="fp8"`, vLLM's name): half the bytes,
so twice the blocks in the same memory, and half the bytes a decode step reads (which bounds a
large batch on an H100; on an H200 the kernel's work per key bounds it as much: phase 7's
README). Writers saturate to +-448 and round to nearest even (attention_backend.py's
`to_cache_dtype`, the kernels' `store_cast`); readers widen each tile in registers and compute
as before. There is no scale (vLLM's default without calibrated scales is 1 too): e4m3 keeps 3
mantissa bits, a relative error of at most 1/16 per element from 2^-6 to 448, and a scale would
only move that window (SmolLM2's keys and values: none past 448, 2 % below 2^-6;
benchmarks/phase7_kv_cache_dtype.py).
"""

import torch

from .attention_backend import AttentionBackend, select_attention_backend


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device) -> torch.dtype:
    """The element type of the KV cache. fp8 on CUDA needs compute capability 8.9 (Ada, Hopper):
    older GPUs have no fp8 conversions, and the kernels would fail to compile mid-start-up."""
    dtype = model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn  # KV_CACHE_DTYPES
    device = torch.device(device)
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                f"(fp8 conversions), this one is {capability[0]}.{capability[1]}"
            )
    return dtype


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
