"""Scheduler: which sequences run this step, and with how many tokens each.

Problem: static batching (phase 3) keeps finished rows in the batch and makes new requests wait
for the whole batch; a long prompt's prefill stalls everyone's decoding; and if the KV cache runs
out, something must give.
Idea (vLLM v1): there is no prefill or decode phase, only each sequence's `num_computed_tokens`
catching up to its `num_tokens`. Every step has a token budget (`max_num_batched_tokens`):
1. running sequences first, in fair order (below): each gets what it still needs (1 token when
   decoding); with one sequence per request that is admission order, so decodes are never
   stalled behind a newer prompt;
2. then waiting sequences are admitted while the budget, `max_num_seqs` and the KV cache allow,
   the least served request's first.
With chunked prefill a prompt larger than the remaining budget takes what is left (a chunk) and
continues next step; without it, a prompt waits until it fits whole.
When a running sequence cannot get KV room, the last sequence in fair order is preempted (the
newest of the request that runs the most; with one sequence per request, the most recently
admitted: LIFO, like an OOM killer picking the newest process): its cache is freed and it goes
back to the front of the waiting queue, to be recomputed from scratch. With
preemption_mode="swap" its blocks are copied to a CPU pool instead, and it waits in `swapped` with
its computed tokens intact, to be copied back before any new sequence is admitted, unless that
one's request is served less (when the CPU pool is full, it is recomputed). A sequence alone in
the pool always finds room, so it never preempts itself.
Admission keeps a watermark: a newcomer is admitted only if there is room for all its tokens (not
just this step's chunk) and, besides, one free block per running sequence (the newcomer included),
so the next steps do not have to evict what this step took in. (vLLM keeps 1% of the cache free; one
block per sequence is what our small pools need.) After a preemption nobody is admitted in the same
step: memory is short.

Fair share across requests (phase 8; a fair-share CPU scheduler divides time between users, not
processes): a server's client asks for n choices of a prompt, and each is a sequence of its own.
First come, first served per sequence let one request of n=16 x 8,000 tokens hold every running
slot, or every KV block, or the front of the queue, until it was done, while another client
waited for its first token. Now the sequences of one request share a `group_id`, a request's
share is the number of its sequences running, and four rules use it:
- `running` is kept in fair order, round robin over requests: every request's first sequence,
  then every request's second, ... (admission order within a round). The budget goes front to
  back and preemption takes from the back, so the request that runs the most yields first (its
  decodes too: a less served request's prompt chunk that takes the whole budget holds back the
  decodes behind it in that order, for the steps of its prefill);
- admission takes the waiting sequence of the least served request (first come among equals);
- when the running cap or the KV cache keeps that sequence out and its request runs at least two
  sequences fewer than the request of the last running sequence, that one gives way (preempted as
  for memory; recomputed, most of it is a prefix cache hit: a freed block stays cached);
- a swapped-out sequence goes back in before a waiting one only if its request is served as
  little (it was admitted first).
With one sequence per request (workload W, offline `generate`) every rule is phase 7's: the order
is admission order, the head of the queue is the least served, nobody is preempted for fairness,
and the swapped-out go first.

Priority (vLLM's `scheduling_policy="priority"`; a request's `priority`, lower first): the same
four rules with the priority in front of the share. `running` is ordered by priority, then
fairly; `waiting` and `swapped` are kept in priority order (a newcomer behind its equals, a
preempted one before them); admission takes the least served of the best priority waiting; and a
waiting sequence kept out by the cap or the cache makes the last running one give way if its
priority is better (as vLLM's did), or equal and its request served two less. So an interactive
request of priority 0 overtakes a batch job of priority 1, and the job's sequences, last in
`running`, are the ones preempted when memory runs out. Under "fcfs" every priority is 0 and
nothing changes.

Since phase 4: KV room is counted in blocks (block_manager.py). On admission the longest cached
prefix of the sequence's tokens is mapped from the prefix cache and counted as computed, so only
the rest is scheduled; a preempted sequence often finds its own old blocks still cached.

Overlap scheduling (engine.py) schedules step N+1 before the host has read step N's tokens. A
token being sampled counts as a placeholder (`num_output_placeholders`): a sequence that sampled
in step N decodes it in step N+1, and one whose last token (max_tokens) is being sampled is not
scheduled again. A stop token is seen one step late, so the stopped sequence may already be in
the step running on the device; it keeps its blocks (`finished_in_flight`) until that step is
done, then `free_finished_in_flight` returns them.

Invariants (check_invariants): every running sequence has a block table, so does every finished
sequence whose last step still runs, and no other sequence has one; running <= max_num_seqs;
`waiting` and `swapped` are in priority order;
waiting sequences have num_computed_tokens == 0; swapped sequences hold CPU blocks for exactly
their computed tokens, and no other sequence holds any; between steps only running sequences
have placeholders, at most one each; `num_running` counts each request's running sequences.
"""

from collections import Counter, deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig, PreemptionMode, SchedulingPolicy
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (GPU block, CPU block) and (CPU block, GPU block) copies to make before the step runs
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # fair order: the last one is preempted first
        self.num_running: Counter[str] = Counter()  # group_id -> its running sequences (> 0)
        self.swapped: deque[Sequence] = deque()  # preempted with their blocks on the CPU
        self.finished_in_flight: list[Sequence] = []  # finished, but a running step writes them
        self.prioritized = config.scheduling_policy == SchedulingPolicy.PRIORITY

    def add(self, seq: Sequence) -> None:
        self._enqueue(self.waiting, seq, front=False)

    def _enqueue(self, queue: deque[Sequence], seq: Sequence, front: bool) -> None:
        """Into `waiting` or `swapped`, kept in priority order (lower first): at the back of its
        priority's sequences, or at their front (a preempted one was admitted before them). All
        priorities are 0 unless the policy is "priority": then the back or the front of all."""
        if not self.prioritized:
            queue.appendleft(seq) if front else queue.append(seq)
            return
        for i, other in enumerate(queue):
            if other.priority > seq.priority or (front and other.priority == seq.priority):
                queue.insert(i, seq)
                return
        queue.append(seq)

    def _key(self, seq: Sequence) -> tuple[int, int]:
        """Who goes first: the better priority, then the request that runs fewer sequences."""
        return seq.priority, self.num_running[seq.group_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._order_fairly()
        self._make_room_for_the_least_served(out)
        num_yielded = len(out.preempted)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if len(out.preempted) == num_yielded:  # memory is tight after a preemption: admit nobody
            budget = self._swap_in(out, budget)
            if not self.swapped or self._swapped_yields():
                self._admit_waiting(out, budget)
        return out

    def _swapped_yields(self) -> bool:
        """Whether the first swapped-out sequence lets a waiting one go first: only one of a
        less served request (the swapped-out ones were admitted before, so among equals they
        go first)."""
        if not self.waiting:
            return False
        return self._key(self._least_served_waiting()) < self._key(self.swapped[0])

    def _order_fairly(self) -> None:
        """Puts `running` in fair order: by priority (all 0 unless the policy is "priority"),
        then round robin over requests, each request's sequences in the order they run now.
        With one sequence per request and no priorities that order is left as it is."""
        if len(self.num_running) == len(self.running) and not self.prioritized:
            return
        seen: Counter[str] = Counter()
        keys = []
        for seq in self.running:
            # how many of its request's sequences come before it: its round
            keys.append((seq.priority, seen[seq.group_id]))
            seen[seq.group_id] += 1
        order = sorted(range(len(self.running)), key=keys.__getitem__)  # stable within a round
        self.running = [self.running[i] for i in order]

    def _least_served_waiting(self) -> Sequence:
        """The first waiting sequence among those of the best priority whose request runs the
        fewest sequences (`waiting` is in priority order: the first is of the best)."""
        best = self.waiting[0]
        best_priority, best_share = self._key(best)
        for seq in self.waiting:
            if best_share == 0 or seq.priority != best_priority:
                break  # nobody is served less, or the rest are of a worse priority
            share = self.num_running[seq.group_id]
            if share < best_share:
                best, best_share = seq, share
        return best

    def _make_room_for_the_least_served(self, out: SchedulerOutput) -> None:
        """Fair share and priority: while the running cap or the KV cache keeps out the sequence
        admission would take, and it is of a better priority than the last running sequence, or
        of the same and its request runs at least two sequences fewer, that one gives way
        (preempted as for memory)."""
        while self.waiting and self.running:
            seq, last = self._least_served_waiting(), self.running[-1]
            if seq.priority > last.priority:
                return  # the last one runs first
            if seq.priority == last.priority and (
                self.num_running[seq.group_id] + 1 >= self.num_running[last.group_id]
            ):
                return  # giving way would not make the shares more even
            if len(self.running) < self.config.max_num_seqs and self._can_admit(seq):
                return
            self._preempt(last, out)
            out.preempted.append(last)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` starts with; none for a request for its prompt's logprobs
        (vLLM's rule: it computes, and so scores, every prompt token)."""
        if seq.params.prompt_logprobs is not None:
            return []
        return self.block_manager.match_prefix(seq)

    def _watermark(self) -> int:
        # One block per running sequence and one for the newcomer; none if it will run alone: it
        # then has the whole pool, and a request that fits the pool must always get in.
        return len(self.running) + 1 if self.running else 0

    def _can_admit(self, seq: Sequence) -> bool:
        """Room in the KV cache for all of a waiting sequence's tokens (see _admit_waiting)."""
        cached = self._cached_prefix(seq)
        return self.block_manager.can_allocate(cached, seq.num_tokens, self._watermark())

    # exercise 4.1: the token budget and chunked prefill
    def _num_new_tokens(self, remaining: int, budget: int) -> int:
        """How many of a sequence's `remaining` uncomputed tokens run this step."""
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            if seq.num_output_tokens + seq.num_output_placeholders >= seq.params.max_tokens:
                continue  # its last token is being sampled: it finishes when the host reads it
            remaining = seq.num_tokens + seq.num_output_placeholders - seq.num_computed_tokens
            num_new = self._num_new_tokens(remaining, budget)
            if num_new == 0:
                continue
            while not self.block_manager.can_append_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is seq:
                    return budget  # everyone after `seq` in fair order is already gone too
            self.block_manager.append_slots(seq, num_new)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self._least_served_waiting()
            cached = self._cached_prefix(seq)
            num_computed = len(cached) * self.block_manager.block_size
            num_new = self._num_new_tokens(seq.num_tokens - num_computed, budget)
            # Room for all its tokens, not just this step's chunk: admitted for a first chunk only,
            # it would be evicted by its own next chunk, again and again.
            if num_new == 0 or not self.block_manager.can_allocate(
                cached, seq.num_tokens, self._watermark()
            ):
                return  # nobody overtakes it: the first come of the least served requests
            seq.num_computed_tokens = num_computed  # the cached prefix counts as computed
            if seq.num_cached_tokens < 0:  # what its usage reports, not a readmission's
                seq.num_cached_tokens = num_computed
            self.block_manager.allocate(seq, cached, num_computed + num_new)
            self.waiting.remove(seq)
            self._start_running(seq)
            out.scheduled.append((seq, num_new))
            out.admitted.append(seq)
            budget -= num_new

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            if self._swapped_yields():
                break
            seq = self.swapped[0]
            num_new = self._num_new_tokens(seq.num_tokens - seq.num_computed_tokens, budget)
            watermark = self._watermark()  # as for admission
            remaining = seq.num_tokens - seq.num_computed_tokens  # all of it, as for admission
            if num_new == 0 or not self.block_manager.can_swap_in(seq, remaining, watermark):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.block_manager.swap_in(seq, num_new)
            self._start_running(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.num_running[seq.group_id] += 1

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.num_running[seq.group_id] -= 1
        if not self.num_running[seq.group_id]:
            del self.num_running[seq.group_id]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._stop_running(seq)
        swap = self.config.preemption_mode == PreemptionMode.SWAP
        if swap and self.block_manager.can_swap_out(seq):
            out.blocks_to_swap_out += self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, seq, front=True)
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0  # recompute: its keys/values are gone
        self._enqueue(self.waiting, seq, front=True)

    def finish(self, seq: Sequence, reason: FinishReason, in_flight: bool = False) -> None:
        """Takes a sequence out of the engine (stopped, length reached or aborted). `in_flight`:
        a step launched on the device still computes it, so it keeps its blocks (the device may
        still write them) until `free_finished_in_flight`, once that step is done."""
        if seq.status == SequenceStatus.RUNNING:
            self._stop_running(seq)
            if in_flight:
                self.finished_in_flight.append(seq)
            else:
                self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def free_finished_in_flight(self) -> None:
        """Frees the blocks of the sequences that finished while a step still computed them:
        called once that step is done."""
        for seq in self.finished_in_flight:
            self.block_manager.free(seq)
        self.finished_in_flight.clear()

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        holders = self.running + self.finished_in_flight
        assert set(self.block_manager.block_tables) == {s.seq_id for s in holders}
        assert len(self.running) <= self.config.max_num_seqs
        assert self.num_running == Counter(seq.group_id for seq in self.running)
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING
            assert seq.num_output_placeholders in (0, 1)
            assert 0 <= seq.num_computed_tokens <= seq.num_tokens + seq.num_output_placeholders
            table = self.block_manager.block_tables[seq.seq_id]
            assert len(table) * self.block_manager.block_size >= seq.num_computed_tokens
        for seq in self.finished_in_flight:
            assert seq.status == SequenceStatus.FINISHED
        for seq in self.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert seq.num_output_placeholders == 0
        for queue in (self.waiting, self.swapped):  # in priority order
            priorities = [seq.priority for seq in queue]
            assert priorities == sorted(priorities)
        assert set(self.block_manager.cpu_block_tables) == {s.seq_id for s in self.swapped}
        for seq in self.swapped:
            assert seq.status == SequenceStatus.SWAPPED and seq.num_output_placeholders == 0
            assert len(self.block_manager.cpu_block_tables[seq.seq_id]) == -(
                -seq.num_computed_tokens // self.block_manager.block_size
            )
