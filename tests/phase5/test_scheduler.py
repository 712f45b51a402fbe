"""Phase 5 scheduler, block manager and prefix cache as a state machine: the real engine, a fake
forward pass.

`tests/engine_harness.py` runs the real `LLMEngine` with the model replaced by a runner that
writes each token's id and position as its key/value and checks, every step, that each scheduled
sequence's block table reaches exactly its own tokens: a prefix-cache hit on another prompt's
blocks, a block freed while still shared, or a recompute that skips a token all fail.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import phase5_paged
from phase5_paged import EngineConfig, ModelConfig, TinyTransformer
from phase5_paged.config import PreemptionMode
from phase5_paged.model_runner import ModelRunner
from phase5_paged.sequence import FinishReason, Sequence, SequenceStatus
from tests.engine_harness import TINY_MODEL, FakeRunnerMixin
from tests.engine_harness import Harness as BaseHarness

SYSTEM_PROMPTS = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5,) * 11]


class FakeRunner(FakeRunnerMixin, ModelRunner):
    def context_slot(self, seq: Sequence, position: int) -> int:
        return self.block_manager.slot(seq.seq_id, position)


class Harness(BaseHarness):
    def __init__(self, model, config: EngineConfig):
        super().__init__(phase5_paged, FakeRunner, model, config)

    def check_victims(self, victims: list[Sequence]) -> None:
        """Swap mode: a victim waits in `swapped` (oldest first) with its computed tokens, unless
        the CPU pool was full; then, as in recompute mode, it waits with nothing computed."""
        if self.config.preemption_mode == PreemptionMode.RECOMPUTE:
            return super().check_victims(victims)
        swapped = [s for s in victims if s.status == SequenceStatus.SWAPPED]
        assert list(self.scheduler.swapped)[: len(swapped)] == swapped[::-1]
        recomputed = [s for s in victims if s.status == SequenceStatus.WAITING]
        assert list(self.scheduler.waiting)[: len(recomputed)] == recomputed[::-1]
        assert all(s.num_computed_tokens == 0 for s in recomputed)
        assert len(swapped) + len(recomputed) == len(victims)

    def check_step(self, record, *args) -> None:
        super().check_step(record, *args)
        if self.scheduler.swapped:  # swapped-out sequences came first: they go back in first
            assert not record.admitted, "admitted a newcomer while an older one waits swapped"


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig(**TINY_MODEL)).eval()


def test_a_cached_prefix_is_not_recomputed(tiny_model):
    h = Harness(tiny_model, EngineConfig(num_kv_blocks=16, block_size=4))
    system = list(range(10, 18))  # two full blocks
    first = h.add(system + [1, 2], 3)
    h.drain()
    second = h.add(system + [3], 3)
    h.step()
    assert h.engine.runner.last_scheduled == [(second, 1)]  # only the token after the prefix
    assert h.engine.block_manager.num_hit_tokens == 8
    h.drain()
    assert first.num_output_tokens == second.num_output_tokens == 3


def test_admission_keeps_a_watermark_for_the_next_decode_step(tiny_model):
    """Admitting into the last free block would make the next decode step evict the newcomer."""
    h = Harness(
        tiny_model, EngineConfig(num_kv_blocks=4, block_size=2, enable_prefix_caching=False)
    )
    first = h.add(2, 5)  # 1 block now, 4 at the end
    second = h.add(3, 2)  # 2 blocks + the watermark of 2 > the 3 left
    h.step()
    assert second.status == SequenceStatus.WAITING, "admitted into the watermark"
    h.drain()
    assert sum(len(r.preempted) for r in h.trace.steps) == 0
    assert first.num_output_tokens == 5 and second.num_output_tokens == 2


def test_a_chunked_prompt_is_admitted_only_when_all_of_it_fits(tiny_model):
    """Admitted for a first chunk that fits, a prompt that cannot fit whole beside the running
    sequence would be evicted by its own later chunk, readmitted, evicted again: thrashing."""
    config = EngineConfig(num_kv_blocks=9, block_size=4, max_num_batched_tokens=8)
    h = Harness(tiny_model, config)
    first = h.add(4, 16)  # 1 block now, 5 at the end
    long = h.add(28, 1)  # 7 blocks + the watermark of 2 > the 8 left; a 4-token chunk would fit
    h.step()
    while not first.is_finished:
        h.step()
        assert long.status == SequenceStatus.WAITING
    h.drain()
    assert sum(len(r.preempted) for r in h.trace.steps) == 0


def test_a_lone_request_that_fills_the_pool_is_admitted(tiny_model):
    """The watermark never keeps out a request that fits the pool alone (liveness)."""
    h = Harness(tiny_model, EngineConfig(num_kv_blocks=2, block_size=4))
    seq = h.add(7, 1)  # 2 blocks of prompt: a watermark block would never be free
    h.drain()
    assert seq.num_output_tokens == 1


def test_swap_keeps_a_victims_computed_tokens_and_brings_them_back(tiny_model):
    """FakeRunner checks that the swapped-in blocks hold the victim's own keys/values."""
    config = EngineConfig(
        num_kv_blocks=7, block_size=2, enable_prefix_caching=False,
        preemption_mode="swap", num_cpu_kv_blocks=8,
    )  # fmt: skip
    h = Harness(tiny_model, config)
    # `later` would fit while `newest` is swapped out, but must wait for it to come back.
    older, newest, later = h.add(3, 8), h.add(3, 8), h.add(1, 2)
    while not h.scheduler.swapped:
        assert not h.step().preempted or h.scheduler.swapped
    assert list(h.scheduler.swapped) == [newest] and newest.status == SequenceStatus.SWAPPED
    computed = newest.num_computed_tokens
    assert len(h.engine.block_manager.cpu_block_tables[newest.seq_id]) == -(-computed // 2)
    while newest.status == SequenceStatus.SWAPPED:
        h.step()
    assert newest.num_computed_tokens == computed + 1  # back without recomputing anything
    h.drain()
    assert older.num_output_tokens == newest.num_output_tokens == 8 and later.is_finished


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full(tiny_model):
    config = EngineConfig(
        num_kv_blocks=6, block_size=2, enable_prefix_caching=False,
        preemption_mode="swap", num_cpu_kv_blocks=1,
    )  # fmt: skip
    h = Harness(tiny_model, config)
    h.add(3, 8)
    newest = h.add(3, 8)
    while not any(r.preempted for r in h.trace.steps):
        h.step()
    assert not h.scheduler.swapped and list(h.scheduler.waiting) == [newest]
    h.drain()


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (often sharing a system prompt), aborts and steps under a random config."""

    model = None  # set by the test function below (module-scoped fixture)

    @initialize(
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        num_kv_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 3, 4, 7]),
        chunked=st.booleans(),
        caching=st.booleans(),
        num_cpu_kv_blocks=st.integers(0, 12),  # 0: recompute; too few: some victims recompute
    )
    def setup(self, max_num_seqs, budget, num_kv_blocks, block_size, chunked, caching,
              num_cpu_kv_blocks):  # fmt: skip
        mode = PreemptionMode.SWAP if num_cpu_kv_blocks else PreemptionMode.RECOMPUTE
        config = EngineConfig(
            max_num_seqs, budget, num_kv_blocks, block_size,
            enable_chunked_prefill=chunked, enable_prefix_caching=caching,
            preemption_mode=mode, num_cpu_kv_blocks=num_cpu_kv_blocks,
        )  # fmt: skip
        self.h = Harness(self.model, config)

    @rule(
        system=st.sampled_from(SYSTEM_PROMPTS),
        suffix=st.lists(st.integers(0, 3), max_size=8),
        max_tokens=st.integers(1, 12),
    )
    def arrive(self, system, suffix, max_tokens):
        config, prompt = self.h.config, list(system) + suffix or [0]
        length = len(prompt) + max_tokens
        if length > config.num_kv_slots or (
            not config.enable_chunked_prefill and length > config.max_num_batched_tokens
        ):
            with pytest.raises(ValueError):  # could never run alone: rejected up front
                self.h.add(prompt, max_tokens)
            return
        self.h.add(prompt, max_tokens)

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
        if not hasattr(self, "h"):
            return
        self.h.drain()
        for seq in self.h.seqs:
            assert seq.is_finished
            if seq.finish_reason == FinishReason.LENGTH:
                assert seq.num_output_tokens == seq.params.max_tokens
        bm = self.h.engine.block_manager
        assert not bm.block_tables and bm.num_free_blocks == self.h.config.num_kv_blocks
        assert not bm.cpu_block_tables and len(bm.free_cpu_blocks) == bm.num_cpu_blocks


def test_scheduler_state_machine(tiny_model):
    machine = type("Machine", (SchedulerMachine,), {"model": tiny_model})
    test = machine.TestCase
    test.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
    test("runTest").runTest()
