"""Phase 3: the KV cache and static batching change the cost, never the result."""

import pytest
import torch

from phase3_kvcache import (
    KVCache,
    ModelConfig,
    SamplingParams,
    TinyTransformer,
    generate,
    generate_batch,
)
from phase3_kvcache.attention import hidden_keys_mask

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig()).eval()


def new_cache(model, batch, max_len=64):
    c = model.config
    return KVCache(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)


@torch.no_grad()
def test_cached_decode_matches_full_forward(model):
    ids = torch.randint(0, 512, (1, 12))
    full = model(ids)
    cache = new_cache(model, 1)
    prefill = model(ids[:, :8], torch.arange(8)[None], cache)
    steps = [model(ids[:, t : t + 1], torch.tensor([[t]]), cache) for t in range(8, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_overflow_raises(model):
    cache = new_cache(model, 1, max_len=4)
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], cache)


def test_padding_query_sees_only_itself():
    padding = torch.tensor([[True, True, False, False]])
    hidden = hidden_keys_mask(4, 4, padding, torch.device("cpu"))[0, 0]
    assert hidden[0].tolist() == [False, True, True, True]
    assert hidden[1].tolist() == [True, False, True, True]
    assert hidden[3].tolist() == [True, True, False, False]


@torch.no_grad()
def test_batch_rows_equal_single_requests(model):
    prompts = [[1, 2, 3, 4, 5], [100, 7], [42] * 17, [9]]
    batch = generate_batch(model, prompts, GREEDY)
    assert batch.token_ids == [generate(model, p, GREEDY) for p in prompts]


def test_seeded_sampling_is_independent_of_batch_mates(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in (11, 22)]
    batch = generate_batch(model, prompts, params)
    assert batch.token_ids[0] == generate(model, prompts[0], params[0])
    assert batch.token_ids[1] == generate(model, prompts[1], params[1])


def test_eos_and_max_tokens_per_row(model):
    prompts = [[1, 2, 3], [7, 8]]
    free = generate(model, prompts[0], GREEDY)
    eos = free[3]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=2)]
    out = generate_batch(model, prompts, params, eos_token_id=eos).token_ids
    assert out[0] == free[: free.index(eos) + 1]
    assert len(out[1]) <= 2


def test_wasted_slots_counted(model):
    # Prompts of 3 and 1 tokens, 4 and 1 new tokens: 4 steps, the 3-token prompt decides the width.
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (4, 1)]
    out = generate_batch(model, [[1, 2, 3], [5]], params)
    # columns = 3 prompt + 3 fed decode tokens = 6 per row; useful = (3 + 3) + (1 + 0)
    assert out.num_slots == 12
    assert out.num_wasted_slots == 12 - 7
    assert out.wasted_fraction == pytest.approx(5 / 12)


@pytest.mark.parametrize(
    "prompts,params",
    [
        ([], [GREEDY]),
        ([[]], [GREEDY]),
        ([[1]], [GREEDY, GREEDY]),
        ([[1] * 1020], [GREEDY]),  # 1020 + 16 > max_position_embeddings
    ],
)
def test_bad_batches_raise(model, prompts, params):
    with pytest.raises(ValueError):
        generate_batch(model, prompts, params)
