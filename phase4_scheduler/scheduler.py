"""Scheduler: which sequences run this step, and with how many tokens each.

Problem: static batching (phase 3) keeps finished rows in the batch and makes new requests wait
for the whole batch; a long prompt's prefill stalls everyone's decoding; and if the KV cache runs
out, something must give.
Idea (vLLM v1): there is no prefill or decode phase, only each sequence's `num_computed_tokens`
catching up to its `num_tokens`. Every step has a token budget (`max_num_batched_tokens`):
1. running sequences first, in admission order: each gets what it still needs (1 token when
   decoding), so decodes are never stalled behind a new prompt;
2. then waiting sequences are admitted while the budget, `max_num_seqs` and the KV cache allow.
With chunked prefill a prompt larger than the remaining budget takes what is left (a chunk) and
continues next step; without it, a prompt waits until it fits whole.
When a running sequence cannot get KV room, the most recently admitted sequence is preempted
(LIFO, like an OOM killer picking the newest process): its cache is freed and it goes back to the
front of the waiting queue, to be recomputed from scratch. A sequence alone in the pool always
finds room (the block manager moves its region if it must), so it never preempts itself.
Admission keeps a watermark: a newcomer is admitted only if there is room for all its tokens (not
just this step's chunk) and, besides, one slot per running sequence (the newcomer included), so the
next steps do not have to evict what this step took in. (vLLM keeps 1% of the cache free; one slot
per sequence is what our small pools need.) After a preemption nobody is admitted in the same step:
memory is short.

Invariants (check_invariants): every running sequence has a KV region and no other sequence has
one; running <= max_num_seqs; waiting sequences have num_computed_tokens == 0.
"""

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, RegionMove
from .config import EngineConfig
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    kv_moves: list[RegionMove] = field(default_factory=list)  # to copy, in order, before the step

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # memory is tight when someone was just preempted: admit nobody
            self._admit_waiting(out, budget)
        return out

    # exercise 4.1: the token budget and chunked prefill
    def _num_new_tokens(self, remaining: int, budget: int) -> int:
        """How many of a sequence's `remaining` uncomputed tokens run this step."""
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    # exercise 4.2: running sequences first, LIFO preemption
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            num_new = self._num_new_tokens(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                continue
            while not self.block_manager.can_append_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget  # everyone admitted after `seq` is already gone too
            move = self.block_manager.append_slots(seq, num_new)
            if move is not None:
                out.kv_moves.append(move)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._num_new_tokens(seq.num_tokens, budget)
            # One slot per running sequence and one for the newcomer; none if it will run alone:
            # it then has the whole pool, and a request that fits the pool must always get in.
            watermark = len(self.running) + 1 if self.running else 0
            # Room for all its tokens, not just this step's chunk: admitted for a first chunk only,
            # it would be evicted by its own next chunk, again and again.
            if num_new == 0 or not self.block_manager.can_allocate(seq.num_tokens, watermark):
                return  # first come, first served: nobody overtakes the head of the queue
            self.block_manager.allocate(seq, num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            out.admitted.append(seq)
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0  # recompute: its keys/values are gone
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Takes a sequence out of the engine (stopped, length reached or aborted)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        assert set(self.block_manager.regions) == {s.seq_id for s in self.running}
        assert len(self.running) <= self.config.max_num_seqs
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING
            assert 0 <= seq.num_computed_tokens <= seq.num_tokens
            assert self.block_manager.regions[seq.seq_id].used >= seq.num_computed_tokens
        for seq in self.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
