"""Overlap scheduling (`async_scheduling`) under phase 8's extras: the same outputs with it as
without it, offline and through the engine core.

Phase 8's sampling reads what a request has produced so far: the penalties count its tokens,
min_tokens counts how many there are. With overlap a step is sampled before the host has read
the token of the step before it; the penalties take that token from the device and min_tokens
counts the placeholder (model_runner.py), logit bias needs no token at all, and logprobs come
back with the token they describe. The oracle is the same engine with `async_scheduling=False`
(CPU's default), on a workload that asks for everything at once (penalties greedy and seeded,
logprobs, logit bias, min_tokens, stop tokens and stop strings, max_tokens 1, a JSON schema)
under preemption (recompute and swap), prefix caching and chunked prefill. The engine core runs
in this process (an inproc ZeroMQ pair, stepped as its loop steps it) with the real output
processor as its front end, so a stop string found there aborts a request whose next step is
already running.
"""

import msgspec
import pytest
import torch
import zmq

from phase8_serving import LLM, SamplingParams, StructuredOutputsParams
from phase8_serving.core_messages import (
    AbortRequests,
    AddRequests,
    CoreOutput,
    EngineCoreRequest,
    Hello,
    StepOutputs,
)
from phase8_serving.engine import RequestOutputKind
from phase8_serving.engine_core import EngineCore, EngineCoreSpec
from phase8_serving.metrics import EngineMetrics, EngineStats, cache_config_info
from phase8_serving.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
    pending_delta,
)

from .conftest import save_tiny_checkpoint

BLOCK_SIZE = 4
SHARED = list(range(60, 72))  # 3 full blocks: a prefix the prefix cache serves
PROMPTS = [
    SHARED + [1, 2, 3],
    SHARED + [40, 41, 42, 43],
    list(range(100, 130)),  # 30 tokens: chunked by a 16-token budget
    [200] * 5,
    [11, 12, 13],
    SHARED + [1, 2, 3],  # the first prompt again, other params
    list(range(150, 159)),
    [72, 105, 33],
    [90, 91, 92, 93],
]
MAX_TOKENS = 12
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
EOS = 257  # <|im_end|>, the tiny checkpoint's EOS
MIN_TOKENS = 4
STOP_AT = 5  # a stopped request's stop names what it would produce here
CLIENT_ABORTED = 1  # in the core, this request's client leaves after ABORT_AFTER tokens
ABORT_AFTER = 3
PRESSURED = dict(num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=6, block_size=BLOCK_SIZE)
CACHE_INFO = cache_config_info(BLOCK_SIZE, 12, 0, True)  # the front end's metrics need it
CONFIGS = {
    "roomy": dict(block_size=BLOCK_SIZE),
    "recompute": PRESSURED,
    "swap": dict(PRESSURED, preemption_mode="swap", num_cpu_kv_blocks=64),
}


@pytest.fixture(scope="module")
def spread_dir(tmp_path_factory):
    # test_cross_phase's checkpoint: logits spread out, so greedy has clear winners
    directory = tmp_path_factory.mktemp("tiny-spread-qwen3-overlap")
    return save_tiny_checkpoint(
        directory, num_hidden_layers=2, initializer_range=0.2, tie_word_embeddings=False
    )


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                             **kwargs})  # fmt: skip


def seeded(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=64, seed=seed, max_tokens=MAX_TOKENS,
                          ignore_eos=True, **kwargs)  # fmt: skip


def workload(stop_token: int, stop_string: str) -> list[SamplingParams]:
    return [
        greedy(presence_penalty=1.5, frequency_penalty=0.5),
        greedy(repetition_penalty=1.5, logprobs=2),
        seeded(3, frequency_penalty=1.0, logprobs=3),
        # EOS is masked until MIN_TOKENS, then certain: the count decides the length
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS, logit_bias={EOS: 100.0}
        ),  # fmt: skip
        seeded(9, presence_penalty=1.0, stop_token_ids=[stop_token]),  # one step late
        greedy(stop=(stop_string,), logprobs=0),
        greedy(max_tokens=1, repetition_penalty=1.2, logprobs=1),
        seeded(4, repetition_penalty=0.8, min_tokens=2, logit_bias={65: 2.0, 66: -3.0}),
        # its grammar reads the placeholder's token on the host before each step's mask
        seeded(5, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    ]


@pytest.fixture(scope="module")
def stops(spread_dir) -> tuple[int, str]:
    """Request 4's token at STOP_AT, and the first character of request 5's text at STOP_AT or
    later that it has not shown before: where they stop."""
    llm = LLM(spread_dir, dtype="float32", device="cpu")
    params = [seeded(9, presence_penalty=1.0), greedy()]
    seeded_out, greedy_out = (
        o.outputs[0] for o in llm.generate(PROMPTS[4:6], params, use_tqdm=False)
    )
    text = greedy_out.text
    char = next(c for i, c in enumerate(text) if i >= STOP_AT and c not in text[:i] + "\ufffd")
    return seeded_out.token_ids[STOP_AT], char


class SampleWatch:
    """Counts the sampling calls where a row with penalties had a placeholder: what this test
    must exercise (async scheduling on) or must never see (off)."""

    def __init__(self, runner, monkeypatch):
        self.penalized_placeholders = 0
        sample = runner.sample

        def watched(logits, seqs, placeholders=None, previous=None):
            if placeholders is not None:
                self.penalized_placeholders += sum(
                    s.num_output_placeholders > 0 and s.params.has_penalties for s in seqs
                )
            return sample(logits, seqs, placeholders, previous)

        monkeypatch.setattr(runner, "sample", watched)


def offline(model_dir, monkeypatch, params, async_scheduling: bool, **engine_kwargs):
    """Steps the engine to the end, checking invariants after every step. -> ({request index:
    (token ids, text, finish reason, logprobs)}, sampling calls with penalized placeholders,
    preemptions)."""
    llm = LLM(model_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling,
              **engine_kwargs)  # fmt: skip
    engine = llm.engine
    assert engine.config.async_scheduling is async_scheduling
    with monkeypatch.context() as patch:
        watch = SampleWatch(engine.runner, patch)
        ids = [llm.add_request(p, sp, output_kind=RequestOutputKind.FINAL_ONLY)
               for p, sp in zip(PROMPTS, params, strict=True)]  # fmt: skip
        done = {}
        while llm.has_unfinished_requests():
            for out in llm.step():  # final outputs only: text and stop strings as generate's
                c = out.outputs[0]
                done[ids.index(out.request_id)] = (c.token_ids, c.text, c.finish_reason,
                                                   c.logprobs)  # fmt: skip
            engine.scheduler.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.finished_in_flight
    return done, watch.penalized_placeholders, engine.num_preemptions


def assert_same_logprobs(got, want) -> None:
    """Same tokens and alternatives; values to float32 rounding (batches may differ in shape)."""
    assert (got is None) == (want is None)
    for a, b in zip(got or [], want or [], strict=True):
        assert a.token_id == b.token_id
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        values = lambda lp: [lp.logprob] + [v for _, v in lp.top_logprobs]  # noqa: E731
        torch.testing.assert_close(values(a), values(b), rtol=1e-5, atol=1e-5)


def assert_same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for index in want:
        assert got[index][:3] == want[index][:3], index
        assert_same_logprobs(got[index][3], want[index][3])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_offline_outputs_are_those_of_the_engine_without_overlap(spread_dir, monkeypatch, stops,
                                                                 config):  # fmt: skip
    params = workload(*stops)
    want, never, want_preempted = offline(spread_dir, monkeypatch, params, False,
                                          **CONFIGS[config])  # fmt: skip
    got, penalized, preempted = offline(spread_dir, monkeypatch, params, True, **CONFIGS[config])
    assert never == 0 and penalized > 0  # overlap did sample penalized rows on placeholders
    assert (preempted > 0) == (want_preempted > 0) == (config != "roomy")
    assert_same_outputs(got, want)
    tokens, _, reason, _ = got[3]
    assert reason == "stop" and len(tokens) == MIN_TOKENS + 1 and tokens[-1] == EOS
    tokens, _, reason, _ = got[4]
    assert reason == "stop" and tokens[-1] == stops[0] and len(tokens) <= STOP_AT + 1
    assert got[5][2] == "stop" and len(got[5][0]) < MAX_TOKENS  # the stop string ended it
    assert len(got[6][0]) == 1 and len(got[6][3]) == 1
    assert got[8][1].startswith("{")  # the grammar's, cut by max_tokens or complete


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_outputs_do_not_depend_on_preemption(spread_dir, monkeypatch, stops,
                                                    async_scheduling):  # fmt: skip
    """A seeded row's noise is keyed by its seed and the index of the token it draws
    (sampling.py), not by a generator's state: the seeded requests (penalties, logit bias, a
    grammar among them) produce the same tokens preempted (recompute or swap) as not."""
    params = workload(*stops)
    seeded_requests = [i for i, p in enumerate(params) if p.seed is not None]
    tokens = {}
    for config, kwargs in CONFIGS.items():
        done, _, _ = offline(spread_dir, monkeypatch, params, async_scheduling, **kwargs)
        tokens[config] = [done[i][0] for i in seeded_requests]
    assert tokens["recompute"] == tokens["swap"] == tokens["roomy"]
    assert len(seeded_requests) == 4


# -- the engine core, with the output processor as its front end ----------------------------------


class CoreInProcess:
    """An engine core on an inproc socket, stepped as its loop steps it (drain every message,
    then one engine step), and a front end that is the real output processor. Records which
    requests the core has aborted, and which of them were still in the step running on the
    device (`finished_in_flight`: their blocks wait for that step)."""

    def __init__(self, llm: LLM, address: str):
        self.engine = llm.engine
        self.context = zmq.Context()
        router = self.context.socket(zmq.ROUTER)
        router.bind(address)
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.connect(address)
        self.core = EngineCore(self.engine, EngineCoreSpec("unused", snapshot=None), router)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreOutput)
        tokenizer = llm.get_tokenizer()
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(
            tokenizer, EngineMetrics("m", EngineStats, 128, CACHE_INFO)
        )
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.aborted: set[str] = set()  # handled by the core
        self.freed_later: list[str] = []  # aborted while their step ran: freed once it is done

    def send(self, message) -> None:
        self.dealer.send(self.encoder.encode(message))
        assert self.core.socket.poll(5000)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        collector = self.collectors[request_id] = RequestOutputCollector()
        self.processor.add(RequestState.start(request_id, 0, collector, self.tokenizer, prompt,
                                              params))  # fmt: skip
        self.send(AddRequests([EngineCoreRequest(request_id, prompt, params)]))

    def abort(self, request_ids: list[str]) -> None:
        self.send(AbortRequests(request_ids))

    def step(self) -> StepOutputs | None:
        """One turn of the core's loop; -> the StepOutputs it sent, if it stepped."""
        pending = set(self.engine.requests)
        assert self.core._drain_inputs()
        self.aborted |= pending - set(self.engine.requests)
        finished_in_flight = {s.request_id for s in self.engine.scheduler.finished_in_flight}
        self.freed_later += sorted(finished_in_flight & self.aborted)
        if not self.engine.has_unfinished_requests():
            return None
        self.core._step()
        self.engine.scheduler.check_invariants()
        while True:
            assert self.dealer.poll(5000)
            message = self.decoder.decode(self.dealer.recv())
            if isinstance(message, StepOutputs):
                return message

    def close(self) -> None:
        self.context.destroy(linger=0)


def through_the_core(model_dir, params, async_scheduling: bool, **engine_kwargs) -> tuple:
    """Every request through an engine core and the output processor; request CLIENT_ABORTED's
    client leaves after ABORT_AFTER tokens. -> ({request index: (token ids, text, finish reason,
    logprobs)}, requests freed only once their step was done)."""
    llm = LLM(model_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling,
              **engine_kwargs)  # fmt: skip
    fe = CoreInProcess(llm, f"inproc://core-{async_scheduling}")
    try:
        fe.send(Hello())
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            fe.add(str(i), prompt, p)
        leaving = fe.collectors[str(CLIENT_ABORTED)]  # merges every delta: nobody reads it
        while (message := fe.step()) is not None:
            for output in message.outputs:
                assert output.request_id not in fe.aborted  # nothing after the core's abort
                assert len(output.new_token_ids) == 1  # one token per request and step
                if output.arrival_time is not None:  # the request's first output
                    assert output.arrival_time <= output.scheduled_time <= message.timestamp
            finished, to_abort = fe.processor.process(message)
            if to_abort:  # stop strings, found here
                fe.abort(to_abort)
            seen = leaving.pending[0].token_ids if leaving.pending else []
            if len(seen) == ABORT_AFTER and str(CLIENT_ABORTED) in fe.processor.states:
                fe.processor.remove([str(CLIENT_ABORTED)])
                fe.abort([str(CLIENT_ABORTED)])
        assert not fe.processor.states and not fe.engine.requests
        assert fe.engine.block_manager.num_used_blocks == 0
        deltas = {int(i): pending_delta(c.pending[0]) for i, c in fe.collectors.items()}
        results = {i: (d.token_ids, d.text, d.finish_reason, d.logprobs) for i, d in deltas.items()}
        return results, fe.freed_later
    finally:
        fe.close()


@pytest.mark.parametrize("config", ["roomy", "recompute"])
def test_the_core_sends_the_outputs_of_the_engine_without_overlap(spread_dir, stops, config):
    params = workload(*stops)
    want, freed_later = through_the_core(spread_dir, params, False, **CONFIGS[config])
    assert not freed_later
    got, freed_later = through_the_core(spread_dir, params, True, **CONFIGS[config])
    assert_same_outputs(got, want)
    assert len(got[CLIENT_ABORTED][0]) == ABORT_AFTER and got[CLIENT_ABORTED][2] is None
    assert got[5][2] == "stop" and len(got[5][0]) < MAX_TOKENS  # the front end's stop string
    # both aborts (the client's, the stop string's) hit a request whose next step was running
    assert sorted(freed_later) == sorted([str(CLIENT_ABORTED), "5"])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_core_frees_a_request_aborted_while_its_step_runs(spread_dir, async_scheduling):
    """The last request leaves while its next step runs: the core steps once more, with nothing
    to schedule, to retire that step, and only then are its blocks free."""
    llm = LLM(spread_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling)
    fe = CoreInProcess(llm, f"inproc://alone-{async_scheduling}")
    try:
        fe.send(Hello())
        fe.add("alone", PROMPTS[0], greedy())
        collector = fe.collectors["alone"]  # merges every delta: nobody reads it
        while not collector.pending or len(collector.pending[0].token_ids) < ABORT_AFTER:
            fe.processor.process(fe.step())
        fe.processor.remove(["alone"])
        fe.abort(["alone"])
        steps = 0
        while fe.step() is not None:
            steps += 1
        assert fe.freed_later == (["alone"] if async_scheduling else [])
        assert steps == async_scheduling  # the step that was running, read and retired
        assert fe.engine.block_manager.num_used_blocks == 0
    finally:
        fe.close()


# Qwen3-0.6B's attention and MLP shapes, 4 layers (phase 7's GPU tests' model): the real kernels.
SMALL_QWEN3 = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                   num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
                   initializer_range=0.1,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip


@pytest.fixture(scope="module")
def small_qwen3_dir(tmp_path_factory):
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests import assets

    directory = tmp_path_factory.mktemp("qwen3-small-overlap")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SMALL_QWEN3)).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.qwen3_tokenizer_dir() / name, directory / name)
    return directory


@pytest.mark.gpu
def test_gpu_overlap_with_penalties_and_logprobs_gives_the_tokens_without_it(small_qwen3_dir):
    """On CUDA with graphs (bf16), overlap on and off: penalties (the placeholder taken on the
    device), logprobs (computed before the next step's graph replay overwrites the logits), logit
    bias and min_tokens, greedy and seeded. max_tokens is the only stop (the stop token is
    biased away), so both engines run the same batches step for step: equality is exact."""
    params = [
        greedy(presence_penalty=1.5, frequency_penalty=0.5, logprobs=3),
        seeded(3, repetition_penalty=1.3, logprobs=1),
        greedy(min_tokens=8, stop_token_ids=[EOS], logit_bias={EOS: -100.0, 65: 2.0}),
        seeded(4, frequency_penalty=1.0, presence_penalty=-0.5),
    ] * 3
    params = params[: len(PROMPTS)]  # one each (PROMPTS grew to 9; the GPU run caught it)
    outputs = {}
    for overlap in (False, True):
        llm = LLM(small_qwen3_dir, dtype="bfloat16", device="cuda", max_num_seqs=8,
                  num_kv_blocks=1024, async_scheduling=overlap)  # fmt: skip
        assert llm.engine.runner.graphs is not None
        assert llm.engine.config.async_scheduling is overlap
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        outputs[overlap] = [o.outputs[0] for o in outs]
        del llm
    for got, want in zip(outputs[True], outputs[False], strict=True):
        assert got.token_ids == want.token_ids and len(got.token_ids) == MAX_TOKENS
        assert got.logprobs == want.logprobs


@pytest.mark.gpu
def test_gpu_phase8_sampling_never_syncs_inside_a_step(small_qwen3_dir):
    """With overlap on, a step whose rows ask for penalties, logprobs, logit bias and min_tokens
    still queues on the device without a host sync (the sync debug mode raises on any), so the
    host prepares the next step while this one runs."""
    llm = LLM(small_qwen3_dir, dtype="bfloat16", device="cuda", max_num_seqs=8,
              num_kv_blocks=1024, async_scheduling=True)  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    for prompt, p in zip(PROMPTS, workload(EOS, "\n"), strict=True):
        engine.add_request(prompt, p)
    execute, calls = runner.execute, []

    def execute_without_syncs(*args):
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
        try:
            calls.append(args)
            return execute(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.execute = execute_without_syncs
    for _ in range(6):
        engine.step()
    assert len(calls) == 6
