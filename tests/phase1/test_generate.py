"""Phase 1: the naive greedy loop, checked against a direct argmax over full forwards.

Oracle: phase 0's TinyTransformer loaded with the same weights (`load_state_dict`), never the
package under test, so a bug in this phase's model or loop cannot vouch for itself (the tests also
run on a learner's copy: `pytest tests/phase1 --impl NAME`).
"""

import pytest
import torch

import phase0_basics
from phase1_naive import ModelConfig, TinyTransformer, generate
from phase1_naive.generate import iter_tokens

PROMPT = [5, 17, 300, 42]
MAX_NEW = 12
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit along the oracle's path; float32 noise is ~1e-6


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return phase0_basics.TinyTransformer(phase0_basics.ModelConfig()).state_dict()


@pytest.fixture(scope="module")
def model(state):
    model = TinyTransformer(ModelConfig()).eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def expected(state) -> list[int]:
    """Greedy tokens for PROMPT by phase 0's full forward, one argmax per step; no near-ties."""
    oracle = phase0_basics.TinyTransformer(phase0_basics.ModelConfig()).eval()
    oracle.load_state_dict(state)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            top2 = oracle(torch.tensor([ids]))[0, -1].topk(2)
            assert top2.values[0] - top2.values[1] > MIN_MARGIN, "near-tie: pick another prompt"
            ids.append(int(top2.indices[0]))
    return ids[len(PROMPT) :]


def test_each_token_is_the_argmax_of_the_full_sequence(model, expected):
    assert generate(model, PROMPT, max_new_tokens=MAX_NEW) == expected


def test_stops_at_eos(model, expected):
    eos = expected[4]
    stopped = generate(model, PROMPT, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert stopped == expected[: expected.index(eos) + 1]


@pytest.mark.parametrize("prompt,max_new", [([], 4), ([1], 0)])
def test_bad_arguments(model, prompt, max_new):
    with pytest.raises(ValueError):
        generate(model, prompt, max_new_tokens=max_new)


def test_iter_tokens_streams_the_argmax_and_stops_after_eos(model, expected):
    """The loop itself, without `generate` around it: one token per step, EOS included."""
    assert list(iter_tokens(model, PROMPT, MAX_NEW)) == expected
    eos = expected[4]
    assert list(iter_tokens(model, PROMPT, MAX_NEW, eos_token_id=eos)) == expected[:5]


@pytest.mark.parametrize("prompt,max_new", [([], 4), ([1], 0)])
def test_iter_tokens_checks_its_arguments(model, prompt, max_new):
    with pytest.raises(ValueError):
        next(iter_tokens(model, prompt, max_new_tokens=max_new))
