"""The phase 7 references (kernels/reference.py) pinned to oracles outside the package.

test_kernels.py checks every kernel against reference.py, which lives inside the package under
test (`pytest tests/phase7 --impl NAME` runs a learner's copy of it). So the references are held
here to torch's own `scaled_dot_product_attention` and to plain per-position indexing of the
paged layout, written out in the test: a reference bent to agree with a wrong kernel fails.

Paged layout: position p of a sequence lives in cache block `block_table[p // block_size]`, at
offset `p % block_size`. Unused block-table entries point at blocks full of junk.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim.kernels import (  # noqa: E402
    PAD_SLOT_ID,
    gather_kv,
    paged_decode_attention_ref,
    store_kvcache_ref,
    varlen_paged_attention_ref,
)

BLOCK_SIZE = 4
HEAD_DIM = 8
SCALE = 0.3  # not head_dim**-0.5, so a reference that ignores `scale` shows
EXACT = dict(atol=1e-5, rtol=1e-5)  # fp32 throughout: only summation order differs


def paged_cache(seq_lens: list[int], num_kv_heads: int, seed: int):
    """Random K/V caches and block tables with junk blocks and junk in unused table entries."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = perm[torch.randint(0, num_blocks, (len(seq_lens), max(blocks_per_seq) + 1))]
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    return k_cache, v_cache, block_tables.int()


def contiguous(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`[seq_len, Hkv, D]`, one position at a time, straight from the layout's definition."""
    return torch.stack(
        [cache[int(block_table[p // BLOCK_SIZE]), p % BLOCK_SIZE] for p in range(seq_len)]
    )


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """q `[Q, H, D]` at positions q_start…, k/v `[N, Hkv, D]` -> `[Q, H, D]` by torch's SDPA."""
    group = q.shape[1] // k.shape[1]
    q_pos = torch.arange(q_start, q_start + q.shape[0])
    sees = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # (Q, N): True where allowed
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, dim=1).transpose(0, 1),
        v.repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=sees,
        scale=SCALE,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_gather_kv_is_plain_indexing(num_kv_heads):
    seq_lens = [1, 6, 13]
    k_cache, _, block_tables = paged_cache(seq_lens, num_kv_heads, seed=0)
    for i, n in enumerate(seq_lens):
        assert torch.equal(
            gather_kv(k_cache, block_tables[i], n), contiguous(k_cache, block_tables[i], n)
        )


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 1), (6, 2)])
def test_decode_reference_matches_sdpa(num_heads, num_kv_heads):
    """One query per sequence, at its last position: it sees the whole context, nothing after."""
    seq_lens = [1, 4, 7, 13]
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, seed=1)
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention_ref(q, k_cache, v_cache, lens, block_tables, SCALE)
    for i, n in enumerate(seq_lens):
        k = contiguous(k_cache, block_tables[i], n)
        v = contiguous(v_cache, block_tables[i], n)
        torch.testing.assert_close(out[i : i + 1], sdpa(q[i : i + 1], k, v, n - 1), **EXACT)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2)])
def test_prefill_reference_after_cached_context_matches_sdpa(num_heads, num_kv_heads):
    """New queries after a cached context (a later chunk, a prefix-cache hit): query m of a
    sequence sits at position seq_len - q_len + m and sees the keys up to it."""
    q_lens, seq_lens = [3, 1, 6], [3, 9, 14]  # contexts 0, 8, 8
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, seed=3)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = varlen_paged_attention_ref(
        q, k_cache, v_cache, query_start_loc, lens, block_tables, SCALE
    )
    for i, (q_len, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        k = contiguous(k_cache, block_tables[i], n)
        v = contiguous(v_cache, block_tables[i], n)
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows], sdpa(q[rows], k, v, n - q_len), **EXACT)


def test_store_reference_is_plain_indexing_and_skips_padding():
    num_blocks, num_kv_heads = 5, 2
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    slot_mapping = torch.tensor([7, PAD_SLOT_ID, 0, 19, PAD_SLOT_ID, 12], dtype=torch.int64)
    k = torch.randn(len(slot_mapping), num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(len(slot_mapping), num_kv_heads, HEAD_DIM, generator=gen)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot != PAD_SLOT_ID:  # a padded token writes nothing
            k_expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]
            v_expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
