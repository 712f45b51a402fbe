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
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache
from .rope import RotaryEmbedding


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


def context_slots(batch: ForwardBatch, seqs: torch.Tensor | slice, length: int) -> torch.Tensor:
    """(s, length) cache slot of context positions 0..length-1 of the sequences `seqs` (an index
    tensor or a slice of the batch). Positions at or past a sequence's seq_len clamp to slot 0:
    read, then hidden by the mask."""
    positions = torch.arange(length, device=batch.seq_lens.device)
    blocks = batch.block_tables[seqs][:, positions // batch.block_size]  # the page-table walk
    slots = blocks * batch.block_size + positions % batch.block_size
    return torch.where(positions < batch.seq_lens[seqs, None], slots, 0)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache: (num_blocks, block_size, H_kv, D), slots: (s, L) -> (s, H_kv, L, D)."""
    flat = cache.flatten(0, 1)  # (num_slots, H_kv, D): slot s is [s // block_size, s % block_size]
    # index_select, not flat[slots]: the same rows, many times faster on CPU.
    rows = flat.index_select(0, slots.flatten()).view(*slots.shape, *flat.shape[1:])
    return rows.transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor):
    """q: (s, H, Q, D) at positions query_pos (s, Q); k, v: (s, H_kv, L, D) at positions 0..L-1.

    A query sees the keys at positions <= its own: causal, and blind to the padding past its
    sequence's end. `enable_gqa` lets each KV head serve its group of query heads without copies.
    """
    key_pos = torch.arange(k.shape[2], device=k.device)
    visible = key_pos <= query_pos[..., None]  # (s, Q, L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=True)


def context_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    """Readable varlen paged attention. q: (N, H, D); caches: (num_blocks, block_size, H_kv, D)
    -> (N, H, D).

    Nothing is padded to the step's longest query. Sequences with one new token (decodes, most of
    a busy step) run as one batch, their contexts padded to max_seq_len: O(S * L). A sequence with
    several new tokens (a prompt chunk) runs alone on its own context: O(q_len * seq_len).
    """
    out = torch.empty_like(q)
    starts = batch.query_start_loc.tolist()  # host ints to slice the packed tokens with
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    one_token = [i for i, n in enumerate(q_lens) if n == 1]
    decodes = torch.tensor(one_token, dtype=torch.long, device=q.device)
    if len(decodes) > 0:
        tokens = batch.query_start_loc[decodes]  # each decode's one new token
        slots = context_slots(batch, decodes, batch.max_seq_len)
        k, v = gather(k_cache, slots), gather(v_cache, slots)  # (S_d, H_kv, L, D)
        query_pos = batch.seq_lens[decodes, None] - 1  # (S_d, 1): the newest position
        out[tokens] = attend(q[tokens, :, None], k, v, query_pos)[:, :, 0]
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        if q_lens[i] > 1:
            slots = context_slots(batch, slice(i, i + 1), seq_len)
            k, v = gather(k_cache, slots), gather(v_cache, slots)  # (1, H_kv, L, D)
            # The new tokens are the last q_len of the sequence's seq_len positions.
            query_pos = torch.arange(seq_len - q_lens[i], seq_len, device=q.device)[None]
            q_i = q[starts[i] : starts[i + 1]].transpose(0, 1)[None]  # (1, H, q_len, D)
            out[starts[i] : starts[i + 1]] = attend(q_i, k, v, query_pos)[0].transpose(0, 1)
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
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        kv_cache.store(self.layer_idx, k, v, batch.slot_mapping)
        out = context_attention(q, kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx], batch)
        return self.o_proj(out.reshape(N, -1))
