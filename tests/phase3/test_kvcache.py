"""Phase 3: the KV cache and static batching change the cost, never the result.

Oracle: phase 2 (the naive loop, no cache) loaded with the same weights (`load_state_dict`), never
the package under test, so a bug that hits the cached path and every batch row alike cannot vouch
for itself (the tests also run on a learner's copy: `pytest tests/phase3 --impl NAME`).
"""

import pytest
import torch

import phase2_sampling
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
PROMPTS = [[1, 2, 3, 4, 5], [100, 7], [42] * 17, [9]]
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit along the oracle's path; float32 noise is ~1e-6


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return phase2_sampling.TinyTransformer(phase2_sampling.ModelConfig()).state_dict()


@pytest.fixture(scope="module")
def model(state):
    model = TinyTransformer(ModelConfig()).eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def phase2_model(state):
    model = phase2_sampling.TinyTransformer(phase2_sampling.ModelConfig()).eval()
    model.load_state_dict(state)
    return model


def phase2_generate(model, prompt, params: SamplingParams, eos_token_id=None) -> list[int]:
    p2 = phase2_sampling.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, max_tokens=params.max_tokens, seed=params.seed,
    )  # fmt: skip
    return phase2_sampling.generate(model, prompt, p2, eos_token_id)


@pytest.fixture(scope="module")
def oracle(phase2_model) -> list[list[int]]:
    """Phase 2's greedy tokens for PROMPTS, certified free of near-ties."""
    outputs = [phase2_generate(phase2_model, p, GREEDY) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = phase2_model(torch.tensor([prompt + out[:-1]]))[0, len(prompt) - 1 :]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "near-tie: pick other prompts"
    return outputs


def new_cache(model, batch, max_len=64):
    c = model.config
    return KVCache(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)


@torch.no_grad()
def test_cached_decode_matches_full_forward(model, phase2_model):
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    full = phase2_model(ids)
    cache = new_cache(model, 1)
    prefill = model(ids[:, :8], torch.arange(8)[None], cache)
    steps = [model(ids[:, t : t + 1], torch.tensor([[t]]), cache) for t in range(8, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_update_returns_everything_stored_so_far():
    """The cache alone (no model, no mask): each update appends after `length` in its own
    layer and returns every key and value up to the new end, not past it."""
    cache = KVCache(num_layers=2, batch_size=2, max_len=8, num_kv_heads=1, head_dim=4)
    k1, v1, k2, v2 = (torch.randn(2, n, 1, 4) for n in (3, 3, 2, 2))
    keys, values = cache.update(1, k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    assert cache.length == 0  # moves only in advance(), once every layer has stored
    cache.advance(3)
    keys, values = cache.update(1, k2, v2)
    assert torch.equal(keys, torch.cat([k1, k2], dim=1))
    assert torch.equal(values, torch.cat([v1, v2], dim=1))
    assert not cache.k[0].any() and not cache.v[0].any()  # the other layer is untouched


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


def test_a_query_after_the_cache_sees_every_earlier_real_key():
    """T new queries at the end of S positions: query i (position S - T + i) sees keys 0..its
    own position, minus the padding; no padding query here, so nothing else is visible."""
    padding = torch.tensor([[True, False, False, False, False, False]])
    hidden = hidden_keys_mask(2, 6, padding, torch.device("cpu"))[0, 0]
    assert hidden.tolist() == [
        [True, False, False, False, False, True],  # position 4: keys 1-4
        [True, False, False, False, False, False],  # position 5: keys 1-5
    ]
    assert hidden_keys_mask(3, 3, None, torch.device("cpu")).shape == (1, 1, 3, 3)


@torch.no_grad()
def test_batch_rows_equal_single_requests(model, oracle):
    batch = generate_batch(model, PROMPTS, GREEDY)
    assert batch.token_ids == oracle
    assert [generate(model, p, GREEDY) for p in PROMPTS] == oracle


def test_seeded_sampling_is_independent_of_batch_mates(model, phase2_model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in (11, 22)]
    expected = [phase2_generate(phase2_model, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert generate_batch(model, prompts, params).token_ids == expected
    assert generate_batch(model, prompts[1:], params[1:]).token_ids == expected[1:]


def test_eos_and_max_tokens_per_row(model, oracle):
    free = oracle[0]
    eos = free[3]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=2)]
    out = generate_batch(model, PROMPTS[:2], params, eos_token_id=eos).token_ids
    assert out[0] == free[: free.index(eos) + 1]
    second = oracle[1][:2]
    assert out[1] == (second[: second.index(eos) + 1] if eos in second else second)


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
