"""Pure-torch references for the phase 7 kernels: readable, slow, and the oracle in the tests.

Problem each one states plainly, with the memory traffic that makes it slow on a GPU (bytes
through HBM, for N context tokens, Q new tokens, H query heads, Hkv KV heads, D head_dim, 2-byte
elements; the Triton kernels next to this file move only the "floor" bytes):

- `store_kvcache_ref`: a masked index_put. Floor: read and write the new K/V once.
- `gather_kv`: copy a sequence's scattered cache blocks into one contiguous `[N, Hkv, D]` tensor.
  That copy alone is a full extra read + write of the context, on every step.
- `varlen_paged_attention_ref`: gather, repeat K/V for GQA (another H/Hkv-fold copy), build the
  `[H, Q, N]` score matrix in fp32, softmax it (read + write), multiply by V. The score matrix is
  the cost: 4*H*Q*N bytes written and read several times, against a floor of reading Q, K, V once.
- `paged_decode_attention_ref`: the same with Q = 1 per sequence.

These functions loop over sequences in Python and compute in fp32; never call them in the engine.
"""

import torch

from . import FP8_E4M3_MAX, PAD_SLOT_ID


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `k`, `v` `[T, Hkv, D]` to the flat slots in `slot_mapping`, skipping PAD_SLOT_ID.
    An fp8 cache gets the values saturated to +-FP8_E4M3_MAX and rounded to nearest (even)."""
    valid = slot_mapping != PAD_SLOT_ID  # boolean indexing below syncs with the host
    num_kv_heads, head_dim = k_cache.shape[2:]
    if k_cache.dtype == torch.float8_e4m3fn:
        k, v = (x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(k_cache.dtype) for x in (k, v))
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[valid]] = k[valid]
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[valid]] = v[valid]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` positions of one sequence, made contiguous: `[seq_len, Hkv, D]`.

    Position p lives at slot `block_table[p // block_size] * block_size + p % block_size`.
    Traffic: reads and writes seq_len * Hkv * D elements (the kernels read them in place instead).
    """
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return cache.flatten(0, 1)[slots]


def varlen_paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new queries `[T, H, D]` over their paged contexts, in fp32.

    The q_len new tokens of sequence i are the last positions of its context, so query row m
    (position seq_len - q_len + m) sees keys 0 … seq_len - q_len + m.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_i = q[starts[i] : starts[i + 1]].float().transpose(0, 1)  # (H, Q, D)
        q_len = q_i.shape[1]
        k_i = gather_kv(k_cache, block_tables[i], seq_len).float()  # (N, Hkv, D)
        v_i = gather_kv(v_cache, block_tables[i], seq_len).float()
        # GQA: query head h reads KV head h // (H / Hkv); materialized here, shared in the kernels
        k_i = k_i.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # (H, N, D)
        v_i = v_i.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        scores = (q_i @ k_i.transpose(1, 2)) * scale  # (H, Q, N): the 4*H*Q*N-byte intermediate
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[starts[i] : starts[i + 1]] = (scores.softmax(dim=-1) @ v_i).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode: one query `[num_seqs, H, D]` per sequence, the last position of its context."""
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
    return varlen_paged_attention_ref(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale
    )
