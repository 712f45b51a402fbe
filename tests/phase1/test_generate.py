"""Phase 1: the naive greedy loop, checked against a direct argmax over full forwards."""

import pytest
import torch

from phase1_naive import ModelConfig, TinyTransformer, generate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig()).eval()


def test_each_token_is_the_argmax_of_the_full_sequence(model):
    prompt = [5, 17, 300, 42]
    out = generate(model, prompt, max_new_tokens=12)
    assert len(out) == 12
    for i, token in enumerate(out):
        ids = torch.tensor([prompt + out[:i]])
        with torch.no_grad():
            assert token == int(model(ids)[0, -1].argmax())


def test_stops_at_eos(model):
    prompt = [5, 17, 300, 42]
    free_run = generate(model, prompt, max_new_tokens=12)
    eos = free_run[4]
    stopped = generate(model, prompt, max_new_tokens=12, eos_token_id=eos)
    assert stopped == free_run[: free_run.index(eos) + 1]


@pytest.mark.parametrize("prompt,max_new", [([], 4), ([1], 0)])
def test_bad_arguments(model, prompt, max_new):
    with pytest.raises(ValueError):
        generate(model, prompt, max_new_tokens=max_new)
