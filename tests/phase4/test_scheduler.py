"""Phase 4 scheduler and block manager as a state machine: the real engine, a fake forward pass.

`tests/engine_harness.py` runs the real `LLMEngine` with the model replaced by a runner that
writes each token's id and position as its key/value and checks, every step, that each scheduled
sequence's region holds exactly its own tokens (so a region moved without its keys/values, or
memory handed to two sequences, fails); `Harness` checks the scheduler's promises every step.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import phase4_scheduler
from phase4_scheduler import EngineConfig, ModelConfig, TinyTransformer
from phase4_scheduler.model_runner import ModelRunner
from phase4_scheduler.sequence import FinishReason, Sequence, SequenceStatus
from tests.engine_harness import TINY_MODEL, FakeRunnerMixin
from tests.engine_harness import Harness as BaseHarness


class FakeRunner(FakeRunnerMixin, ModelRunner):
    def context_slot(self, seq: Sequence, position: int) -> int:
        return self.block_manager.regions[seq.seq_id].start + position


class Harness(BaseHarness):
    def __init__(self, model, config: EngineConfig):
        super().__init__(phase4_scheduler, FakeRunner, model, config)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig(**TINY_MODEL)).eval()


@pytest.mark.parametrize(
    "chunked, remaining, budget, expected",
    [
        (True, 30, 8, 8),  # a prompt chunk as large as the budget
        (True, 5, 8, 5),  # the rest of the prompt fits
        (True, 1, 8, 1),  # a decode
        (True, 4, 0, 0),  # no budget left
        (False, 5, 8, 5),  # without chunking: all of it when it fits
        (False, 9, 8, 0),  # ... or nothing
        (False, 8, 8, 8),
    ],
)
def test_num_new_tokens_spends_the_budget(tiny_model, chunked, remaining, budget, expected):
    """The rule alone: how many of a sequence's uncomputed tokens one step runs."""
    h = Harness(tiny_model, EngineConfig(enable_chunked_prefill=chunked))
    assert h.scheduler._num_new_tokens(remaining, budget) == expected


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


def test_a_chunked_prompt_is_admitted_only_when_all_of_it_fits(tiny_model):
    """Admitted for a first chunk that fits, a prompt that cannot fit whole beside the running
    sequence would be evicted by its own later chunk, readmitted, evicted again: thrashing."""
    h = Harness(tiny_model, EngineConfig(num_kv_slots=40, max_num_batched_tokens=8))
    first = h.add(4, 16)  # its whole max length: [0, 20)
    long = h.add(28, 1)  # 20 + 28 > 40, yet a first chunk of 7 tokens would fit
    h.step()
    while not first.is_finished:
        h.step()
        assert long.status == SequenceStatus.WAITING
    h.drain()
    assert sum(len(r.preempted) for r in h.trace.steps) == 0


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
