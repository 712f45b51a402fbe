"""Multi-head causal self-attention with grouped key/value heads (GQA), over a flattened batch.

Problem: a token's meaning depends on the tokens before it ("bank" after "river" vs "money").
Idea: every token emits a query, a key and a value; it takes a softmax-weighted average of the
values of earlier tokens, weighted by how well its query matches their keys. Several heads do this
in parallel on slices of the hidden vector. Grouped-query attention (Ainslie et al., 2023) lets
`num_heads / num_kv_heads` query heads share one key/value head: less memory for keys and values,
which is what an inference engine spends its memory on (phases 3-5).

Invariant: token t attends to tokens 0..t only (causal); the result for token t never depends on
tokens after it, which is what makes caching keys and values (phase 3) exact.

Phase 4: no more padded (B, T) batches. One step runs the new tokens of many sequences packed
into one (N,) vector (some sequences prefill a chunk, most decode one token). A `ForwardBatch`
says where each sequence's tokens start, how long its context is, and which cache slots hold it;
attention writes the new keys/values through `slot_mapping`, then each query reads its own
sequence's context from the shared slot pool. Attention is varlen: no sequence is padded to the
step's longest query, so a step costs the sum of q_len * seq_len over its sequences, not
S * max_query_len * max_seq_len.

Phase 5: the pool is cut into blocks, and a sequence's context is found through its block table
instead of one contiguous region: position p lives in block block_table[p // block_size] at offset
p % block_size. `context_attention` gathers each sequence's context through its block table: the
readable paged attention, and the CPU path of every later phase.

Phase 6 (real checkpoints): Qwen3 RMS-normalizes every head's query and key (`q_norm`, `k_norm`,
one gain vector of size head_dim shared by all heads) before RoPE, which keeps attention logits
from growing with depth. Llama-family models have no such norm; for them the two modules are
`nn.Identity`, so their state dict has no q_norm/k_norm keys and checkpoints load name for name.

Phase 7 (speed): `context_attention` copies every context out of the paged cache and writes the
full score matrix to memory before the softmax reads it back; on a GPU that traffic, not
arithmetic, is the cost (plus one launch per step shape, no graphs). So `Attention` stores and
attends through the backend its KV cache carries, chosen once per cache (attention_backend.py):
on CUDA the Triton kernels (kernels/), which read the paged cache in place; elsewhere
`TorchAttention`, the readable path above. Like cache blocking in a matrix multiply: tiles that
fit on chip are reused instead of streaming intermediates through memory. With
`fuse_rope_kv_store` (config.py) the q/k norm, RoPE and the store of k and v are one kernel before
the backend attends (`qk_norm_rope_store`, kernels/fused.py): one launch, not three.

Conventions the kernels take as they are (no adapter in between): every integer tensor of a
`ForwardBatch` is `METADATA_DTYPE` (int32); a padded row, used only to fill a CUDA graph's fixed
batch, has slot_mapping PAD_SLOT_ID (-1, kernels/__init__.py: nothing is written) and seq_len 0
(nothing is read, its output is 0); block-table entries past a sequence's last block are never
read.
"""

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import DEFAULT_KERNELS, KernelConfig
from .distributed import SINGLE_RANK, TensorParallel
from .linear import QKVParallelLinear, RowParallelLinear
from .norm import PendingNorm, RMSNorm
from .rope import RotaryEmbedding

if TYPE_CHECKING:  # kv_cache.py imports the backends (attention_backend.py), which import this file
    from .kv_cache import KVCache

METADATA_DTYPE = torch.int32  # slots, lengths and block ids of a ForwardBatch


SDPA_HAS_GQA = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 5)  # enable_gqa: 2.5


@dataclass
class ForwardBatch:
    """Everything one forward step needs to know about the packed sequences (S of them, N new
    tokens in all). Built by the model runner; read by attention and the LM head."""

    query_start_loc: torch.Tensor  # (S + 1,) int: sequence i's new tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # (S,) int: context length after this step (computed + new tokens)
    slot_mapping: torch.Tensor  # (N,) int: the cache slot each new token's key/value goes to
    block_tables: torch.Tensor  # (S, max_blocks) int: physical block of each logical block
    logits_indices: torch.Tensor  # (R,) int: last new token of each sequence that samples
    max_query_len: int  # host-side maxima: shapes without a device sync
    max_seq_len: int
    block_size: int
    num_decodes: int = 0  # the first num_decodes sequences bring one new token each (host int)
    # (num_decodes,) int: those decodes, longest context first (the order the decode kernel starts
    # them in, kernels/paged_decode.py); None: batch order
    decode_order: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None  # (S,) int: each sequence's state pool slot (hybrid)

    @cached_property
    def attention_groups(self) -> list["AttentionGroup"]:
        """How attention splits this step (see `AttentionGroup`); planned on first use, then
        shared by every layer."""
        return plan_attention_groups(self)


@dataclass(frozen=True)
class AttentionGroup:
    """s sequences with q_len new tokens each, attended in one call.

    Decodes (q_len 1) form one group, their contexts padded to the longest: O(s * L). A sequence
    with several new tokens (a prompt chunk) is a group of its own, so no query is ever padded.
    """

    tokens: torch.Tensor | slice  # the group's s * q_len new tokens in the packed batch
    slots: torch.Tensor  # (s, L) cache slot of each context position (padding: slot 0)
    visible: torch.Tensor  # (s, q_len, L) bool: which context positions each query sees


def context_slots(batch: ForwardBatch, seqs: torch.Tensor | slice, length: int) -> torch.Tensor:
    """(s, length) cache slot of context positions 0..length-1 of the sequences `seqs` (an index
    tensor or a slice of the batch). Positions at or past a sequence's seq_len clamp to slot 0:
    read, then hidden by the mask."""
    positions = torch.arange(length, device=batch.seq_lens.device)
    blocks = batch.block_tables[seqs][:, positions // batch.block_size]  # the page-table walk
    slots = blocks * batch.block_size + positions % batch.block_size
    return torch.where(positions < batch.seq_lens[seqs, None], slots, 0)


def causal_mask(query_pos: torch.Tensor, length: int) -> torch.Tensor:
    """query_pos (s, Q) -> (s, Q, length): a query sees the keys at positions <= its own, which
    also hides the padding past its sequence's end."""
    return torch.arange(length, device=query_pos.device) <= query_pos[..., None]


def plan_attention_groups(batch: ForwardBatch) -> list[AttentionGroup]:
    """All decodes (q_len 1) in one group, then each sequence with several new tokens alone."""
    starts = batch.query_start_loc.tolist()  # host ints, read once per step
    seq_lens = batch.seq_lens.tolist()
    q_lens = [end - start for start, end in pairwise(starts)]
    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    groups = [decode_group(batch, decodes, max(seq_lens[i] for i in decodes))] if decodes else []
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            groups.append(chunk_group(batch, i, slice(starts[i], starts[i + 1]), seq_lens[i]))
    return groups


def decode_group(batch: ForwardBatch, decodes: list[int], length: int) -> AttentionGroup:
    """One new token per sequence, at its newest position; contexts padded to `length`."""
    seqs = torch.tensor(decodes, dtype=torch.long, device=batch.seq_lens.device)
    query_pos = batch.seq_lens[seqs, None] - 1  # (s, 1)
    slots = context_slots(batch, seqs, length)
    return AttentionGroup(batch.query_start_loc[seqs], slots, causal_mask(query_pos, length))


def chunk_group(batch: ForwardBatch, i: int, tokens: slice, seq_len: int) -> AttentionGroup:
    """Sequence i's new tokens are the last q_len of its seq_len positions."""
    q_len = tokens.stop - tokens.start
    query_pos = torch.arange(seq_len - q_len, seq_len, device=batch.seq_lens.device)[None]
    slots = context_slots(batch, slice(i, i + 1), seq_len)
    return AttentionGroup(tokens, slots, causal_mask(query_pos, seq_len))


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache: (num_blocks, block_size, H_kv, D), slots: (s, L) -> (s, H_kv, L, D)."""
    flat = cache.flatten(0, 1)  # (num_slots, H_kv, D): slot s is [s // block_size, s % block_size]
    # index_select, not flat[slots]: the same rows, many times faster on CPU.
    rows = flat.index_select(0, slots.flatten()).view(*slots.shape, *flat.shape[1:])
    return rows.transpose(1, 2)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """SDPA where each KV head serves its group of query heads. q: (s, H, Q, D); k, v:
    (s, H_kv, L, D). torch >= 2.5 does it in place (enable_gqa); torch 2.4 needs copies."""
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def context_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    """Readable varlen paged attention. q: (N, H, D); caches: (num_blocks, block_size, H_kv, D)
    -> (N, H, D).

    A step costs the sum of q_len * seq_len over its sequences (decodes padded to the longest
    decode context), never S * max_query_len * max_seq_len.
    """
    out = torch.empty_like(q)
    for group in batch.attention_groups:
        s, q_len, _ = group.visible.shape
        k, v = gather(k_cache, group.slots), gather(v_cache, group.slots)  # (s, H_kv, L, D)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache (kv_cache.py) is widened to compute
        q_group = q[group.tokens].view(s, q_len, *q.shape[1:]).transpose(1, 2)  # (s, H, Q, D)
        o = sdpa_gqa(q_group, k, v, group.visible[:, None])
        out[group.tokens] = o.transpose(1, 2).flatten(0, 1)
    return out


def norm_and_rotate(
    x: torch.Tensor,
    norm: nn.Module,
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    kernels: KernelConfig,
) -> torch.Tensor:
    """Per-head RMSNorm (nn.Identity for Llama), then RoPE. On CUDA one fused kernel does both
    (kernels/fused.py) instead of some fifteen small ones."""
    if kernels.use_triton(x):
        from .kernels.fused import qk_norm_rope  # here: CPU-only installs may lack Triton

        weight, eps = norm_gain(norm)
        return qk_norm_rope(x, weight, rotary.cos, rotary.sin, positions, eps)
    return rotary(norm(x), positions)


def norm_gain(norm: nn.Module) -> tuple[torch.Tensor | None, float]:
    """A q/k norm's (weight, eps) for the kernels; (None, 0.0) for Llama's nn.Identity."""
    return (norm.weight, norm.eps) if isinstance(norm, RMSNorm) else (None, 0.0)


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        layer_idx: int,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        tp: TensorParallel = SINGLE_RANK,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads")
        # Tensor parallelism (linear.py): this rank's heads only; o_proj all-reduces the heads.
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, tp, kernels
        )
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp, kernels)
        self.kernels = kernels
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, kernels) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, kernels) if qk_norm else nn.Identity()
        self.rotary = rotary
        self.layer_idx = layer_idx  # which of the cache's layers this module reads and writes

    def forward(
        self,
        x: "torch.Tensor | PendingNorm",
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: "KVCache",
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # x: a PendingNorm where the GEMV normalizes it (norm.py)
        N = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(N, self.num_heads, self.head_dim)
        k = k.view(N, self.num_kv_heads, self.head_dim)
        v = v.view(N, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx]
        backend = kv_cache.attention_backend
        if self.kernels.fuse_rope_kv_store and self.kernels.use_triton(qkv):
            q = self.norm_rotate_and_store(q, k, v, positions, k_cache, v_cache, batch)
        else:
            q = norm_and_rotate(q, self.q_norm, self.rotary, positions, self.kernels)  # Qwen3
            k = norm_and_rotate(k, self.k_norm, self.rotary, positions, self.kernels)
            backend.store(k, v, k_cache, v_cache, batch)
        out = backend.attend(q, k_cache, v_cache, batch, self.kernels)
        return self.o_proj(out.reshape(N, -1))

    def norm_rotate_and_store(self, q, k, v, positions, k_cache, v_cache, batch) -> torch.Tensor:
        """norm_and_rotate of q and k, and the store of k and v, in one kernel -> q."""
        from .kernels.fused import qk_norm_rope_store  # here: CPU-only installs lack Triton

        (q_weight, eps), (k_weight, _) = norm_gain(self.q_norm), norm_gain(self.k_norm)
        return qk_norm_rope_store(
            q, k, v, q_weight, k_weight, self.rotary.cos, self.rotary.sin, positions, eps,
            k_cache, v_cache, batch.slot_mapping, pdl=self.kernels.programmatic_launch,
        )  # fmt: skip
