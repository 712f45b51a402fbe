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
"""

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache
from .norm import RMSNorm
from .rope import RotaryEmbedding

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
        q_group = q[group.tokens].view(s, q_len, *q.shape[1:]).transpose(1, 2)  # (s, H, Q, D)
        o = sdpa_gqa(q_group, k, v, group.visible[:, None])
        out[group.tokens] = o.transpose(1, 2).flatten(0, 1)
    return out


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
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else nn.Identity()
        self.rotary = rotary
        self.layer_idx = layer_idx  # which of the cache's layers this module reads and writes

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)  # per head, before RoPE (Qwen3)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        kv_cache.store(self.layer_idx, k, v, batch.slot_mapping)
        out = context_attention(q, kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx], batch)
        return self.o_proj(out.reshape(N, -1))
