"""Phase 2: truncation masks checked exactly, sampling checked statistically with fixed seeds.

Generation is checked against oracles outside the package under test (the tests also run on a
learner's copy: `pytest tests/phase2 --impl NAME`): phase 1's greedy loop on the same weights for
temperature 0, and a seeded draw written out with torch for a sampled request.
"""

import math
from dataclasses import replace

import pytest
import torch

import phase1_naive
from phase2_sampling import ModelConfig, Sampler, SamplingParams, TinyTransformer, generate
from phase2_sampling.sampling import filtered_logits, min_p_mask, top_k_mask, top_p_mask

# probabilities 0.4, 0.3, 0.2, 0.1 (log of them as logits)
PROBS = torch.tensor([0.1, 0.4, 0.2, 0.3])
LOGITS = PROBS.log()


def test_top_k_mask():
    assert top_k_mask(LOGITS, 2).tolist() == [True, False, True, False]
    assert top_k_mask(LOGITS, 1).tolist() == [True, False, True, True]
    assert top_k_mask(LOGITS, 10).tolist() == [False] * 4


@pytest.mark.parametrize(
    "p,dropped",
    [
        (0.4, [True, False, True, True]),  # 0.4 alone reaches 0.4
        (0.5, [True, False, True, False]),  # needs 0.4 + 0.3
        (0.7, [True, False, True, False]),  # 0.4 + 0.3 = 0.7 exactly: complete
        (0.71, [True, False, False, False]),
        (1.0, [False, False, False, False]),
        (0.01, [True, False, True, True]),  # the top token always survives
    ],
)
def test_top_p_mask(p, dropped):
    assert top_p_mask(LOGITS, p).tolist() == dropped


def test_min_p_mask():
    # threshold 0.45 * 0.4 = 0.18: 0.1 goes, 0.2 stays; 0.6 * 0.4 = 0.24: 0.2 goes too
    assert min_p_mask(LOGITS, 0.45).tolist() == [True, False, False, False]
    assert min_p_mask(LOGITS, 0.6).tolist() == [True, False, True, False]
    assert min_p_mask(LOGITS, 1.0).tolist() == [True, False, True, True]


def test_masks_work_on_batches():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    assert top_k_mask(batch, 1).tolist() == [[True, False, True, True], [True, True, False, True]]


def test_filters_compose_in_order():
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.5)
    # top_k drops 0.1; renormalized 0.4/0.9, 0.3/0.9 reach 0.5 with two tokens
    kept = filtered_logits(LOGITS, params).isfinite().tolist()
    assert kept == [False, True, False, True]


def test_min_p_applies_before_top_p_as_in_vllm():
    # min_p 0.3: threshold 0.12 drops 0.1; top-p then sees 0.4/0.9, 0.3/0.9, 0.2/0.9 and reaches
    # 0.75 with two tokens. Top-p first would reach 0.75 only with three (0.4 + 0.3 = 0.7).
    params = SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75)
    assert filtered_logits(LOGITS, params).isfinite().tolist() == [False, True, False, True]


def test_temperature_applies_before_min_p():
    # T = 0.5 squares the probabilities: 0.16, 0.09, 0.04, 0.01 (/ 0.3). min_p 0.3 of the top one
    # (0.16) drops 0.04, which the unscaled threshold (0.3 * 0.4 = 0.12 < 0.2) would keep.
    params = SamplingParams(temperature=0.5, min_p=0.3)
    assert filtered_logits(LOGITS, params).isfinite().tolist() == [False, True, False, True]


def empirical(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    sampler = Sampler(params)
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=4)
    return counts.float()


def chi_square_ok(counts: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    """Pearson chi-square on the nonzero-probability cells, 99.9% critical value for df <= 3."""
    keep = expected_probs > 0
    n = counts.sum()
    assert counts[~keep].sum() == 0, "sampled a token the filters removed"
    expected = expected_probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    critical = {1: 10.83, 2: 13.82, 3: 16.27}[int(keep.sum()) - 1]
    return stat < critical


@pytest.mark.parametrize(
    "params,expected",
    [
        (SamplingParams(temperature=1.0, seed=1), PROBS),
        (SamplingParams(temperature=1.0, top_k=2, seed=2), torch.tensor([0, 4 / 7, 0, 3 / 7])),
        (SamplingParams(temperature=1.0, min_p=0.6, seed=4), torch.tensor([0, 4 / 7, 0, 3 / 7])),
    ],
    ids=["plain", "top_k", "min_p"],
)
def test_sampled_distribution(params, expected):
    assert chi_square_ok(empirical(params, LOGITS, 4000), expected)


@pytest.mark.parametrize(
    "params,expected",
    [
        (SamplingParams(temperature=1.0, top_p=0.85, seed=3), torch.tensor([0, 4, 2, 3]) / 9),
        (
            SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75, seed=6),
            torch.tensor([0, 4 / 7, 0, 3 / 7]),
        ),
    ],
    ids=["top_p", "min_p_then_top_p"],
)
def test_sampled_distribution_through_top_p(params, expected):
    assert chi_square_ok(empirical(params, LOGITS, 4000), expected)


def test_temperature_reshapes_distribution():
    t = 0.5
    sharpened = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
    counts = empirical(SamplingParams(temperature=t, seed=5), LOGITS, 4000)
    assert chi_square_ok(counts, sharpened)
    assert not chi_square_ok(counts, PROBS)  # the test can tell the difference


def test_greedy_is_argmax():
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert sampler(LOGITS) == 1


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return phase1_naive.TinyTransformer(phase1_naive.ModelConfig()).state_dict()


@pytest.fixture(scope="module")
def model(state):
    model = TinyTransformer(ModelConfig()).eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def phase1_model(state):
    model = phase1_naive.TinyTransformer(phase1_naive.ModelConfig()).eval()
    model.load_state_dict(state)
    return model


@torch.no_grad()
def reference_draws(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """What a seeded request must produce, written out with torch: logits / temperature, the
    top-k logits kept, one `torch.multinomial` draw per step from a generator seeded once."""
    generator = torch.Generator().manual_seed(params.seed)
    ids = list(prompt)
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([ids]))[0, -1].float() / params.temperature
        kth_largest = logits.topk(params.top_k).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth_largest, float("-inf")), dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids[len(prompt) :]


def test_greedy_generate_is_phase1s(model, phase1_model):
    prompt = [5, 17, 300, 42]
    expected = phase1_naive.generate(phase1_model, prompt, max_new_tokens=12)
    assert generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=12)) == expected
    eos = expected[4]
    stopped = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=12), eos)
    assert stopped == expected[: expected.index(eos) + 1]


def test_seed_makes_requests_reproducible(model, phase1_model):
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=20, seed=1234)
    torch.manual_seed(0)
    a = generate(model, [1, 2, 3], params)
    torch.manual_seed(999)  # the global RNG must not matter
    b = generate(model, [1, 2, 3], params)
    c = generate(model, [1, 2, 3], replace(params, seed=4321))
    assert a == b == reference_draws(phase1_model, [1, 2, 3], params)
    assert a != c
    greedy = phase1_naive.generate(phase1_model, [1, 2, 3], max_new_tokens=20)
    assert a != greedy, "the seeded request should not just be greedy"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 1e-40}, "temperature"),  # 1/T overflows float32: logits become inf
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),  # torch.Generator takes 64-bit seeds
    ],
)
def test_invalid_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": "0.7"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": None}, "top_p"),
        ({"min_p": "0"}, "min_p"),
        ({"max_tokens": 2.5}, "max_tokens"),  # not a token count
        ({"max_tokens": True}, "max_tokens"),  # a bool is not an int here
        ({"seed": "abc"}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_params_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


def test_limits_are_accepted():
    SamplingParams(temperature=1e-5, seed=2**64 - 1, top_k=1, top_p=1e-9, min_p=1.0)
    sampler = Sampler(SamplingParams(temperature=1e-5, seed=2**64 - 1))
    assert sampler(LOGITS * 1e3) == 1  # the smallest temperature: finite, all mass on the top


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    # 1e-50 is a valid top_p (> 0) but 0 in float32: the nucleus must still hold the top token,
    # or every token is masked and the draw is NaN.
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert top_p_mask(logits, 1e-50).tolist() == [[False, True, True, True]]
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1e-50, seed=0))
    assert sampler(logits[0]) == 0
