"""Phase 6: `sample_batch` samples a batch in one pass and gives every row what it gets alone.

Oracle: phase 2's per-row `Sampler.__call__` (same file, the readable version), drawing with an
identically seeded generator. Equality is exact: the batched filters compute the same values row
by row, and each random row draws from its own generator.
"""

import pytest
import torch

from phase6_qwen3.sampling import (
    Sampler,
    SamplingParams,
    batch_filtered_logits,
    filtered_logits,
    sample_batch,
)

VOCAB = 1000
STEPS = 40
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(temperature=1.3, min_p=0.05, seed=4),
    SamplingParams(temperature=0.6, min_p=0.02, top_k=50, top_p=0.8, seed=5),
    SamplingParams(temperature=1.0, top_k=VOCAB + 7, top_p=1.0, seed=6),  # filters that keep all
    SamplingParams(temperature=1e-5, seed=7),  # the smallest temperature: all mass on the top
]


def step_logits(step: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, VOCAB, generator=generator) * 3  # spread: filters matter


def alone(i: int) -> list[int]:
    """Row i's tokens drawn one at a time by the per-row sampler, from row i of each step."""
    sampler = Sampler(PARAMS[i])
    return [sampler(step_logits(step, len(PARAMS))[i]) for step in range(STEPS)]


def batched(order: list[int]) -> dict[int, list[int]]:
    """Every row of `order` sampled together at each step; tokens per original row index."""
    samplers = [Sampler(PARAMS[i]) for i in order]
    tokens: dict[int, list[int]] = {i: [] for i in order}
    for step in range(STEPS):
        logits = step_logits(step, len(PARAMS))[order]
        for i, token in zip(order, sample_batch(logits, samplers), strict=True):
            tokens[i].append(token)
    return tokens


@pytest.fixture(scope="module")
def oracle() -> dict[int, list[int]]:
    return {i: alone(i) for i in range(len(PARAMS))}


def test_every_row_gets_what_it_gets_alone(oracle):
    assert batched(list(range(len(PARAMS)))) == oracle
    assert len(set(map(tuple, oracle.values()))) > 4, "rows should not all draw alike"


@pytest.mark.parametrize("order", [[5, 1, 3], [3, 0, 7, 2, 6, 4], [1]])
def test_seeded_rows_do_not_depend_on_their_batch_mates(order, oracle):
    assert batched(order) == {i: oracle[i] for i in order}


def test_greedy_rows_are_the_exact_argmax():
    logits = step_logits(0, 3)
    samplers = [Sampler(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert sample_batch(logits, samplers) == logits.argmax(dim=-1).tolist()


def test_batch_filters_equal_the_per_row_filters_exactly():
    logits = step_logits(0, len(PARAMS))
    # A peaked row: float32 probabilities 1.0 and ~1e-13, so the cumsum reaches 1 before the tail;
    # top_p = 1 must still keep the tail, as the per-row filter (which skips top-p at 1) does.
    logits[6] = torch.zeros(VOCAB).index_fill(0, torch.tensor([0]), 30.0)
    batched = batch_filtered_logits(logits, PARAMS)
    for row, params in enumerate(PARAMS):
        if not params.greedy:
            assert torch.equal(batched[row], filtered_logits(logits[row], params)), params
