"""Phase 4 scheduler and block manager as a state machine: the real engine, a fake forward pass.

`FakeRunner` is the real `ModelRunner` (its `prepare` builds the slot mapping) with the model
replaced: each step it writes every new token's id and position into the real KV cache tensors
as its "key" and "value", then reads back each scheduled sequence's whole context through the block
manager and checks that it holds exactly that sequence's tokens, in order. So a region handed to
two sequences, a region moved without its keys/values (`KVCache.move`), or a recompute that skips a
token all fail here. It "samples" a fixed token, so no forward pass runs and hypothesis can explore
thousands of steps with random arrivals, lengths, budgets, KV capacities and aborts.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phase4_scheduler import EngineConfig, LLMEngine, ModelConfig, SamplingParams, TinyTransformer
from phase4_scheduler.model_runner import ModelRunner
from phase4_scheduler.sequence import FinishReason, Sequence, SequenceStatus
from phase4_scheduler.trace import StepTrace

FAKE_TOKEN = 7  # what the fake model always "samples"
TINY = ModelConfig(
    vocab_size=64, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
    intermediate_size=8, max_position_embeddings=512,
)  # fmt: skip


class FakeRunner(ModelRunner):
    """ModelRunner whose forward pass writes (token id, position) as each slot's key/value."""

    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        input_ids, positions, batch = self.prepare(scheduled)
        self.kv_cache.store(0, self._as_kv(input_ids), self._as_kv(positions), batch.slot_mapping)
        for seq, num_new in scheduled:
            end = seq.num_computed_tokens + num_new
            slots = torch.tensor([self.context_slot(seq, p) for p in range(end)])
            held_tokens = self.kv_cache.k[0][slots, 0, 0].long().tolist()
            held_positions = self.kv_cache.v[0][slots, 0, 0].long().tolist()
            assert held_tokens == seq.token_ids[:end], f"{seq}: its slots hold other tokens"
            assert held_positions == list(range(end)), f"{seq}: its slots hold other positions"
        self.last_scheduled = list(scheduled)
        return [FAKE_TOKEN if s.num_computed_tokens + n == s.num_tokens else None
                for s, n in scheduled]  # fmt: skip

    def _as_kv(self, values: torch.Tensor) -> torch.Tensor:
        k = self.kv_cache.k[0]
        return values.to(k.dtype)[:, None, None].expand(-1, *k.shape[1:])

    def context_slot(self, seq: Sequence, position: int) -> int:
        return self.block_manager.regions[seq.seq_id].start + position


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return TinyTransformer(TINY).eval()


def max_len(seq: Sequence) -> int:
    return seq.num_prompt_tokens + seq.params.max_tokens


class Harness:
    """The real engine with a fake runner; checks the scheduler's promises on every step."""

    def __init__(self, model, config: EngineConfig):
        self.config = config
        self.trace = StepTrace()
        self.engine = LLMEngine(model, config, trace=self.trace)
        self.engine.runner = FakeRunner(model, config, self.engine.block_manager)
        self.seqs: list[Sequence] = []

    @property
    def scheduler(self):
        return self.engine.scheduler

    def add(self, prompt_len: int, max_tokens: int) -> Sequence:
        prompt = [(len(self.seqs) + i) % TINY.vocab_size for i in range(prompt_len)]
        request_id = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        self.seqs.append(self.engine.requests[request_id][0])
        return self.seqs[-1]

    def abort(self, seq: Sequence) -> None:
        self.engine.abort_request(seq.request_id)
        self.scheduler.check_invariants()

    def step(self):
        running_before = list(self.scheduler.running)
        waiting_before = list(self.scheduler.waiting)
        remaining = {id(s): s.num_tokens - s.num_computed_tokens for s in self.scheduler.running}
        remaining |= {id(s): s.num_tokens for s in waiting_before}
        self.engine.runner.last_scheduled = []
        self.engine.step()
        self.scheduler.check_invariants()
        record = self.trace.steps[-1]
        self.check_step(record, running_before, waiting_before, remaining)
        return record

    def check_step(self, record, running_before, waiting_before, remaining) -> None:
        config, scheduler = self.config, self.scheduler
        scheduled = self.engine.runner.last_scheduled
        if running_before or waiting_before:
            assert scheduled, "a step ran nothing"
        assert sum(n for _, n in scheduled) <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        assert len({id(s) for s, _ in scheduled}) == len(scheduled), "scheduled twice"
        for seq, num_new in scheduled:
            assert 1 <= num_new <= remaining[id(seq)]
            if not config.enable_chunked_prefill:
                assert num_new == remaining[id(seq)], "a prompt was chunked"
        # LIFO: the victims are the most recently admitted, newest first; they go back to the
        # front of the waiting queue with nothing computed, and nobody is admitted that step.
        k = len(record.preempted)
        if k:
            assert record.preempted == [s.seq_id for s in running_before[::-1][:k]]
            assert [s.seq_id for s in list(scheduler.waiting)[:k]] == record.preempted[::-1]
            assert all(s.num_computed_tokens == 0 for s in list(scheduler.waiting)[:k])
            assert not record.admitted, "admitted someone while memory was short"
            assert k < len(running_before), "the oldest sequence preempted itself"
        # First come, first served: admissions are a prefix of the waiting queue.
        assert record.admitted == [s.seq_id for s in waiting_before[: len(record.admitted)]]
        # Decodes first: every running sequence with one token left gets it whenever the budget
        # covers all of them, unless it was preempted.
        decoding = [s for s in running_before if remaining[id(s)] == 1]
        if len(decoding) <= config.max_num_batched_tokens:
            ran = {id(seq): n for seq, n in scheduled}
            for seq in decoding:
                assert seq.seq_id in record.preempted or ran.get(id(seq)) == 1, f"{seq} stalled"

    def drain(self) -> None:
        for _ in range(steps_bound(self.seqs)):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not done after {steps_bound(self.seqs)} steps")


def steps_bound(seqs: list[Sequence]) -> int:
    """Liveness bound: the oldest running sequence always runs (alone, it always finds room), so
    requests finish one after another at worst, each recomputed at most once per try."""
    return sum(2 * (max_len(s) + 2) for s in seqs) + 1


def test_continuous_batching_admits_as_soon_as_one_finishes(tiny_model):
    h = Harness(tiny_model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    short, long, late = h.add(4, 2), h.add(4, 10), h.add(4, 3)
    h.step()  # both prefill, sample their first token
    assert h.scheduler.running == [short, long] and list(h.scheduler.waiting) == [late]
    h.step()  # short's second token: done
    assert short.is_finished and short.finish_reason == FinishReason.LENGTH
    h.step()  # late joins while long keeps decoding: no waiting for the whole batch
    assert h.engine.runner.last_scheduled == [(long, 1), (late, 4)]


def test_chunked_prefill_shares_steps_with_decodes(tiny_model):
    h = Harness(tiny_model, EngineConfig(max_num_batched_tokens=8))
    decoder = h.add(3, 20)
    h.step()
    long = h.add(30, 1)
    chunks = []
    while not long.is_finished:
        h.step()
        scheduled = h.engine.runner.last_scheduled
        assert scheduled[0] == (decoder, 1), "the running decode was stalled"
        chunks += [n for seq, n in scheduled if seq is long]
    assert chunks == [7, 7, 7, 7, 2]  # 30 prompt tokens in budget-sized chunks, 1 left per step


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole(tiny_model):
    h = Harness(tiny_model, EngineConfig(max_num_batched_tokens=10, enable_chunked_prefill=False))
    decoders = [h.add(2, 8) for _ in range(2)]
    h.step()
    prompt = h.add(9, 1)
    h.step()  # 2 decodes + 9 prompt tokens > 10: the prompt waits
    assert [n for _, n in h.engine.runner.last_scheduled] == [1, 1]
    assert prompt.status == SequenceStatus.WAITING
    h.abort(decoders[1])
    h.step()
    assert h.engine.runner.last_scheduled == [(decoders[0], 1), (prompt, 9)]


def test_max_num_seqs_caps_the_running_set(tiny_model):
    h = Harness(tiny_model, EngineConfig(max_num_seqs=3))
    seqs = [h.add(2, 4) for _ in range(5)]
    h.step()
    assert h.scheduler.running == seqs[:3]
    h.drain()
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)


def test_preemption_frees_an_older_sequences_room_newest_first(tiny_model):
    # Regression: the victim was still in the loop's snapshot of `running` and got scheduled
    # after its region was freed.
    h = Harness(tiny_model, EngineConfig(num_kv_slots=23))
    first = h.add(2, 8)  # reserves its whole max length: slots [0, 10)
    middle = h.add(4, 10)  # no gap holds its max length (14): 4 slots mid-gap, [14, 18)
    newest = h.add(1, 6)  # 1 slot mid-gap: [20, 21)
    h.step()
    regions = h.engine.block_manager.regions
    assert [(regions[s.seq_id].start, regions[s.seq_id].capacity) for s in h.seqs] == [
        (0, 10), (14, 4), (20, 1),
    ]  # fmt: skip
    for _ in range(4):  # middle outgrows its room twice and moves left (realloc), next to first
        assert not h.step().preempted
    assert regions[middle.seq_id].start == 10 and regions[newest.seq_id].start == 18
    record = h.step()  # middle must grow to 9 slots: no gap that large, so newest (LIFO) goes
    assert record.preempted == [newest.seq_id] and list(h.scheduler.waiting) == [newest]
    assert newest.num_computed_tokens == 0 and newest.num_output_tokens == 5
    assert [seq for seq, _ in h.engine.runner.last_scheduled] == [first, middle]
    assert (regions[middle.seq_id].start, regions[middle.seq_id].used) == (10, 9)  # newest's slots
    h.drain()
    assert newest.num_output_tokens == 6  # recomputed, not restarted: its tokens are kept


def test_a_lone_sequence_walled_in_moves_instead_of_preempting_itself(tiny_model):
    """Its region sits at the pool's end with free slots only before it: the region moves (its
    keys/values are copied, FakeRunner checks them) and it keeps its work."""
    h = Harness(tiny_model, EngineConfig(num_kv_slots=16))
    first = h.add(3, 9)  # max length 12: slots [0, 12)
    h.step()
    lone = h.add(2, 10)  # only 4 slots left: what it needs now, mid-gap: [13, 15)
    h.step()
    assert h.engine.block_manager.regions[lone.seq_id].start == 13
    h.abort(first)  # lone is alone; after one more token it is walled in by the pool's end
    for _ in range(3):
        record = h.step()
        assert not record.preempted, "a lone sequence preempted itself"
    assert h.engine.block_manager.regions[lone.seq_id].start == 0  # moved to where there is room
    h.drain()
    assert lone.num_output_tokens == 10 and lone.finish_reason == FinishReason.LENGTH


def test_admission_keeps_a_watermark_for_the_next_decode_step(tiny_model):
    """Admitting into the last free slot would make the next decode step evict the newcomer."""
    h = Harness(tiny_model, EngineConfig(num_kv_slots=9))
    first = h.add(2, 6)  # its whole max length: [0, 8)
    second = h.add(1, 6)  # would fit in [8, 9), but then could not grow by one token
    h.step()
    assert second.status == SequenceStatus.WAITING, "admitted into the watermark"
    h.drain()
    assert sum(len(r.preempted) for r in h.trace.steps) == 0
    assert first.num_output_tokens == 6 and second.num_output_tokens == 6


def test_abort_frees_the_region_and_the_others_finish(tiny_model):
    h = Harness(tiny_model, EngineConfig(num_kv_slots=40))
    seqs = [h.add(5, 8) for _ in range(4)]
    h.step()
    victim = h.scheduler.running[1]
    h.abort(victim)
    assert victim.seq_id not in h.engine.block_manager.regions
    assert victim.finish_reason == FinishReason.ABORT
    h.drain()
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs if s is not victim)


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps under a random config; invariants after every step."""

    model = None  # set by the test function below (module-scoped fixture)

    @initialize(
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        num_kv_slots=st.integers(4, 48),
        chunked=st.booleans(),
    )
    def setup(self, max_num_seqs, budget, num_kv_slots, chunked):
        config = EngineConfig(max_num_seqs, budget, num_kv_slots, enable_chunked_prefill=chunked)
        self.h = Harness(self.model, config)

    @rule(prompt_len=st.integers(1, 24), max_tokens=st.integers(1, 16))
    def arrive(self, prompt_len, max_tokens):
        config = self.h.config
        length = prompt_len + max_tokens
        if length > config.num_kv_slots or (
            not config.enable_chunked_prefill and length > config.max_num_batched_tokens
        ):
            with pytest.raises(ValueError):  # could never run alone: rejected up front
                self.h.add(prompt_len, max_tokens)
            return
        self.h.add(prompt_len, max_tokens)

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self.h.step()

    @precondition(lambda self: self.h.scheduler.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        alive = [s for s in self.h.seqs if not s.is_finished]
        self.h.abort(data.draw(st.sampled_from(alive)))

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "h"):
            self.h.scheduler.check_invariants()

    def teardown(self):
        # Liveness: whatever was admitted finishes, each with exactly max_tokens outputs.
        if not hasattr(self, "h"):
            return
        self.h.drain()
        for seq in self.h.seqs:
            assert seq.is_finished
            if seq.finish_reason == FinishReason.LENGTH:
                assert seq.num_output_tokens == seq.params.max_tokens
        assert not self.h.engine.block_manager.regions and not self.h.engine.requests


def test_scheduler_state_machine(tiny_model):
    machine = type("Machine", (SchedulerMachine,), {"model": tiny_model})
    test = machine.TestCase
    test.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
    test("runTest").runTest()
