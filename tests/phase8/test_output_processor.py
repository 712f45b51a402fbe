"""The front end's half of the process boundary, without processes: the engine's token-ids-only
outputs, the output processor's text (against phase 7's engine, which detokenizes and cuts stop
strings itself), the offline `LLM` built on it, and the collector that merges what a slow client
has not read yet."""

import asyncio
import collections
import dataclasses
import random

import pytest
import torch
import transformers
from prometheus_client import CollectorRegistry, Histogram

import phase7_optim
from phase8_serving.core_messages import EngineCoreOutput, StepOutputs
from phase8_serving.engine import LLM, RequestOutputKind, TokenIdsOutput
from phase8_serving.logprobs import TokenLogprobs
from phase8_serving.metrics import (
    ITL_BUCKETS,
    CountedHistogram,
    EngineMetrics,
    EngineStats,
    cache_config_info,
)
from phase8_serving.output_processor import (
    EngineStepError,
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
    StreamDetokenizer,
)
from phase8_serving.sampling_params import SamplingParams
from phase8_serving.streaming import OutputDelta
from phase8_serving.tokenizer import IncrementalDetokenizer

PROMPT = [72, 105, 33]  # "Hi!"


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def phase7_llm(tiny_dir):
    """The oracle: phase 7's engine finds stop strings and holds text back itself."""
    return phase7_optim.LLM(tiny_dir, dtype="float32", device="cpu")


def phase7_params(params: SamplingParams) -> phase7_optim.SamplingParams:
    return phase7_optim.SamplingParams(temperature=params.temperature, seed=params.seed,
                                       max_tokens=params.max_tokens, stop=params.stop,
                                       ignore_eos=params.ignore_eos)  # fmt: skip


def core_outputs(llm, prompt, params) -> list[EngineCoreOutput]:
    """What an engine core sends for one request: its token-ids outputs, step by step."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert isinstance(out, TokenIdsOutput) and out.request_id == request_id  # no text
            outputs.append(EngineCoreOutput(request_id, out.new_token_ids, out.new_logprobs,
                                            out.finish_reason))  # fmt: skip
    return outputs


def process_all(llm, prompt, params, outputs) -> tuple[list[OutputDelta], list[str]]:
    """Feeds the outputs to an output processor, one step each; returns the deltas and aborts."""
    metrics = EngineMetrics("m", EngineStats, 128, cache_config_info(16, 8, 0, True))
    processor = OutputProcessor(llm.get_tokenizer(), metrics)
    collector = RequestOutputCollector()
    request_id = outputs[0].request_id
    processor.add(RequestState.start(request_id, 0, collector, llm.get_tokenizer(), prompt, params))
    deltas, aborts = [], []
    outputs[0].arrival_time = outputs[0].scheduled_time = 0.0  # the core's, on a first output
    for i, output in enumerate(outputs):
        finished, to_abort = processor.process(StepOutputs([output], float(i), EngineStats()))
        aborts += to_abort
        deltas.append(collector.get_nowait()[0])
        if finished:
            break
    return deltas, aborts


@pytest.mark.parametrize("stop", [(), ("a",), ("\n\n", "th")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_equals_the_offline_engine(llm, phase7_llm, stop, seed):
    """Same tokens, same text and finish reason as phase 7's `LLM.generate` (which detokenizes
    and cuts stop strings in its engine); a stop string found in the front end becomes an abort
    for the core."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, stop=stop)
    expected = phase7_llm.generate([PROMPT], phase7_params(params), use_tqdm=False)[0].outputs[0]
    no_stop = SamplingParams(temperature=1.0, seed=seed, max_tokens=30)
    outputs = core_outputs(llm, PROMPT, no_stop)  # the core runs past stop strings
    deltas, aborts = process_all(llm, PROMPT, params, outputs)
    text = "".join(d.text for d in deltas)
    ids = [t for d in deltas for t in d.token_ids]
    assert (text, ids, deltas[-1].finish_reason) == (
        expected.text, expected.token_ids, expected.finish_reason
    )  # fmt: skip
    stopped_early = len(deltas) < len(outputs)
    assert aborts == ([outputs[0].request_id] if stopped_early else [])


def test_streamed_text_is_never_taken_back(llm, phase7_llm):
    """A stop string taken from the text itself, so that its first character arrives a step
    before the rest: that character is held back, never shown and then withdrawn."""
    checked = 0
    for seed in range(8):
        free = SamplingParams(temperature=1.0, seed=seed, max_tokens=30)
        outputs = core_outputs(llm, PROMPT, free)
        text = "".join(d.text for d in process_all(llm, PROMPT, free, outputs)[0])
        ascii_pairs = [i for i in range(1, len(text) - 1) if text[i : i + 2].isascii()]
        if not ascii_pairs:
            continue
        stop = text[ascii_pairs[0] : ascii_pairs[0] + 2]
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, stop=(stop,))
        expected = phase7_llm.generate([PROMPT], phase7_params(params), use_tqdm=False)
        expected = expected[0].outputs[0].text
        shown = ""
        for delta in process_all(llm, PROMPT, params, outputs)[0]:
            shown += delta.text
            assert expected.startswith(shown), (shown, expected, stop)
        assert shown == expected
        checked += 1
    assert checked >= 4


def stop_found_in(text: str) -> tuple[str, ...]:
    """A two-character stop string the text holds past its start (ASCII: one byte token each,
    so its first character arrives a step before the second)."""
    i = next(i for i in range(1, len(text) - 1) if text[i : i + 2].isascii())
    return (text[i : i + 2],)


@pytest.mark.parametrize("stopped", [False, True])
def test_the_offline_llm_is_the_engine_and_the_output_processor(llm, phase7_llm, stopped):
    """`LLM.generate` and `LLM.step`'s deltas give phase 7's text, ids and finish reasons, stop
    strings and logprobs included: one hold-back rule, the output processor's, offline too; a
    streamed delta never shows what a later one takes back; a stop string ends the request in
    the engine too."""
    # ignore_eos: only a stop string stops them
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, logprobs=1, ignore_eos=True)
        for s in range(3)
    ]
    if stopped:  # each request's own text holds its stop string
        free = phase7_llm.generate([PROMPT] * 3, [phase7_params(p) for p in params], use_tqdm=False)
        params = [dataclasses.replace(p, stop=stop_found_in(o.outputs[0].text))
                  for p, o in zip(params, free, strict=True)]  # fmt: skip
    expected = [o.outputs[0] for o in phase7_llm.generate(
        [PROMPT] * 3, [phase7_params(p) for p in params], use_tqdm=False)]  # fmt: skip
    assert all((w.finish_reason == "stop") == stopped for w in expected)
    final = [o.outputs[0] for o in llm.generate([PROMPT] * 3, params, use_tqdm=False)]
    ids = [llm.add_request(PROMPT, p, output_kind=RequestOutputKind.DELTA) for p in params]
    streamed = {i: ("", [], []) for i in ids}
    while llm.has_unfinished_requests():
        for out in llm.step():
            text, token_ids, logprobs = streamed[out.request_id]
            c = out.outputs[0]
            streamed[out.request_id] = (
                text + c.text,
                token_ids + c.token_ids,
                logprobs + c.logprobs,
            )
            assert out.finished == (c.finish_reason is not None)
    assert not llm.requests and not llm.processor.states and not llm.engine.requests
    assert llm.engine.block_manager.num_used_blocks == 0
    for want, got, (text, token_ids, logprobs) in zip(
        expected, final, streamed.values(), strict=True
    ):
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids,
                                                                want.finish_reason)  # fmt: skip
        assert (text, token_ids) == (want.text, want.token_ids)
        assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in logprobs] == token_ids


def test_a_stop_token_has_no_text(llm):
    tokenizer = llm.get_tokenizer()
    eos = next(iter(tokenizer.eos_token_ids))
    (h,) = tokenizer.encode("H")
    params = SamplingParams(max_tokens=5)
    outputs = [EngineCoreOutput("r", [h]), EngineCoreOutput("r", [eos], None, "stop")]
    deltas, aborts = process_all(llm, PROMPT, params, outputs)
    assert [d.text for d in deltas] == ["H", ""] and deltas[-1].finish_reason == "stop"
    assert [d.token_ids for d in deltas] == [[h], [eos]] and not aborts


def test_a_stop_string_counts_only_after_min_tokens(llm):
    """vLLM's rule: a stop string ends the request only if it ends in the text of a token past
    min_tokens (the core cannot know: it sees no text)."""
    (z,) = llm.get_tokenizer().encode("Z")
    outputs = [EngineCoreOutput("r", [z]) for _ in range(5)]
    params = SamplingParams(max_tokens=5, stop=["Z"], min_tokens=3)
    deltas, aborts = process_all(llm, PROMPT, params, outputs)
    assert "".join(d.text for d in deltas) == "ZZZ" and len(deltas) == 4
    assert deltas[-1].finish_reason == "stop" and aborts == ["r"]
    deltas, _ = process_all(llm, PROMPT, SamplingParams(max_tokens=5, stop=["Z"]), outputs)
    assert [d.text for d in deltas] == [""] and deltas[-1].finish_reason == "stop"


def test_stop_reason_names_the_stop_and_a_kept_stop_string_stays(llm):
    """vLLM's `stop_reason`: the stop string found, or the `stop_token_ids` entry the core
    stopped on; EOS is none (even when stop_token_ids names it, unless ignore_eos), a length is
    none. `include_stop_str_in_output` cuts after the stop string instead of before it, and a
    stop string split over steps is still held back until it is whole, never shown early."""
    tokenizer = llm.get_tokenizer()
    a, x, y, b = (tokenizer.encode(c)[0] for c in "aXYb")
    split = [EngineCoreOutput("r", [t]) for t in (a, x, y, b)]
    for keep, text in ((False, "a"), (True, "aXY")):
        params = SamplingParams(max_tokens=9, stop=["XY"], include_stop_str_in_output=keep)
        deltas, aborts = process_all(llm, PROMPT, params, split)
        assert [d.text for d in deltas] == ["a", "", text[1:]]  # "X" waits for "Y"
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason, aborts) == ("stop", "XY", ["r"])
        assert all(d.stop_reason is None for d in deltas[:-1])
    eos = next(iter(tokenizer.eos_token_ids))
    for token, params, reason in (
        (b, SamplingParams(max_tokens=9, stop_token_ids=[b]), b),
        (eos, SamplingParams(max_tokens=9), None),
        (eos, SamplingParams(max_tokens=9, stop_token_ids=[eos]), None),
        (eos, SamplingParams(max_tokens=9, stop_token_ids=[eos], ignore_eos=True), eos),
    ):
        outputs = [EngineCoreOutput("r", [a]), EngineCoreOutput("r", [token], None, "stop")]
        deltas, _ = process_all(llm, PROMPT, params, outputs)
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", reason), params
    outputs = [EngineCoreOutput("r", [a]), EngineCoreOutput("r", [b], None, "length")]
    deltas, _ = process_all(llm, PROMPT, SamplingParams(max_tokens=2, stop_token_ids=[b]), outputs)
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("length", None)


def test_the_offline_llm_reports_the_stop_reason(llm, phase7_llm):
    """`CompletionOutput.stop_reason`, and the stop string kept in the text when asked."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=30)
    free = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert free.stop_reason is None
    (stop,) = stop_found_in(free.text)
    for keep in (False, True):
        sp = dataclasses.replace(params, stop=(stop,), include_stop_str_in_output=keep)
        out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
        end = free.text.index(stop) + (len(stop) if keep else 0)
        assert (out.text, out.finish_reason, out.stop_reason) == (free.text[:end], "stop", stop)


def test_the_offline_llm_reports_the_prompt_tokens_found_cached(llm):
    """vLLM's `RequestOutput.num_cached_tokens`: the prompt's prefix cache hit, whole blocks
    (16 tokens) of it; the first time, none."""
    prompt = [random.randrange(259) for _ in range(40)]  # new to the cache
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)


def test_prompt_logprobs_are_a_full_forwards(llm, tiny_dir):
    """`SamplingParams.prompt_logprobs` k: entry i of `RequestOutput.prompt_logprobs` is prompt
    token i's logprob given the tokens before it, its rank and the k most likely tokens, as
    transformers' forward over the whole prompt gives them; entry 0 is None. The same in chunks
    of 16 tokens, on a second run (a request for them matches no prefix cache block: it computes
    every prompt token), and when sequences are preempted mid-prompt and recomputed (each
    position is scored once)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(259) for _ in range(40)] for _ in range(3)]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
                    for p in prompts]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=3)
    chunked = LLM(tiny_dir, dtype="float32", device="cpu", max_num_batched_tokens=16)
    tight = LLM(tiny_dir, dtype="float32", device="cpu", num_kv_blocks=12, block_size=8,
                max_num_batched_tokens=16)  # fmt: skip
    for engine in (llm, llm, chunked, tight):
        for prompt, ref, out in zip(
            prompts, expected, engine.generate(prompts, params, use_tqdm=False), strict=True
        ):
            scored = out.prompt_logprobs
            assert len(scored) == len(prompt) and scored[0] is None and out.num_cached_tokens == 0
            for i in range(1, len(prompt)):
                want, got = ref[i - 1], scored[i]
                assert got.token_id == prompt[i]
                assert got.logprob == pytest.approx(want[prompt[i]].item(), abs=1e-5)
                assert got.rank == 1 + int((want > want[prompt[i]]).sum())
                assert [t for t, _ in got.top_logprobs] == want.topk(3).indices.tolist()
    assert tight.engine.num_preemptions > 0  # the case under test happened
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_need_one_tensor_parallel_rank(llm):
    """Only rank 0 runs the scoring (its LM head shard alone cannot): with more ranks, a request
    for prompt logprobs is refused before it leaves the front end, the others are served."""
    import msgspec

    from phase8_serving.async_engine import check_prompt
    from phase8_serving.engine_core import core_info

    info = msgspec.structs.replace(core_info(llm.engine), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        check_prompt(info, PROMPT, SamplingParams(prompt_logprobs=1))
    check_prompt(info, PROMPT, SamplingParams(logprobs=1))


def split_prompts(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt, the ids that finish its last character): PROMPT, and prompts that end inside a
    character (byte tokens: a prompt of token ids can end anywhere)."""
    e_acute, emoji = tokenizer.encode("é"), tokenizer.encode("😀")  # 2 and 4 byte tokens
    return [(PROMPT, []), (PROMPT + e_acute[:1], e_acute[1:]), (PROMPT + emoji[:2], emoji[2:]),
            (emoji[:3], emoji[3:])]  # fmt: skip


def test_decode_stream_agrees_with_the_two_offset_detokenizer(llm):
    """`DecodeStream` (Rust) and phase 6's detokenizer give the same deltas, invalid UTF-8
    included (random bytes), and the same flushed tail, also after a prompt that ends inside a
    character, whether the output finishes that character or not (the character is the
    prompt's: the output shows neither it nor a U+FFFD for it)."""
    tokenizer = llm.get_tokenizer()
    rng = random.Random(0)
    for prompt, rest in split_prompts(tokenizer):
        completions = [rest + tokenizer.encode("ab"), tokenizer.encode("ab")]
        completions += [[rng.randrange(256) for _ in range(rng.randrange(1, 12))]
                        for _ in range(50)]  # fmt: skip
        for ids in completions:
            fast = StreamDetokenizer(tokenizer, prompt, True)
            slow = IncrementalDetokenizer(tokenizer, prompt, True)
            for token in ids:
                assert fast.add_tokens([token]) == slow.add_tokens([token]), (prompt, ids)
            assert fast.flush() == slow.flush(), (prompt, ids)


def test_collector_merges_what_the_reader_has_not_taken():
    async def main():
        collector = RequestOutputCollector()
        collector.put(0, OutputDelta("a", [1], None, None))
        collector.put(1, OutputDelta("x", [9], None, None))
        collector.put(0, OutputDelta("b", [2], None, "stop", "b"))  # the reader lagged: merged
        first = await collector.get()
        assert first == {0: OutputDelta("ab", [1, 2], None, "stop", "b"),
                         1: OutputDelta("x", [9], None, None)}  # fmt: skip
        assert not collector.ready.is_set()
        collector.fail(RuntimeError("core died"))
        with pytest.raises(RuntimeError, match="core died"):
            await collector.get()

    asyncio.run(main())


def test_collector_hands_a_kept_up_reader_the_delta_itself_and_never_alters_it():
    """The usual case costs no copy: a delta taken before the next one comes is the very
    object put. A merge copies first: the first delta's lists (the core message's own) are
    left as they were."""
    collector = RequestOutputCollector()
    delta = OutputDelta("a", [1], None, None)
    collector.put(0, delta)
    assert collector.get_nowait()[0] is delta
    ids, logprobs = [1], [TokenLogprobs(1, -0.5, ())]
    collector.put(0, OutputDelta("a", ids, logprobs, None))
    collector.put(0, OutputDelta("b", [2], [TokenLogprobs(2, -1.0, ())], "length"))
    merged = collector.get_nowait()[0]
    assert merged.text == "ab" and merged.token_ids == [1, 2] and len(merged.logprobs) == 2
    assert ids == [1] and len(logprobs) == 1


def test_counted_histogram_renders_as_prometheus_clients_histogram():
    """The inter-token latency histogram, fed (gap, count) once per step, exposes the same text
    as prometheus_client's own fed one gap at a time (buckets' edges included)."""
    rng = random.Random(0)
    gaps = [rng.choice(ITL_BUCKETS) for _ in range(20)] + [rng.uniform(0, 100) for _ in range(80)]
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = CountedHistogram("itl_seconds", "Gaps.", "m", ITL_BUCKETS)
    ours_registry.register(ours)
    theirs = Histogram("itl_seconds", "Gaps.", ["model_name"], registry=theirs_registry,
                       buckets=ITL_BUCKETS).labels("m")  # fmt: skip
    for gap, count in collections.Counter(gaps).items():
        ours.observe(gap, count)
    for gap in gaps:
        theirs.observe(gap)

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for metric in registry.collect() for s in metric.samples
                if not s.name.endswith("_created")}  # fmt: skip

    assert samples(ours_registry) == pytest.approx(samples(theirs_registry))


def test_a_request_whose_text_fails_fails_alone_and_is_aborted(llm):
    """An exception making one request's text (a front-end bug, or a blank exercise 8.3) fails
    that request with an error and asks the core to abort it; the request beside it goes on.
    Before, the exception left the step's loop: both clients waited forever."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [1, 2, 3]
    metrics = EngineMetrics("m", EngineStats, 128, cache_config_info(16, 8, 0, True))
    processor = OutputProcessor(llm.get_tokenizer(), metrics)

    class Broken(RequestState):
        def update(self, output):
            raise NotImplementedError("exercise 8.3")

    collectors = {}
    for request_id, kind in (("bad", Broken), ("good", RequestState)):
        collectors[request_id] = RequestOutputCollector()
        processor.add(kind.start(request_id, 0, collectors[request_id], llm.get_tokenizer(),
                                 prompt, params))  # fmt: skip
    outputs = [EngineCoreOutput(r, [42], None, None) for r in ("bad", "good")]
    for output in outputs:
        output.arrival_time = output.scheduled_time = 0.0
    finished, to_abort = processor.process(StepOutputs(outputs, 0.0, EngineStats()))
    assert to_abort == ["bad"] and [s.request_id for s in finished] == ["bad"]
    with pytest.raises(EngineStepError, match="exercise 8.3"):
        collectors["bad"].get_nowait()
    assert collectors["good"].get_nowait()[0].token_ids == [42]
    assert "bad" not in processor.states and "good" in processor.states


# -- n > 1: one request, n completions (vLLM's parallel sampling) --------------------------------


def test_n_completions_are_n_requests_seeded_seed_plus_i(llm):
    """generate with n=3 gives one output per prompt, its completions in index order, choice i
    exactly what n=1 with seed + i gives (vLLM's rule); the choices share one fairness group; a
    greedy n=2 repeats itself."""
    params = SamplingParams(temperature=1.0, seed=2**64 - 2, n=3, max_tokens=12, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT[:2]], params, use_tqdm=False)
    assert len(outs) == 2 and all(o.finished for o in outs)
    for out, prompt in zip(outs, [PROMPT, PROMPT[:2]], strict=True):
        assert out.prompt_token_ids == prompt and [c.index for c in out.outputs] == [0, 1, 2]
        for i, completion in enumerate(out.outputs):
            one = dataclasses.replace(params, n=1, seed=(params.seed + i) % 2**64)
            alone = llm.generate([prompt], one, use_tqdm=False)[0].outputs[0]
            assert (completion.text, completion.token_ids) == (alone.text, alone.token_ids)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, n=2, max_tokens=8),
                          use_tqdm=False)[0].outputs  # fmt: skip
    assert greedy[0].token_ids == greedy[1].token_ids and greedy[1].index == 1
    llm.add_request(PROMPT, SamplingParams(n=2), request_id="grouped")
    groups = {llm.engine.requests[f"{i}_grouped"].seq.group_id for i in range(2)}
    llm.abort_request("grouped")
    assert groups == {"grouped"}


def test_n_completions_stream_under_one_id_and_abort_together(llm):
    """Streamed (DELTA): each output carries one choice's delta with its index, under the
    request's id, finished only with the last choice; the deltas add up to generate's. Aborting
    the request (or one of its choices) stops every choice and frees their blocks."""
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10, ignore_eos=True,
                            stop=("zz",))  # fmt: skip
    final = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    request_id = llm.add_request(PROMPT, params, output_kind=RequestOutputKind.DELTA)
    texts, finished = ["", ""], []
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == request_id and len(out.outputs) == 1
            texts[out.outputs[0].index] += out.outputs[0].text
            finished.append(out.finished)
    assert texts == [c.text for c in final]
    assert finished[-1] and not any(finished[:-1])
    assert not llm.parents and not llm.requests
    for name in ("whole", "0_whole"):
        llm.add_request(PROMPT, params, request_id="whole")
        llm.step()
        llm.abort_request(name)
        assert not llm.has_unfinished_requests() and not llm.parents and not llm.requests
        assert llm.engine.block_manager.num_used_blocks == 0


def test_n_is_checked_and_the_engine_takes_one(llm):
    for bad, error in ((0, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match="SamplingParams.n"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="one completion a request, got n=2"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))
    llm.add_request(PROMPT, SamplingParams(n=2), request_id="taken")
    for n in (1, 2):
        with pytest.raises(ValueError, match="'taken' is already in use"):
            llm.add_request(PROMPT, SamplingParams(n=n), request_id="taken")
    with pytest.raises(ValueError, match="exceeds"):  # the first choice fails: nothing queued
        llm.add_request(PROMPT, SamplingParams(n=3, max_tokens=10**6))
    llm.abort_request("taken")
    assert not llm.has_unfinished_requests() and not llm.parents and not llm.requests
