"""Attention backends: how a step's K/V reach the paged cache and queries read it, and the one
place a backend is chosen.

Problem: attention.py's `context_attention` gathers every context out of the paged cache and
writes the whole score matrix to memory: on a GPU that traffic is the cost. The Triton kernels
(kernels/) read the cache in place, but need Triton and a GPU; a CPU needs the readable path,
which is also the kernels' oracle.
Idea: a backend is a `store` (the step's new K/V into their slots) and an `attend` (the queries
against the cache); `Attention` (attention.py) calls the one its KV cache carries and never asks
which. `select_attention_backend` picks it once per cache, from the cache's device, as vLLM's
`attention/selector.py` does: on CUDA `TritonAttention` (the KV-store kernel, then the varlen
paged FlashAttention kernel when any sequence brings more than one new token, the paged decode
kernel for the decodes); elsewhere `TorchAttention`, phase 6's `KVCache.store` and
`context_attention` as they were.

Invariants: both backends take the same `ForwardBatch` and give the same result (the tests hold
the kernels to the torch path). This file imports kernels/ only inside `TritonAttention`, so it
imports on a CPU-only install without Triton; the kernels import nothing of the engine.
"""

from dataclasses import replace

import torch

from .attention import ForwardBatch, context_attention
from .config import DEFAULT_KERNELS, KernelConfig
from .kernels import FP8_E4M3_MAX, PAD_SLOT_ID


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache's element type (kv_cache.py): for fp8, saturated first (torch's cast gives
    NaN past 448, e4m3fn having no inf), then rounded to nearest even."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


class TorchAttention:
    """The readable path (CPU, and the oracle on a GPU): phase 6's store, which now skips padded
    rows, and context_attention."""

    def store(self, k, v, k_cache, v_cache, batch: ForwardBatch) -> None:
        slots = batch.slot_mapping
        padded = slots == PAD_SLOT_ID  # such rows write nowhere (-1 would index the last slot)
        if padded.any():  # a host sync, and a copy: this path is not captured in a CUDA graph
            keep = ~padded
            slots, k, v = slots[keep], k[keep], v[keep]
        k_cache.flatten(0, 1)[slots] = to_cache_dtype(k, k_cache.dtype)  # (slots, H_kv, D) view
        v_cache.flatten(0, 1)[slots] = to_cache_dtype(v, v_cache.dtype)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, kernels: KernelConfig):
        return context_attention(q, k_cache, v_cache, batch)

    def __call__(self, q, k, v, k_cache, v_cache, batch, kernels=DEFAULT_KERNELS) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, batch)
        return self.attend(q, k_cache, v_cache, batch, kernels)


class TritonAttention:
    """The CUDA path: the kernels read the paged cache in place; no host sync, so a decode step
    can be captured in a CUDA graph."""

    def __init__(self):
        # Imported here, not at the top: CPU-only installs (macOS, Windows) may have no Triton.
        from . import kernels

        self.kernels = kernels

    def store(self, k, v, k_cache, v_cache, batch: ForwardBatch) -> None:
        self.kernels.store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, kernels: KernelConfig):
        scale = q.shape[-1] ** -0.5
        decodes = batch.seq_lens.shape[0] if batch.max_query_len == 1 else batch.num_decodes
        config = self.kernels.default_decode_config(
            q.device, kernels.tune_decode_attention, k_cache.dtype, decodes
        )
        if config.pdl and not kernels.programmatic_launch:  # a new config only for the lever
            config = replace(config, pdl=False)
        order = batch.decode_order if config.longest_first else None
        if batch.max_query_len == 1:  # decode-only step: one query per sequence
            return self.kernels.paged_decode_attention(
                q, k_cache, v_cache, batch.seq_lens, batch.block_tables, scale, config=config,
                order=order,
            )  # fmt: skip
        # A mixed step: its leading decodes (tokens 0 … d - 1) go to the decode kernel. In the
        # prefill kernel a decode fills one row of each head's BLOCK_M-row tile and reads its
        # whole context in one program: W's first steps (prompts beside up to 230 decodes) spent
        # over a third of their time in the prefill kernel on an H200.
        d, out = batch.num_decodes, torch.empty_like(q)
        if d:
            self.kernels.paged_decode_attention(
                q[:d], k_cache, v_cache, batch.seq_lens[:d], batch.block_tables[:d], scale,
                config=config, out=out[:d], order=order,
            )  # fmt: skip
        return self.kernels.flash_attn_varlen_paged(
            q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            batch.max_query_len, scale, out=out, first_seq=d,
        )  # fmt: skip

    def __call__(self, q, k, v, k_cache, v_cache, batch, kernels=DEFAULT_KERNELS) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, batch)
        return self.attend(q, k_cache, v_cache, batch, kernels)


AttentionBackend = TorchAttention | TritonAttention


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """The one place the backend is chosen: Triton kernels on CUDA, torch elsewhere."""
    return TritonAttention() if device.type == "cuda" else TorchAttention()
