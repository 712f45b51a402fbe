"""Phase 8 sampling: penalties against their reference formula, logprobs against log_softmax,
and the runner applying both around phase 7's batched sampler."""

import random

import pytest
import torch

from phase8_serving.model_runner import ModelRunner
from phase8_serving.sampling import SamplingParams, apply_penalties, token_logprobs
from phase8_serving.sequence import Sequence

VOCAB = 50


def reference_penalties(logits: list[float], prompt, output, p: SamplingParams) -> list[float]:
    """vLLM's definitions, one token at a time, in plain Python."""
    result = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            r = p.repetition_penalty
            logit = logit / r if logit > 0 else logit * r
        count = output.count(token)
        logit -= p.frequency_penalty * count
        logit -= p.presence_penalty * (count > 0)
        result.append(logit)
    return result


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
    )


def test_penalties_match_the_reference_formula():
    rng = random.Random(0)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))] for _ in range(rows)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    params = [random_params(rng) for _ in range(rows)]
    got = apply_penalties(logits, prompts, outputs, params)
    for r in range(rows):
        want = reference_penalties(logits[r].tolist(), prompts[r], outputs[r], params[r])
        torch.testing.assert_close(got[r], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_no_penalty_changes_nothing():
    logits = torch.randn(2, VOCAB)
    same = apply_penalties(logits, [[1, 2], [3]], [[4, 4], []], [SamplingParams()] * 2)
    assert torch.equal(same, logits)
    assert not SamplingParams().has_penalties


def test_penalties_leave_the_callers_logits_raw():
    """The runner takes logprobs from the raw logits after penalizing: a new tensor, always."""
    logits = torch.randn(2, VOCAB)
    raw = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=1.0)] * 2
    penalized = apply_penalties(logits, [[1, 2], [3]], [[4, 4], [5]], params)
    assert torch.equal(logits, raw) and not torch.equal(penalized, raw)


def sequence(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(0, "r", prompt, params)
    seq.token_ids += output
    return seq


def bare_runner() -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # sample() uses only the generators and the device
    runner.generators, runner.device = {}, torch.device("cpu")
    return runner


def test_runner_penalizes_before_the_greedy_choice():
    runner = bare_runner()
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 9] = 5.0, 4.0  # 7 wins unless penalized
    chosen = lambda params, prompt, output: runner.sample(  # noqa: E731
        logits, [sequence(prompt, output, params)]
    ).token_ids.tolist()
    assert chosen(SamplingParams(temperature=0.0), [1], [7]) == [7]
    assert chosen(SamplingParams(temperature=0.0, presence_penalty=2.0), [1], [7]) == [9]
    by_prompt = SamplingParams(temperature=0.0, repetition_penalty=2.0)  # 7 in the prompt
    assert chosen(by_prompt, [7], []) == [9]


def test_runner_penalizes_the_sampled_rows():
    """A sampled (not greedy) row draws from the penalized distribution: token 7 is nearly
    certain without penalties, and never drawn once frequency_penalty pushes it 200 down."""
    runner = bare_runner()
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 10.0  # probability e^10 / (e^10 + 49): 0.998

    def draw(**penalty) -> list[int]:
        seqs = [sequence([1], [7] * 100, SamplingParams(seed=i, **penalty)) for i in range(4)]
        for i, seq in enumerate(seqs):
            seq.seq_id = i
        runner.generators.clear()
        return runner.sample(logits, seqs).token_ids.tolist()

    assert draw() == [7] * 4
    assert 7 not in draw(frequency_penalty=2.0)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    chosen = [4, 0, 17]
    result = token_logprobs(logits, chosen, [0, 2, 5])
    expected = torch.log_softmax(logits, dim=-1)
    for row, lp in enumerate(result):
        assert lp.token_id == chosen[row]
        assert lp.logprob == pytest.approx(expected[row, chosen[row]].item(), abs=1e-6)
        top = expected[row].topk(5)
        k = [0, 2, 5][row]
        assert [t for t, _ in lp.top_logprobs] == top.indices[:k].tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top.values[:k].tolist())


def test_runner_returns_logprobs_only_when_asked():
    runner = bare_runner()
    logits = torch.randn(2, VOCAB)
    seqs = [
        sequence([1], [], SamplingParams(temperature=0.0, logprobs=3, presence_penalty=1.0)),
        sequence([1], [], SamplingParams(temperature=0.0)),
    ]
    seqs[1].seq_id = 1
    sampled = runner.sample(logits, seqs)
    first, second = runner.with_logprobs(sampled, sampled.token_ids.tolist())
    assert second.logprobs is None
    assert first.logprobs.token_id == first.token_id == int(logits[0].argmax())
    assert len(first.logprobs.top_logprobs) == 3
    # Raw logprobs: penalties and temperature do not change them.
    assert first.logprobs.logprob == pytest.approx(
        torch.log_softmax(logits[0], -1).max().item(), abs=1e-6
    )


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1000.0), ("logprobs", 21), ("logprobs", -1),
])  # fmt: skip
def test_bad_new_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
