"""Phase 4 scheduler as a state machine, driven by a fake model (no forward pass, CPU only).

`FakeEngine` does exactly what `LLMEngine.step` does around the model: advance each scheduled
sequence's `num_computed_tokens` by its `num_new_tokens`, append a token when it has caught up, and
retire it at max_tokens. That is all the scheduler may rely on, so every test here runs in
microseconds per step and hypothesis can explore thousands of steps with random arrivals, prompt
lengths, budgets, KV capacities and aborts, checking the invariants after every step.
"""

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phase4_scheduler.config import EngineConfig
from phase4_scheduler.kv_cache import SlotAllocator
from phase4_scheduler.sampling import SamplingParams
from phase4_scheduler.scheduler import Scheduler, SchedulerOutput
from phase4_scheduler.sequence import FinishReason, Sequence, SequenceStatus

FAKE_TOKEN = 7  # what the fake model always "samples"


class FakeEngine:
    """LLMEngine.step without the model; checks the scheduler's promises on every step."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.allocator = SlotAllocator(config.num_kv_slots)
        self.scheduler = Scheduler(config, self.allocator)
        self.ids = itertools.count()
        self.finished: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0

    def add(self, prompt_len: int, max_tokens: int) -> Sequence:
        seq_id = next(self.ids)
        seq = Sequence(seq_id, str(seq_id), [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.scheduler.check_invariants()

    def step(self) -> SchedulerOutput:
        running_before = list(self.scheduler.running)
        waiting_before = list(self.scheduler.waiting)
        out = self.scheduler.schedule()
        self.check_step(out, running_before, waiting_before)
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
            assert self.allocator.regions[seq.seq_id].used == seq.num_computed_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(FAKE_TOKEN)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.scheduler.finish(seq, FinishReason.LENGTH)
                    self.finished.append(seq)
        self.scheduler.check_invariants()
        self.num_steps += 1
        self.num_preemptions += len(out.preempted)
        return out

    def check_step(self, out: SchedulerOutput, running_before, waiting_before) -> None:
        config, scheduler = self.config, self.scheduler
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        seqs = [seq for seq, _ in out.scheduled]
        assert len(set(map(id, seqs))) == len(seqs), "a sequence was scheduled twice"
        for seq, num_new in out.scheduled:
            assert 1 <= num_new <= seq.num_tokens - seq.num_computed_tokens
            assert seq.status == SequenceStatus.RUNNING
            if not config.enable_chunked_prefill:
                assert num_new == seq.num_tokens - seq.num_computed_tokens, "prompt was chunked"
        # LIFO: the victims are the most recently admitted, newest first, and they go back to the
        # front of the waiting queue (oldest victim first) with nothing computed.
        k = len(out.preempted)
        if k:
            assert out.preempted == running_before[::-1][:k]
            assert list(scheduler.waiting)[:k] == out.preempted[::-1]
            assert all(s.num_computed_tokens == 0 for s in out.preempted)
            assert not out.admitted, "admitted someone while memory was short"
        # First come, first served: admissions are a prefix of the waiting queue.
        assert out.admitted == waiting_before[: len(out.admitted)]
        # Decodes first: every running sequence that has caught up gets its one token whenever
        # the budget covers all of them, unless it was preempted.
        decoding = [s for s in running_before if s.num_computed_tokens == s.num_tokens - 1]
        if len(decoding) <= config.max_num_batched_tokens:
            scheduled = {id(seq): n for seq, n in out.scheduled}
            for seq in decoding:
                assert seq in out.preempted or scheduled.get(id(seq)) == 1, f"{seq} stalled"

    def drain(self, max_steps: int) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.scheduler.running}")


def steps_bound(seqs: list[Sequence]) -> int:
    """Liveness bound: the oldest sequence is never a victim unless it is alone, and then it gets
    the whole pool back on the next step, so each request needs at most two tries in turn."""
    return sum(2 * (s.max_len + 2) for s in seqs) + 1


def test_continuous_batching_admits_as_soon_as_one_finishes():
    engine = FakeEngine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    short, long, late = engine.add(4, 2), engine.add(4, 10), engine.add(4, 3)
    engine.step()  # both prefill, sample their first token
    assert engine.scheduler.running == [short, long] and list(engine.scheduler.waiting) == [late]
    engine.step()  # short's second token: done
    assert short.is_finished and short.finish_reason == FinishReason.LENGTH
    out = engine.step()  # late joins while long keeps decoding: no waiting for the whole batch
    assert out.scheduled == [(long, 1), (late, 4)] and out.admitted == [late]


def test_chunked_prefill_shares_steps_with_decodes():
    engine = FakeEngine(EngineConfig(max_num_batched_tokens=8))
    decoder = engine.add(3, 20)
    engine.step()
    long = engine.add(30, 1)
    chunks = []
    while not long.is_finished:
        out = engine.step()
        assert out.scheduled[0] == (decoder, 1), "the running decode was stalled"
        chunks += [n for seq, n in out.scheduled if seq is long]
    assert chunks == [7, 7, 7, 7, 2]  # 30 prompt tokens in budget-sized chunks, 1 left per step


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    engine = FakeEngine(EngineConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))
    decoders = [engine.add(2, 10) for _ in range(2)]
    engine.step()
    prompt = engine.add(7, 1)
    out = engine.step()  # 2 decodes + 7 prompt tokens > 8: the prompt waits
    assert [n for _, n in out.scheduled] == [1, 1] and prompt.status == SequenceStatus.WAITING
    engine.abort(decoders[1])
    out = engine.step()
    assert out.scheduled == [(decoders[0], 1), (prompt, 7)]


def test_max_num_seqs_caps_the_running_set():
    engine = FakeEngine(EngineConfig(max_num_seqs=3))
    seqs = [engine.add(2, 4) for _ in range(5)]
    engine.step()
    assert engine.scheduler.running == seqs[:3]
    engine.drain(steps_bound(seqs))
    assert len(engine.finished) == 5


def test_preemption_frees_an_older_sequences_room_newest_first():
    # Regression: the victim was still in the loop's snapshot of `running` and got scheduled
    # after its region was freed (KeyError in can_append).
    engine = FakeEngine(EngineConfig(num_kv_slots=12))
    first = engine.add(2, 8)  # reserves its whole max length: slots [0, 10)
    middle, newest = engine.add(1, 6), engine.add(1, 6)  # only 1 slot each: [10, 11), [11, 12)
    engine.step()
    assert [engine.allocator.regions[s.seq_id].capacity for s in (first, middle, newest)] == [
        10, 1, 1,
    ]  # fmt: skip
    out = engine.step()  # middle must grow into newest's slot: newest (LIFO) is the victim
    assert out.preempted == [newest] and list(engine.scheduler.waiting) == [newest]
    assert newest.num_computed_tokens == 0 and newest.num_output_tokens == 1
    assert [seq for seq, _ in out.scheduled] == [first, middle]
    engine.drain(steps_bound([first, middle, newest]))
    assert newest.num_output_tokens == 6  # recomputed, not restarted: its first token is kept


def test_abort_frees_the_region_and_the_others_finish():
    engine = FakeEngine(EngineConfig(num_kv_slots=40))
    seqs = [engine.add(5, 8) for _ in range(4)]
    engine.step()
    victim = engine.scheduler.running[1]
    engine.abort(victim)
    assert victim.seq_id not in engine.allocator.regions
    assert victim.finish_reason == FinishReason.ABORT
    engine.drain(steps_bound(seqs))
    assert sorted(s.seq_id for s in engine.finished) == [s.seq_id for s in seqs if s is not victim]


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps under a random config; invariants after every step."""

    @initialize(
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        num_kv_slots=st.integers(4, 48),
        chunked=st.booleans(),
    )
    def setup(self, max_num_seqs, budget, num_kv_slots, chunked):
        config = EngineConfig(max_num_seqs, budget, num_kv_slots, enable_chunked_prefill=chunked)
        self.engine = FakeEngine(config)
        self.seqs: list[Sequence] = []

    @rule(prompt_len=st.integers(1, 24), max_tokens=st.integers(1, 16))
    def arrive(self, prompt_len, max_tokens):
        config = self.engine.config
        max_len = prompt_len + max_tokens
        # The engine rejects what could never run alone (LLMEngine.add_request).
        if max_len > config.num_kv_slots:
            return
        if not config.enable_chunked_prefill and max_len > config.max_num_batched_tokens:
            return
        self.seqs.append(self.engine.add(prompt_len, max_tokens))

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()

    @precondition(lambda self: self.engine.scheduler.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        alive = [s for s in self.seqs if not s.is_finished]
        self.engine.abort(data.draw(st.sampled_from(alive)))

    @invariant()
    def invariants_hold(self):
        self.engine.scheduler.check_invariants()

    def teardown(self):
        # Liveness: whatever was admitted finishes, each with exactly max_tokens outputs.
        self.engine.drain(steps_bound(self.seqs))
        for seq in self.seqs:
            assert seq.is_finished
            if seq.finish_reason == FinishReason.LENGTH:
                assert seq.num_output_tokens == seq.params.max_tokens
        assert not self.engine.allocator.regions


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_scheduler_state_machine = SchedulerMachine.TestCase
