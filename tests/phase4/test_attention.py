"""Phase 4 varlen attention against a naive per-sequence oracle.

One packed step mixes what a busy engine step holds: a fresh prompt, a prompt chunk after
earlier context, and decodes of different lengths. Each sequence's region lies between regions
of junk, and every cache slot holds random keys and values, so a query that sees another
sequence's keys, a chunk that misses its earlier context or a mask off by one position changes
the output.
"""

import math

import torch

from phase4_scheduler.attention import ForwardBatch, context_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, JUNK_SLOTS = 4, 2, 8, 3
# (num_computed_tokens, num_new_tokens) per sequence
STEP = [(0, 6), (9, 8), (9, 1), (2, 1), (0, 1), (14, 1)]  # a chunk has the longest context
ATOL = 1e-5  # float32; the oracle sums in a different order


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (Q, H, D), the last Q of the L positions of k, v: (L, H_kv, D) -> (Q, H, D)."""
    Q, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(L - Q, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), v)


def packed_step(seed: int = 0):
    """-> q (N, H, D), k_cache, v_cache, ForwardBatch, and each sequence's slots (list)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in STEP]
    # Regions in shuffled order, each followed by JUNK_SLOTS slots that belong to no sequence.
    order = torch.randperm(len(STEP), generator=g).tolist()
    starts, next_free = [0] * len(STEP), 0
    for i in order:
        starts[i], next_free = next_free, next_free + seq_lens[i] + JUNK_SLOTS
    slots = [list(range(s, s + n)) for s, n in zip(starts, seq_lens, strict=True)]
    shape = (next_free, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q_lens = [n for _, n in STEP]
    new_slots = torch.tensor([s for (c, _), ss in zip(STEP, slots, strict=True) for s in ss[c:]])
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0)
    batch = ForwardBatch(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens),
        slot_mapping=new_slots,
        context_starts=torch.tensor(starts),
        logits_indices=query_start_loc[1:] - 1,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=g)
    return q, k_cache, v_cache, batch, slots


def test_each_sequence_sees_exactly_its_own_context():
    q, k_cache, v_cache, batch, slots = packed_step()
    out = context_attention(q, k_cache, v_cache, batch)
    starts = batch.query_start_loc.tolist()
    for i, seq_slots in enumerate(slots):
        ids = torch.tensor(seq_slots)
        k, v = k_cache[ids], v_cache[ids]
        expected = naive_attention(q[starts[i] : starts[i + 1]], k, v)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=ATOL, rtol=0)


def test_a_sequence_does_not_depend_on_its_step_mates():
    """The chunk after context gives the same output alone as packed with five others."""
    q, k_cache, v_cache, batch, _ = packed_step()
    packed = context_attention(q, k_cache, v_cache, batch)
    i = STEP.index((9, 8))
    start, end = batch.query_start_loc[i : i + 2].tolist()
    alone = ForwardBatch(
        query_start_loc=torch.tensor([0, end - start]),
        seq_lens=batch.seq_lens[i : i + 1],
        slot_mapping=batch.slot_mapping[start:end],
        context_starts=batch.context_starts[i : i + 1],
        logits_indices=torch.tensor([end - start - 1]),
        max_query_len=end - start,
        max_seq_len=int(batch.seq_lens[i]),
    )
    out = context_attention(q[start:end], k_cache, v_cache, alone)
    torch.testing.assert_close(out, packed[start:end], atol=ATOL, rtol=0)


def test_no_query_is_padded():
    """The attention masks cover the sum of q_len * seq_len over prompt chunks plus the decodes
    padded to the longest decode context, not S * max_query_len * max_seq_len."""
    *_, batch, _ = packed_step()
    chunks = [(n, c + n) for c, n in STEP if n > 1]
    decode_lens = [c + n for c, n in STEP if n == 1]
    expected = sum(q_len * seq_len for q_len, seq_len in chunks)
    expected += len(decode_lens) * max(decode_lens)
    assert sum(group.visible.numel() for group in batch.attention_groups) == expected
    assert expected < len(STEP) * batch.max_query_len * batch.max_seq_len / 3


def test_grouped_kv_heads_without_enable_gqa_give_the_same_attention(monkeypatch):
    # torch 2.4 has no enable_gqa: the copied-heads path must compute the same thing.
    from phase4_scheduler import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.rand(2, 1, 3, 5) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    expected = attention.sdpa_gqa(q, k, v, mask)
    monkeypatch.setattr(attention, "SDPA_HAS_GQA", False)
    torch.testing.assert_close(attention.sdpa_gqa(q, k, v, mask), expected)
