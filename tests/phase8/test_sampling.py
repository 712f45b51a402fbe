"""Phase 8 sampling: penalties against their reference formula, logprobs against log_softmax,
and the runner applying both around phase 7's batched sampler, which phase 8 carries unchanged."""

import os
import random

import pytest
import torch

import phase7_optim.sampling
import phase8_serving.sampling
from phase8_serving.logprobs import token_logprobs
from phase8_serving.model_runner import ModelRunner, SampledTokens
from phase8_serving.sampling import apply_logit_bias, apply_penalties, keep_allowed_tokens
from phase8_serving.sampling_params import SamplingParams
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


def test_allowed_token_ids_keep_only_theirs():
    """vLLM's allowed_token_ids: every other logit of that row -inf, other rows untouched, the
    caller's logits raw; a min_tokens that would mask every allowed token is refused."""
    logits = torch.randn(3, VOCAB)
    raw = logits.clone()
    kept = keep_allowed_tokens(logits, [None, (5, 7), (VOCAB - 1,)])
    assert torch.equal(logits, raw) and torch.equal(kept[0], raw[0])
    assert torch.isinf(kept[1]).sum() == VOCAB - 2 and torch.equal(kept[1, [5, 7]], raw[1, [5, 7]])
    assert kept[2].argmax() == VOCAB - 1 and torch.isinf(kept[2]).sum() == VOCAB - 1
    stopping = SamplingParams(allowed_token_ids=[3], stop_token_ids=[3], min_tokens=1)
    with pytest.raises(ValueError, match="only stop tokens"):
        stopping.check_allowed_tokens(frozenset())
    ignored = SamplingParams(allowed_token_ids=[3], min_tokens=1, ignore_eos=True)
    ignored.check_allowed_tokens(frozenset({3}))  # EOS ignored: not a stop token
    for bad in ([], [-1], [1.5], "1"):
        with pytest.raises((TypeError, ValueError), match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def sequence(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(0, "r", prompt, params)
    seq.token_ids += output
    return seq


def bare_runner(eos_token_ids: frozenset[int] = frozenset()) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # sample() uses the device and EOS ids
    runner.device = torch.device("cpu")
    runner.eos_token_ids = eos_token_ids
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
        return runner.sample(logits, seqs).token_ids.tolist()

    assert draw() == [7] * 4
    assert 7 not in draw(frequency_penalty=2.0)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    chosen = [4, 0, 9, 17]
    computed = token_logprobs(logits, torch.tensor(chosen), [0, 1, 3], [0, 2, 5])
    result = computed.tolists(chosen)
    assert result[2] is None  # row 2 did not ask
    del result[2]
    chosen = [4, 0, 17]
    expected = torch.log_softmax(logits[[0, 1, 3]], dim=-1)
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
    ids = sampled.token_ids
    first, second = SampledTokens([0, 1], ids, ids, None, sampled.logprobs).read()
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


def test_logit_bias_adds_per_row_and_leaves_the_raw_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    raw = logits.clone()
    biases = [{1: 5.0, 7: -2.5}, {}, {0: float("-inf"), 49: 100.0}]
    got = apply_logit_bias(logits, biases)
    want = raw.clone()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            want[row, token] += value
    assert torch.equal(got, want) and torch.equal(logits, raw)


def test_runner_masks_eos_and_stop_tokens_until_min_tokens():
    runner = bare_runner(eos_token_ids=frozenset({3}))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 5], logits[0, 8] = 9.0, 8.0, 7.0  # EOS, then a stop token, then 8
    greedy = dict(temperature=0.0, stop_token_ids=[5], min_tokens=2)

    def chosen(output: list[int], **params) -> int:
        return runner.sample(logits, [sequence([1], output, SamplingParams(**params))]).token_ids[0]

    assert chosen([], **greedy) == 8 and chosen([9], **greedy) == 8  # 0 and 1 tokens: masked
    assert chosen([9, 9], **greedy) == 3  # min_tokens reached: EOS may come
    assert chosen([], **{**greedy, "ignore_eos": True}) == 3  # ignore_eos: EOS is no stop
    assert chosen([], temperature=0.0, logit_bias={8: 5.0}) == 8  # 7 + 5 beats EOS's 9


def test_top_k_off_spellings_and_token_id_checks():
    assert SamplingParams(top_k=-1).top_k is None and SamplingParams(top_k=0).top_k is None
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(TypeError, match="top_k"):
        SamplingParams(top_k=0.0)
    params = SamplingParams(stop_token_ids=[3], logit_bias={7: 1.0})
    params.check_token_ids(8)
    for vocab, field in ((7, "logit_bias"), (3, "stop_token_ids")):
        with pytest.raises(ValueError, match=field):
            params.check_token_ids(vocab)


@pytest.mark.parametrize("kwargs,field", [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17}, "min_tokens"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"), ({"logit_bias": [(1, 1.0)]}, "logit_bias"),
    ({"logit_bias": {"1": 1.0}}, "logit_bias"),
])  # fmt: skip
def test_bad_min_tokens_and_logit_bias_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kwargs)  # max_tokens 16


def test_penalties_count_the_placeholder_tokens_on_the_device():
    """Overlap scheduling: a row's last output token may be known only on the device; counted
    there, it penalizes exactly as it would in the host's list."""
    rng = random.Random(3)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    prompts = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(3)]
    outputs = [[rng.randrange(VOCAB) for _ in range(5)] for _ in range(3)]
    params = [random_params(rng) for _ in range(3)]
    known = apply_penalties(logits, prompts, outputs, params)
    pending = (torch.tensor([0, 2]), torch.tensor([outputs[0][-1], outputs[2][-1]]))
    short = [outputs[0][:-1], outputs[1], outputs[2][:-1]]
    assert torch.equal(apply_penalties(logits, prompts, short, params, pending), known)
    assert not torch.equal(apply_penalties(logits, prompts, short, params), known)


def test_runner_counts_a_placeholder_for_penalties_and_min_tokens():
    """A sequence whose last token is a placeholder is sampled as if the host knew it: the
    presence penalty hits it, and it counts towards min_tokens."""
    runner = bare_runner(eos_token_ids=frozenset({3}))
    logits = torch.zeros(2, VOCAB)
    logits[:, 3], logits[:, 7], logits[:, 9] = 5.0, 6.0, 4.0  # 7, then EOS, then 9
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=2)
    seqs = [sequence([1], [9], params), sequence([1], [9], params)]
    seqs[1].seq_id = 1
    for seq in seqs:
        seq.num_output_placeholders = 1  # its second output token is still on the device
    got = runner.sample(logits, seqs, placeholders=torch.tensor([7, 9])).token_ids.tolist()
    # row 0 (placeholder 7): 7 is penalized to 4 and min_tokens is met, so EOS (5) wins;
    # row 1 (placeholder 9): 7 wins. Uncounted placeholders would give 7 in both rows.
    assert got == [3, 7]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)
def test_the_race_draws_as_phase7s():
    """Phase 8 carries phase 7's exponential race unchanged (kernels/sampling.py is the same
    file): the same rows, draw indices and torch seed give the same tokens, step after step."""
    pytest.importorskip("triton")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    temperatures, seeds = [0.7, 0.9, 0.0, 1.3], [21, None, None, 22]

    def tokens(sampling) -> list[list[int]]:
        params = [sampling.SamplingParams(temperature=t, seed=s)
                  for t, s in zip(temperatures, seeds, strict=True)]  # fmt: skip
        torch.manual_seed(5)
        return [
            sampling.sample_by_race(
                logits, sampling.SamplingBatch.build(params, [i] * 4, VOCAB, logits.device)
            ).tolist()
            for i in range(3)
        ]

    assert tokens(phase8_serving.sampling) == tokens(phase7_optim.sampling)


# -- bad_words (vLLM's): a word may start, never be completed -----------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_are_never_completed_offline(tiny_dir, async_scheduling):
    """The tiny model's greedy reply repeats one byte; banning it removes it, banning it twice
    in a row lets it start once and never again after itself. With overlap scheduling the
    output's last token is a placeholder when the next step samples: the ban reads it from the
    step before, and the tokens are those of the engine without overlap."""
    from phase8_serving import LLM

    llm = LLM(tiny_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling)
    prompt, greedy = [72, 105, 33], dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    (free,) = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)
    byte = free.outputs[0].token_ids[0]
    assert free.outputs[0].token_ids == [byte] * 16  # the test's premise
    word = llm.get_tokenizer().decode([byte])
    outs = llm.generate([prompt] * 2, [SamplingParams(**greedy, bad_words=[word]),
                                       SamplingParams(**greedy, bad_words=[word * 2])],
                        use_tqdm=False)  # fmt: skip
    never, once = (o.outputs[0].token_ids for o in outs)
    assert byte not in never
    assert once[0] == byte and byte not in once[1:]  # after it, the byte would complete the pair
    if async_scheduling:
        plain = LLM(tiny_dir, dtype="float32", device="cpu", async_scheduling=False)
        again = plain.generate([prompt], SamplingParams(**greedy, bad_words=[word * 2]),
                               use_tqdm=False)  # fmt: skip
        assert again[0].outputs[0].token_ids == once


def test_a_bad_word_is_banned_as_written_and_after_a_space():
    """Qwen3's tokenizer: " hello" is one token, not "hello"'s: both spellings are banned (vLLM's
    rule); a word whose spaced spelling takes more tokens keeps only its own."""
    from phase8_serving.engine import LLMEngine
    from phase8_serving.tokenizer import Tokenizer
    from tests.assets import qwen3_tokenizer_dir

    engine = LLMEngine.__new__(LLMEngine)  # the tokenizer is all `_encode_word` reads
    engine.tokenizer = Tokenizer.from_dir(qwen3_tokenizer_dir())
    encode = lambda text: tuple(engine._encode_word(text))  # noqa: E731
    spelled = lambda *words: SamplingParams(bad_words=words).bad_words_token_ids(encode)  # noqa: E731
    assert len(encode("hello")) == len(encode(" hello")) == 1
    assert spelled("  hello") == (encode("hello"), encode(" hello"))
    assert len(encode(" \u4f60\u597d")) > len(encode("\u4f60\u597d"))  # 你好: a space more
    assert spelled("\u4f60\u597d") == (encode("\u4f60\u597d"),)
    allowed = SamplingParams(bad_words=["hello"], allowed_token_ids=list(encode("hello")))
    with pytest.raises(ValueError, match="only bad words"):
        allowed.bad_words_token_ids(encode)


def test_bad_words_are_checked():
    assert SamplingParams(bad_words="x").bad_words == ("x",)  # one word, as `stop` takes one
    for bad in ([1], 3, [None]):
        with pytest.raises(TypeError, match="bad_words"):
            SamplingParams(bad_words=bad)
    for blank in ([""], [" "], ["x", "\n"]):
        with pytest.raises(ValueError, match="no blank words"):
            SamplingParams(bad_words=blank)
    with pytest.raises(ValueError, match="at most 1024 words"):
        SamplingParams(bad_words=["x"] * 1025)
