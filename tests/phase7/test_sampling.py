"""Phase 7 batched sampling: `sample_batch` draws every row in one pass with per-row parameters.

Checked statistically as in phase 2 (fixed seeds, chi-square at 99.9%), with many rows of the same
logits in one batch standing in for many draws; greedy rows exactly; seeded rows independent of
their batch. The race kernel (what CUDA runs without filters) runs under the Triton interpreter:
exactly the torch formula on the noise it is given, its own Philox draws against softmax(logits /
T), and seeded rows against their generators' draws.
"""

import os

import pytest
import torch

from phase7_optim.sampling import TINY, SamplingBatch, SamplingParams, sample_batch
from tests.phase2.test_sampling import LOGITS, PROBS, chi_square_ok

ROWS = 4000  # draws per distribution, as in phase 2
VOCAB = LOGITS.shape[0]


def draw(params: list[SamplingParams], logits: torch.Tensor, generators=None) -> torch.Tensor:
    generators = generators or [None] * len(params)
    batch = SamplingBatch.build(params, generators, logits.shape[-1], logits.device)
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
    """Row 0's generator alone decides its draws, whatever the other rows are or how many."""
    torch.manual_seed(4)
    logits = torch.randn(1, 50).expand(8, 50).clone()
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def tokens_of_row0(num_rows: int, other: SamplingParams) -> list[int]:
        generator = torch.Generator().manual_seed(seeded.seed)
        params = [seeded] + [other] * (num_rows - 1)
        gens = [generator] + [None] * (num_rows - 1)
        return [int(draw(params, logits[:num_rows], gens)[0]) for _ in range(20)]

    alone = tokens_of_row0(1, seeded)
    assert tokens_of_row0(8, SamplingParams(temperature=0.7, top_k=3)) == alone
    torch.manual_seed(999)  # the global stream must not matter
    assert tokens_of_row0(4, SamplingParams(temperature=1.0)) == alone
    assert len(set(alone)) > 1  # it does sample


def test_no_sort_unless_a_row_needs_top_k_or_top_p():
    params = [SamplingParams(temperature=1.0, min_p=0.1)] * 3 + [SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [None] * 4, VOCAB, torch.device("cpu"))
    assert not batch.any_top_k_top_p and batch.any_min_p and not batch.all_greedy
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0, top_k=2)], [None], VOCAB, torch.device("cpu")
    )
    assert batch.all_greedy and not batch.any_top_k_top_p  # greedy ignores the filters


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)


def race(logits, temperature, greedy, seed, noise_rows=None, noise=None, block=1024):
    """kernels/sampling.py's pass; rows without a noise row draw their own."""
    from phase7_optim.kernels.sampling import NO_NOISE_ROW, exponential_race

    rows, vocab = logits.shape
    if noise_rows is None:
        noise_rows = torch.full((rows,), NO_NOISE_ROW, dtype=torch.int32)
    if noise is None:
        noise = torch.empty(0, vocab)
    return exponential_race(logits, 1.0 / temperature, greedy, seed, noise_rows, noise, block)


@needs_interpreter
def test_exponential_race_kernel_is_the_torch_formula():
    """Rows given noise (what seeded rows read) = argmax(logits / T - log E), and the exact
    argmax on greedy rows, ties to the lowest id, across the programs a row is split over too;
    each row reads the noise row `noise_rows` names; the noise is clamped inside the pass."""
    pytest.importorskip("triton")
    torch.manual_seed(5)
    rows, vocab, block = 7, 5000, 1024  # five chunks a row, the last one masked
    logits = torch.randn(rows, vocab) * 3
    logits[2, [10, 4000]] = 50.0  # a greedy tie across chunks: token 10, as torch.argmax
    logits[4, [3000, 3001]] = 50.0  # a tie inside one chunk
    logits[6] = float("nan")  # a broken row gets a token of the vocabulary, never V
    noise = torch.empty(rows, vocab).exponential_()
    noise[1, [7, 8]] = 0.0  # unclamped, as torch hands it over: the pass clamps it to TINY,
    logits[1, [7, 8]] = torch.tensor([1.0, 2.0])  # so the larger logit wins (not two +inf)
    temperature = torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 0.25, 1.0])  # exact reciprocals
    greedy = torch.tensor([False, False, True, False, True, False, True])
    scores = logits / temperature[:, None] - noise.clamp_min(TINY).log()
    expected = torch.where(greedy, logits.argmax(dim=-1), scores.argmax(dim=-1))
    expected[6] = 0
    order = torch.tensor([3, 1, 6, 0, 5, 2, 4])  # row r reads noise row order[r]
    got = race(logits, temperature, greedy, 0, order.int(), noise[order.argsort()], block)
    assert got.tolist() == expected.tolist()
    assert got[1] == 8 and got[2] == 10 and got[4] == 3000  # tiny noise wins its row


@needs_interpreter
def test_drawn_noise_samples_the_softmax():
    """Rows that read no noise draw it in the pass (Philox): one draw per row, and the draws
    follow softmax(logits / T), which neither the argmax nor a uniform draw nor T = 1 would."""
    pytest.importorskip("triton")
    rows, t = 200, 0.5  # chi-square against T = 1's distribution: ~40, critical 16.3
    sharpened = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
    tokens = race(LOGITS.expand(rows, VOCAB).contiguous(), torch.full((rows,), t),
                  torch.zeros(rows, dtype=torch.bool), seed=11, block=VOCAB)  # fmt: skip
    assert chi_square_ok(counts_of(tokens), sharpened)


@needs_interpreter
def test_drawn_noise_is_keyed_by_seed_row_and_chunk():
    """Same seed, same tokens; another seed, others. Flat logits make the winner the token with
    the smallest noise: if rows shared their noise every row would pick the same token, and if
    a row's chunks shared theirs the first chunk would win every tie."""
    pytest.importorskip("triton")
    rows, vocab, block = 8, 16, 4
    flat, temperature = torch.zeros(rows, vocab), torch.ones(rows)
    greedy = torch.zeros(rows, dtype=torch.bool)
    first = race(flat, temperature, greedy, seed=1, block=block).tolist()
    assert race(flat, temperature, greedy, seed=1, block=block).tolist() == first
    assert race(flat, temperature, greedy, seed=2, block=block).tolist() != first
    assert len(set(first)) > 1 and max(first) >= block


@needs_interpreter
def test_a_mixed_batch_routes_each_row():
    """Greedy rows take the argmax, rows with a noise row follow that noise whatever the seed,
    and drawn rows draw the same noise whatever their neighbours are."""
    pytest.importorskip("triton")
    from phase7_optim.kernels.sampling import NO_NOISE_ROW

    torch.manual_seed(8)
    rows, vocab, block = 6, 64, 16
    logits, temperature = torch.randn(rows, vocab), torch.full((rows,), 0.5)
    greedy = torch.tensor([True, False, False, False, True, False])
    noise = torch.empty(2, vocab).exponential_()
    noise_rows = torch.tensor([NO_NOISE_ROW, 1, NO_NOISE_ROW, 0, NO_NOISE_ROW, NO_NOISE_ROW])
    noise_rows = noise_rows.int()
    got = race(logits, temperature, greedy, 3, noise_rows, noise, block)
    assert got[[0, 4]].tolist() == logits[[0, 4]].argmax(dim=-1).tolist()
    scores = logits[[1, 3]] / 0.5 - noise[[1, 0]].log()
    assert got[[1, 3]].tolist() == scores.argmax(dim=-1).tolist()
    all_drawn = race(logits, temperature, torch.zeros(rows, dtype=torch.bool), 3, block=block)
    assert got[[2, 5]].tolist() == all_drawn[[2, 5]].tolist()
    assert race(logits, temperature, greedy, 4, noise_rows, noise, block)[[1, 3]].equal(got[[1, 3]])


@needs_interpreter
def test_the_race_draws_seeded_rows_as_the_torch_path_does():
    """sample_by_race (what CUDA runs without filters) draws a seeded row's noise from its own
    generator exactly as the torch path does (and as this pass did before it drew the rest
    itself): V values a step, so the row's token is argmax(logits / T - log E) on that noise,
    step after step. The pass's seed comes from torch's stream: torch.manual_seed replays the
    unseeded rows."""
    pytest.importorskip("triton")
    from phase7_optim.sampling import sample_by_race

    torch.manual_seed(9)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.7, seed=21),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=22),
    ]
    seeded = [row for row, p in enumerate(params) if p.seed is not None]

    def steps(n: int) -> list[list[int]]:
        generators = [
            None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params
        ]
        oracles = {row: torch.Generator().manual_seed(params[row].seed) for row in seeded}
        batch = SamplingBatch.build(params, generators, 50, logits.device)
        torch.manual_seed(10)
        tokens = []
        for _ in range(n):
            tokens.append(sample_by_race(logits, batch).tolist())
            for row, oracle in oracles.items():  # the torch path's draw, one row of V values
                noise = torch.empty(50).exponential_(generator=oracle).clamp_min(TINY)
                scores = logits[row] / params[row].temperature - noise.log()
                assert tokens[-1][row] == scores.argmax()
                assert torch.equal(generators[row].get_state(), oracle.get_state())
            assert tokens[-1][2] == logits[2].argmax()
        return tokens

    first = steps(4)
    assert steps(4) == first
    assert len({t[1] for t in first}) > 1  # row 1 samples


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
def test_gpu_seeded_rows_follow_their_generators_through_the_kernel():
    """On CUDA, a seeded row's token is argmax(logits / T - log E) on the noise its own CUDA
    generator gives (V values a step), beside unseeded rows the kernel draws for."""
    torch.manual_seed(7)
    rows, vocab, t = 8, 151_936, 0.5  # Qwen3's vocabulary: 38 programs a row; 1 / t is exact
    logits = (torch.randn(rows, vocab, device="cuda") * 2).bfloat16()
    seeds = [None if row % 2 else 100 + row for row in range(rows)]
    params = [SamplingParams(temperature=t, seed=seed) for seed in seeds]

    def generators() -> list[torch.Generator | None]:
        return [None if s is None else torch.Generator("cuda").manual_seed(s) for s in seeds]

    theirs, oracles = generators(), generators()
    for _ in range(3):
        tokens = draw(params, logits, theirs).tolist()
        for row, oracle in enumerate(oracles):
            if oracle is not None:
                noise = torch.empty(vocab, device="cuda").exponential_(generator=oracle)
                scores = logits[row].float() / t - noise.clamp_min(TINY).log()
                assert tokens[row] == int(scores.argmax())


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    # top_p = 1e-50 passes validation (> 0) but is 0 in float32: the top token must survive.
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=1.0, top_p=1e-50)] * 2
    batch = SamplingBatch.build(params, [None, None], logits.shape[-1], logits.device)
    assert sample_batch(logits, batch).tolist() == [0, 1]
