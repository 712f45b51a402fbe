"""Overlap scheduling (`async_scheduling`) on CPU: the same tokens as without it, and the order
that hides the host's work.

On CPU the device is synchronous, so overlap buys no time here, but everything it changes runs
as on a GPU: placeholders, the next step's input ids gathered from the previous step's sampled-id
tensor, stop tokens seen one step late with the extra token dropped, blocks of a stopped request
kept until the step still computing it is done. The oracle is the same engine with
`async_scheduling=False`, on a workload that exercises everything at once: greedy and seeded
requests, a small KV cache (preemption, recompute and swap), prefix caching, chunked prefill,
stop token ids, max_tokens 1, an abort while the request is in flight.
"""

import pytest

from phase7_optim import LLM, EngineConfig, SamplingParams, StepTrace
from phase7_optim.model_runner import SampledTokens

BLOCK_SIZE = 4
SHARED = list(range(500, 512))  # 3 full blocks: a prefix the prefix cache serves
PROMPTS = [
    SHARED + [7, 8, 9],
    SHARED + [40, 41, 42, 43, 44, 45],
    list(range(1000, 1030)),  # 30 tokens: chunked by a 16-token budget
    [31337] * 5,
    [11, 12, 13],
    SHARED + [7, 8, 9],  # the first prompt again, seeded this time
    list(range(2000, 2009)),  # aborted mid-flight
]
MAX_TOKENS = 12
ABORTED = 6  # index of the request aborted once its caller has seen ABORT_AFTER tokens
ABORT_AFTER = 3
STOP_AT = 3  # the token a stopped request's stop_token_ids name: its 4th greedy token
# Small enough that requests are preempted, large enough for the longest one (11 blocks).
PRESSURED = dict(num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=6, block_size=BLOCK_SIZE)
CONFIGS = {
    "recompute": PRESSURED,
    "swap": dict(PRESSURED, preemption_mode="swap", num_cpu_kv_blocks=64),
    "roomy": dict(block_size=BLOCK_SIZE),  # no preemption: schedules of both modes align
}


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def seeded(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=64, seed=seed, max_tokens=MAX_TOKENS,
                          ignore_eos=True, **kwargs)  # fmt: skip


def workload(stop_tokens: tuple[int, int]) -> list[SamplingParams]:
    greedy_stop, seeded_stop = stop_tokens
    return [
        greedy(),
        seeded(7),
        greedy(stop_token_ids=[greedy_stop]),  # stops early, one step late under overlap
        greedy(max_tokens=1),
        seeded(8, stop_token_ids=[seeded_stop]),  # its extra draw comes after its last token
        seeded(9),
        greedy(),
    ]


class Watch:
    """Records the engine's launches, reads and frees, and checks as it goes that no block is
    freed while a launched, unread step writes it (the shadow check) outside preemption: a
    preempted sequence's blocks are freed while the step before may still write them, and are
    safe because the device runs steps in launch order (engine.py)."""

    def __init__(self, engine, monkeypatch):
        self.engine, self.events, self.writes = engine, [], {}  # writes: id(sampled) -> blocks
        self.launched = []  # kept alive, so that no two steps share an id()
        self.scheduling = False
        runner, manager, scheduler = engine.runner, engine.block_manager, engine.scheduler
        launch, free, schedule = runner.launch, manager.free, scheduler.schedule
        read = SampledTokens.tolist

        def watched_launch(scheduled, previous=None):
            written = {b for seq, n in scheduled for b in self.blocks_written(seq, n)}
            sampled = launch(scheduled, previous)
            self.writes[id(sampled)] = written
            self.launched.append(sampled)
            self.events.append(("launch", id(sampled)))
            return sampled

        def watched_read(sampled):
            self.events.append(("read", id(sampled)))
            self.writes.pop(id(sampled), None)  # done: the device has finished it
            return read(sampled)

        def watched_free(seq):
            if not self.scheduling:
                in_flight = set().union(*self.writes.values())
                freed = set(manager.block_tables[seq.seq_id]) & in_flight
                assert not freed, f"{seq} freed blocks {freed} that a running step writes"
            free(seq)

        def watched_schedule():
            self.scheduling = True
            try:
                return schedule()
            finally:
                self.scheduling = False

        monkeypatch.setattr(runner, "launch", watched_launch)
        monkeypatch.setattr(SampledTokens, "tolist", watched_read)
        monkeypatch.setattr(manager, "free", watched_free)
        monkeypatch.setattr(scheduler, "schedule", watched_schedule)

    def blocks_written(self, seq, num_new: int) -> list[int]:
        table = self.engine.block_manager.block_tables[seq.seq_id]
        first, last = seq.num_computed_tokens, seq.num_computed_tokens + num_new - 1
        return table[first // BLOCK_SIZE : last // BLOCK_SIZE + 1]


def run(model_dir, monkeypatch, params, async_scheduling: bool, **engine_kwargs):
    """Steps the engine to the end, checking invariants after every step; aborts request ABORTED
    once its caller has seen ABORT_AFTER of its tokens. -> (outputs by request index, the
    aborted request's tokens seen, preemptions, launches)."""
    trace = StepTrace()
    llm = LLM(model_dir, dtype="float32", device="cpu", trace=trace,
              async_scheduling=async_scheduling, **engine_kwargs)  # fmt: skip
    engine = llm.engine
    assert engine.config.async_scheduling is async_scheduling
    with monkeypatch.context() as patch:
        watch = Watch(engine, patch)
        ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
        done, seen = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
                if out.finished:
                    done[ids.index(out.request_id)] = (tokens, out.outputs[0].finish_reason)
                if out.request_id == ids[ABORTED] and len(tokens) == ABORT_AFTER:
                    seen = tokens
                    engine.abort_request(out.request_id)
            engine.scheduler.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.finished_in_flight
    launches = sum(kind == "launch" for kind, _ in watch.events)
    return done, seen, sum(len(r.preempted) for r in trace.steps), launches


@pytest.fixture(scope="module")
def stop_tokens(tiny_qwen3_tied_dir) -> tuple[int, int]:
    """The tokens requests 2 (greedy) and 4 (seeded) produce at position STOP_AT."""
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu")
    outs = llm.generate([PROMPTS[2], PROMPTS[4]], [greedy(), seeded(8)], use_tqdm=False)
    return tuple(out.outputs[0].token_ids[STOP_AT] for out in outs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_overlap_gives_the_tokens_of_the_engine_without_it(
    tiny_qwen3_tied_dir, monkeypatch, stop_tokens, config
):
    params = workload(stop_tokens)
    kwargs = CONFIGS[config]
    want, want_seen, want_preempted, _ = run(tiny_qwen3_tied_dir, monkeypatch, params, False,
                                              **kwargs)  # fmt: skip
    got, seen, preempted, _ = run(tiny_qwen3_tied_dir, monkeypatch, params, True, **kwargs)
    assert got == want
    assert seen == want_seen and len(seen) == ABORT_AFTER and ABORTED not in got
    for index, stop_token in zip((2, 4), stop_tokens, strict=True):
        tokens, reason = got[index]
        assert reason == "stop" and len(tokens) <= STOP_AT + 1 and tokens[-1] == stop_token
    assert len(got[3][0]) == 1
    assert (preempted > 0) == (config != "roomy") and (want_preempted > 0) == (preempted > 0)


def test_a_stop_is_seen_one_step_late_and_max_tokens_never(tiny_qwen3_tied_dir, monkeypatch,
                                                         stop_tokens):  # fmt: skip
    """Alone, a request stopping at its k-th token runs k + 1 steps under overlap (the extra
    token is dropped); one ending at max_tokens runs exactly max_tokens steps either way."""
    prompt = PROMPTS[2]
    stop = greedy(stop_token_ids=[stop_tokens[0]])
    for params, extra in ((stop, 1), (greedy(max_tokens=5), 0)):
        launches = {}
        for overlap in (False, True):
            llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu",
                      async_scheduling=overlap)  # fmt: skip
            with monkeypatch.context() as patch:
                watch = Watch(llm.engine, patch)
                out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            launches[overlap] = sum(kind == "launch" for kind, _ in watch.events)
            assert launches[overlap] == len(out.token_ids) + (extra if overlap else 0)
        assert launches[True] == launches[False] + extra


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_step_is_launched_before_this_one_is_read(tiny_qwen3_tied_dir, monkeypatch,
                                                          overlap):  # fmt: skip
    """With overlap, the host reads step N's tokens only after launching step N+1, so preparing
    and launching N+1 never waits for the device; without it, every step is read at once."""
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu", async_scheduling=overlap)
    with monkeypatch.context() as patch:
        watch = Watch(llm.engine, patch)
        llm.generate(PROMPTS[:4], greedy(max_tokens=8), use_tqdm=False)
    launched = [i for kind, i in watch.events if kind == "launch"]
    reads = [i for kind, i in watch.events if kind == "read"]
    assert len(launched) == 8 and sorted(reads) == sorted(launched)  # each step read once
    position = {event: n for n, event in enumerate(watch.events)}
    for step, after in zip(launched[:-1], launched[1:], strict=True):
        launch_after, read = position[("launch", after)], position[("read", step)]
        assert (launch_after < read) == overlap


def test_async_scheduling_is_a_bool_or_none_and_off_on_cpu_by_default(tiny_qwen3_tied_dir):
    with pytest.raises(TypeError, match="async_scheduling"):
        EngineConfig(async_scheduling=1)
    assert EngineConfig().async_scheduling is None
    assert EngineConfig().for_device("cuda").async_scheduling is True
    assert EngineConfig(async_scheduling=True).for_device("cpu").async_scheduling is True
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu")
    assert llm.engine.config.async_scheduling is False


@pytest.mark.parametrize("overlap", [False, True])
def test_a_seeded_request_draws_its_ith_token_with_counter_i(tiny_qwen3_tied_dir, monkeypatch,
                                                             stop_tokens, overlap):  # fmt: skip
    """A seeded row's noise is keyed by its seed and counted by the index of the token it draws
    (sampling.py): counters 0, 1, 2, ... one per token, with overlap's placeholders counted and
    after a preemption too (plus one for the extra draw after a stop seen one step late). So its
    tokens are the same whether it was preempted or not, recomputed or swapped."""
    from phase7_optim import model_runner

    params = workload(stop_tokens)
    seeded_requests = [i for i, p in enumerate(params) if p.seed is not None]
    tokens, build = {}, model_runner.SamplingBatch.build
    for config, kwargs in CONFIGS.items():
        counters = {i: [] for i in seeded_requests}

        def recording_build(batch_params, draws, *args, counters=counters):
            for p, d in zip(batch_params, draws, strict=True):
                for i in seeded_requests:
                    counters[i] += [d] if p is params[i] else []
            return build(batch_params, draws, *args)

        monkeypatch.setattr(model_runner.SamplingBatch, "build", recording_build)
        done, _, preempted, _ = run(tiny_qwen3_tied_dir, monkeypatch, params, overlap, **kwargs)
        monkeypatch.undo()
        assert (preempted > 0) == (config != "roomy")
        for i in seeded_requests:
            n, late = len(done[i][0]), overlap and done[i][1] == "stop"
            assert counters[i] == list(range(n + late)), (config, i)
        tokens[config] = [done[i][0] for i in seeded_requests]
    assert tokens["recompute"] == tokens["swap"] == tokens["roomy"]
