"""Phase 7 (the CPU path, as phase 6): varlen paged attention against a naive per-sequence oracle.

One packed step mixes what a busy engine step holds: a fresh prompt, a prompt chunk after
earlier context, and decodes of different lengths. Block tables are shuffled, their unused
entries point at other sequences' blocks, and every cache slot holds random keys and values, so
a query that sees another sequence's keys, a chunk that misses its earlier context or a mask off
by one position changes the output.
"""

import math

import torch

from phase7_optim.attention import ForwardBatch, context_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4
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
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks of junk
    perm = torch.randperm(num_blocks, generator=g)
    width = max(blocks_per_seq) + 1
    # Unused entries point at real blocks (another sequence's or junk): they must never be read.
    tables = perm[torch.randint(0, num_blocks, (len(STEP), width), generator=g)]
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[start : start + n]
        start += n
    slots = [
        [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
        for i, n in enumerate(seq_lens)
    ]
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q_lens = [n for _, n in STEP]
    new_slots = torch.tensor([s for (c, _), ss in zip(STEP, slots, strict=True) for s in ss[c:]])
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0)
    batch = ForwardBatch(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens),
        slot_mapping=new_slots,
        block_tables=tables,
        logits_indices=query_start_loc[1:] - 1,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
    )
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=g)
    return q, k_cache, v_cache, batch, slots


def test_each_sequence_sees_exactly_its_own_context():
    q, k_cache, v_cache, batch, slots = packed_step()
    out = context_attention(q, k_cache, v_cache, batch)
    starts = batch.query_start_loc.tolist()
    for i, seq_slots in enumerate(slots):
        ids = torch.tensor(seq_slots)
        k, v = k_cache.flatten(0, 1)[ids], v_cache.flatten(0, 1)[ids]
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
        block_tables=batch.block_tables[i : i + 1],
        logits_indices=torch.tensor([end - start - 1]),
        max_query_len=end - start,
        max_seq_len=int(batch.seq_lens[i]),
        block_size=BLOCK_SIZE,
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
