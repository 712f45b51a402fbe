"""Phase 7 batched sampling: `sample_batch` draws every row in one pass with per-row parameters.

Checked statistically as in phase 2 (fixed seeds, chi-square at 99.9%), with many rows of the same
logits in one batch standing in for many draws; greedy rows exactly; seeded rows independent of
their batch, keyed by seed and token index. Philox against Random123's known answers; the race
kernel (what CUDA runs without filters) under the Triton interpreter: exactly the torch formula on
the host twin's noise, its draws against softmax(logits / T), seeded rows as the torch path
draws them.
"""

import os

import numpy as np
import pytest
import torch

from phase7_optim.sampling import (
    UNSEEDED_COUNTER,
    SamplingBatch,
    SamplingParams,
    philox4x32,
    philox_exponential,
    sample_batch,
)
from tests.phase2.test_sampling import LOGITS, PROBS, chi_square_ok

ROWS = 4000  # draws per distribution, as in phase 2
VOCAB = LOGITS.shape[0]


def draw(params: list[SamplingParams], logits: torch.Tensor, draws=None) -> torch.Tensor:
    draws = draws or [0] * len(params)
    batch = SamplingBatch.build(params, draws, logits.shape[-1], logits.device)
    return sample_batch(logits, batch)


def counts_of(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float()


@pytest.mark.parametrize(
    "params,expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=1.0, top_k=2), torch.tensor([0, 4 / 7, 0, 3 / 7])),
        (SamplingParams(temperature=1.0, top_p=0.85), torch.tensor([0, 4, 2, 3]) / 9),
        (SamplingParams(temperature=1.0, min_p=0.6), torch.tensor([0, 4 / 7, 0, 3 / 7])),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.5), torch.tensor([0, 4 / 7, 0, 3 / 7])),
        # vLLM's order: min-p first drops 0.1, the renormalized 0.2 (0.222) then falls outside the
        # 0.75 nucleus; phase 2's order (top-p first) would keep it: [0, 4, 2, 3] / 9
        (SamplingParams(temperature=1.0, min_p=0.45, top_p=0.75), torch.tensor([0, 4, 0, 3]) / 7),
    ],
)
def test_sampled_distribution(params, expected):
    torch.manual_seed(0)
    tokens = draw([params] * ROWS, LOGITS.expand(ROWS, VOCAB).clone())
    assert chi_square_ok(counts_of(tokens), expected)


def test_temperature_reshapes_distribution():
    torch.manual_seed(1)
    t = 0.5
    sharpened = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
    counts = counts_of(draw([SamplingParams(temperature=t)] * ROWS, LOGITS.expand(ROWS, VOCAB)))
    assert chi_square_ok(counts, sharpened)
    assert not chi_square_ok(counts, PROBS)  # the test can tell the difference


def test_rows_with_different_parameters_share_one_batch():
    """Greedy, plain, top-k and min-p rows interleaved: each row follows its own parameters."""
    torch.manual_seed(2)
    kinds = [
        (SamplingParams(temperature=0.0), torch.tensor([0.0, 1, 0, 0])),
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=1.0, top_k=2), torch.tensor([0, 4 / 7, 0, 3 / 7])),
        (SamplingParams(temperature=1.0, min_p=0.45), torch.tensor([0, 4, 2, 3]) / 9),
    ]
    params = [kinds[i % len(kinds)][0] for i in range(len(kinds) * ROWS)]
    tokens = draw(params, LOGITS.expand(len(params), VOCAB).clone())
    for k, (_, expected) in enumerate(kinds):
        mine = tokens[k :: len(kinds)]
        if expected.max() == 1:
            assert (mine == 1).all()  # greedy: the argmax, every time
        else:
            assert chi_square_ok(counts_of(mine), expected)


def test_greedy_rows_are_the_exact_argmax():
    torch.manual_seed(3)
    logits = torch.randn(64, 1000)
    logits[:, 7] = logits.max(dim=-1).values + 1e-6  # a near-tie the argmax must still win
    params = [SamplingParams(temperature=0.0)] * 32 + [SamplingParams(temperature=1.0)] * 32
    tokens = draw(params, logits)
    assert (tokens[:32] == logits[:32].argmax(dim=-1)).all()


def test_a_seeded_row_does_not_depend_on_its_batch():
    """Row 0's seed and the index of its token alone decide its draws, whatever the other rows
    are or how many, and whatever torch's global stream holds."""
    torch.manual_seed(4)
    logits = torch.randn(1, 50).expand(8, 50).clone()
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def tokens_of_row0(num_rows: int, other: SamplingParams) -> list[int]:
        params = [seeded] + [other] * (num_rows - 1)
        return [int(draw(params, logits[:num_rows], [i] * num_rows)[0]) for i in range(20)]

    alone = tokens_of_row0(1, seeded)
    assert tokens_of_row0(8, SamplingParams(temperature=0.7, top_k=3)) == alone
    torch.manual_seed(999)  # the global stream must not matter
    assert tokens_of_row0(4, SamplingParams(temperature=1.0)) == alone
    assert len(set(alone)) > 1  # it does sample, token after token


def test_seeded_rows_sample_the_softmax():
    """Seeded rows draw Philox noise: over many seeds, their tokens follow softmax(logits / T)."""
    t = 0.5
    sharpened = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
    params = [SamplingParams(temperature=t, seed=seed) for seed in range(ROWS)]
    tokens = draw(params, LOGITS.expand(ROWS, VOCAB).clone(), [3] * ROWS)
    assert chi_square_ok(counts_of(tokens), sharpened)
    assert not chi_square_ok(counts_of(tokens), PROBS)


@pytest.mark.parametrize(
    "counter,key,words",
    [  # Random123's known-answer vectors for Philox-4x32-10 (kat_vectors)
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_gives_the_known_answers(counter, key, words):
    as_words = lambda xs: tuple(np.array([x], dtype=np.uint64) for x in xs)  # noqa: E731
    assert [int(w[0]) for w in philox4x32(as_words(counter), as_words(key))] == list(words)


def test_philox_noise_is_keyed_by_key_counter_and_token():
    """A row's noise is a function of its key, its counter and the token: the same pair gives
    the same row in any batch and any vocabulary prefix, each half of either changes it, and a
    token's value is word t % 4 of Philox's call for quad t // 4."""
    keys = torch.tensor([7, 7, 8, 7, 7 + 2**32, -1])
    counters = torch.tensor([0, 1, 0, 2**32, 0, 5])
    noise = philox_exponential(keys, counters, 10)
    assert len({tuple(row.tolist()) for row in noise}) == len(keys)
    assert torch.equal(philox_exponential(keys[1:2], counters[1:2], 6), noise[1:2, :6])
    assert (noise > 0).all() and noise.isfinite().all()
    word = lambda x: np.array([x], dtype=np.uint64)  # noqa: E731
    words = philox4x32((word(2), word(1), word(0), word(0)), (word(7), word(0)))  # row 1's quad 2
    u = torch.tensor([(int(w[0]) >> 9) * 2 + 1 for w in words[:2]]) * 2.0**-24
    assert torch.allclose(noise[1, 8:10], -u.float().log())


def test_no_sort_unless_a_row_needs_top_k_or_top_p():
    params = [SamplingParams(temperature=1.0, min_p=0.1)] * 3 + [SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [0] * 4, VOCAB, torch.device("cpu"))
    assert not batch.any_top_k_top_p and batch.any_min_p and not batch.all_greedy
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0, top_k=2)], [0], VOCAB, torch.device("cpu")
    )
    assert batch.all_greedy and not batch.any_top_k_top_p  # greedy ignores the filters


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)


def race(logits, temperature, greedy, keys, counters=None, block=1024):
    """kernels/sampling.py's pass; counters default to each row's index."""
    from phase7_optim.kernels.sampling import exponential_race

    rows = logits.shape[0]
    keys = torch.full((rows,), keys) if isinstance(keys, int) else keys
    counters = torch.arange(rows) if counters is None else counters
    return exponential_race(logits, 1.0 / temperature, greedy, keys, counters, block)


@needs_interpreter
def test_exponential_race_kernel_is_the_torch_formula():
    """argmax(logits / T - log E) on the host twin's noise for each row's key and counter, and
    the exact argmax on greedy rows, ties to the lowest id, across the programs a row is split
    over too; the kernel's own noise equals the twin's."""
    pytest.importorskip("triton")
    from phase7_optim.kernels.sampling import exponential_noise

    torch.manual_seed(5)
    rows, vocab, block = 7, 5000, 1024  # five chunks a row, the last one masked
    logits = torch.randn(rows, vocab) * 3
    logits[2, [10, 4000]] = 50.0  # a greedy tie across chunks: token 10, as torch.argmax
    logits[4, [3000, 3001]] = 50.0  # a tie inside one chunk
    logits[6] = float("nan")  # a broken row gets a token of the vocabulary, never V
    keys = torch.tensor([3, 1, 6, 2**40 + 1, -5, 2, 4])
    counters = torch.tensor([0, 9, 0, 1, 2**32 + 1, 17, 3])
    noise = philox_exponential(keys, counters, vocab)
    torch.testing.assert_close(exponential_noise(keys, counters, vocab, block), noise)
    temperature = torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 0.25, 1.0])  # exact reciprocals
    greedy = torch.tensor([False, False, True, False, True, False, True])
    scores = logits / temperature[:, None] - noise.log()
    expected = torch.where(greedy, logits.argmax(dim=-1), scores.argmax(dim=-1))
    expected[6] = 0
    got = race(logits, temperature, greedy, keys, counters, block)
    assert got.tolist() == expected.tolist()
    assert got[2] == 10 and got[4] == 3000


@needs_interpreter
def test_drawn_noise_samples_the_softmax():
    """One draw per row (one key, a counter per row): the draws follow softmax(logits / T),
    which neither the argmax nor a uniform draw nor T = 1 would."""
    pytest.importorskip("triton")
    rows, t = 200, 0.5  # chi-square against T = 1's distribution: ~40, critical 16.3
    sharpened = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
    tokens = race(LOGITS.expand(rows, VOCAB).contiguous(), torch.full((rows,), t),
                  torch.zeros(rows, dtype=torch.bool), 11, block=VOCAB)  # fmt: skip
    assert chi_square_ok(counts_of(tokens), sharpened)


@needs_interpreter
def test_drawn_noise_is_keyed_by_key_and_counter_not_by_the_tiling():
    """Same keys and counters, same tokens, whatever the block; another key, others. Flat
    logits make the winner the token with the smallest noise: if rows shared their noise every
    row would pick the same token, and if a row's chunks shared theirs the first chunk would win
    every tie."""
    pytest.importorskip("triton")
    rows, vocab = 8, 16
    flat, temperature = torch.zeros(rows, vocab), torch.ones(rows)
    greedy = torch.zeros(rows, dtype=torch.bool)
    first = race(flat, temperature, greedy, 1, block=4).tolist()
    assert race(flat, temperature, greedy, 1, block=16).tolist() == first
    assert race(flat, temperature, greedy, 2, block=4).tolist() != first
    assert len(set(first)) > 1 and max(first) >= 4


@needs_interpreter
def test_the_race_draws_seeded_rows_as_the_torch_path_does():
    """sample_by_race (what CUDA runs without filters) and the torch path (filters, CPU) give a
    seeded row the same token, step after step as its draw index grows, beside unseeded and
    greedy rows; the step's key comes from torch's stream: torch.manual_seed replays the
    unseeded rows."""
    pytest.importorskip("triton")
    from phase7_optim.sampling import sample_by_race

    torch.manual_seed(9)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.7, seed=21),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=2**64 - 1),  # the top bit set: a negative int64
    ]

    def steps(n: int) -> list[list[int]]:
        torch.manual_seed(10)
        tokens = []
        for i in range(n):
            batch = SamplingBatch.build(params, [i, 0, 0, i + 5], 50, logits.device)
            tokens.append(sample_by_race(logits, batch).tolist())
            torch_path = sample_batch(logits, batch).tolist()
            assert [tokens[-1][r] for r in (0, 2, 3)] == [torch_path[r] for r in (0, 2, 3)]
            assert tokens[-1][2] == logits[2].argmax()
        return tokens

    first = steps(6)
    assert steps(6) == first
    assert len({t[1] for t in first}) > 1 and len({t[0] for t in first}) > 1  # rows sample


def test_an_unseeded_row_counts_by_its_row_and_a_seeded_one_by_its_draw():
    params = [SamplingParams(seed=5), SamplingParams(), SamplingParams(seed=2**63)]
    batch = SamplingBatch.build(params, [4, 9, 0], 50, torch.device("cpu"))
    assert batch.seeded == [0, 2]
    assert batch.noise_counters.tolist() == [4, UNSEEDED_COUNTER + 1, 0]
    assert batch.noise_keys.tolist()[::2] == [5, -(2**63)]


def test_the_race_compiles_for_hopper_with_philox_inside():
    """The interpreter runs Triton's language with numpy's rules (it accepted a constexpr global
    the compiler refuses): compiled for sm_90 without a GPU, the race must build, hold Philox's
    multiplies (two high halves a round, ten rounds a call: at least 20) and spill nothing."""
    from .test_kernels import compiled_for_hopper

    race = compiled_for_hopper(
        "import json; from benchmarks.phase7_kernel_sass import sampling_race; "
        "print(json.dumps(sampling_race()))"
    )
    assert race["multiply_high"] >= 20 and race["spill_instructions"] == 0, race


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gpu_sampled_distribution_through_the_kernel(temperature):
    torch.manual_seed(6)
    expected = PROBS ** (1 / temperature) / (PROBS ** (1 / temperature)).sum()
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=0.0)] * ROWS
    tokens = draw(params, LOGITS.expand(2 * ROWS, VOCAB).cuda().bfloat16()).cpu()
    assert (tokens[1::2] == 1).all()  # greedy rows
    assert chi_square_ok(counts_of(tokens[0::2]), expected)


@pytest.mark.gpu
def test_gpu_seeded_rows_draw_the_torch_twins_noise_through_the_kernel():
    """On CUDA, a seeded row's token is argmax(logits / T - log E) on the noise the host twin
    computes for its seed and draw index, through the race (no filter) and through the torch path
    (a top-k that keeps everything), beside unseeded rows the kernel draws for."""
    from phase7_optim.kernels.sampling import exponential_noise

    torch.manual_seed(7)
    rows, vocab, t = 8, 151_936, 0.5  # Qwen3's vocabulary: 38 programs a row; 1 / t is exact
    logits = (torch.randn(rows, vocab, device="cuda") * 2).bfloat16()
    seeds = [None if row % 2 else 100 + row for row in range(rows)]
    plain = [SamplingParams(temperature=t, seed=seed) for seed in seeds]
    filtered = [SamplingParams(temperature=t, seed=seed, top_k=vocab) for seed in seeds]
    for step in range(3):
        draws = [step + row for row in range(rows)]
        batch = SamplingBatch.build(plain, draws, vocab, torch.device("cuda"))
        noise = philox_exponential(batch.noise_keys, batch.noise_counters, vocab)
        torch.testing.assert_close(
            exponential_noise(batch.noise_keys, batch.noise_counters, vocab), noise
        )
        expected = (logits.float() / t - noise.log()).argmax(dim=-1).tolist()
        tokens = draw(plain, logits, draws).tolist()
        through_filters = draw(filtered, logits, draws).tolist()
        for row, seed in enumerate(seeds):
            if seed is not None:
                assert tokens[row] == through_filters[row] == expected[row]


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    # top_p = 1e-50 passes validation (> 0) but is 0 in float32: the top token must survive.
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=1.0, top_p=1e-50)] * 2
    batch = SamplingBatch.build(params, [0, 0], logits.shape[-1], logits.device)
    assert sample_batch(logits, batch).tolist() == [0, 1]
