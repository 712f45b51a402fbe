"""The real engine of phases 4 and 5 with a fake forward pass, for scheduler and memory tests.

`FakeRunnerMixin` goes on top of a phase's real `ModelRunner` (whose `prepare` builds the slot
mapping) and replaces the model: each step it writes every new token's id and position into the
real KV cache tensors as its "key" and "value", then reads back each scheduled sequence's whole
context through the block manager and checks that it holds exactly that sequence's tokens, in
order. So memory handed to two sequences, a region moved or a block swapped without its
keys/values, a prefix-cache hit on someone else's tokens, or a recompute that skips a token all
fail. It "samples" a fixed token, so no forward pass runs and hypothesis can explore thousands of
steps. `Harness` drives `LLMEngine.step` itself and checks the scheduler's promises every step.
"""

import torch

FAKE_TOKEN = 7  # what the fake model always "samples"
TINY_MODEL = dict(
    vocab_size=64, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
    intermediate_size=8, max_position_embeddings=512,
)  # fmt: skip


class FakeRunnerMixin:
    """Mixed into a phase's ModelRunner: the forward pass writes (token id, position) as each new
    token's key/value, then checks every scheduled sequence's context. `context_slot(seq, p)`
    (per phase) says where the block manager keeps position p of `seq`."""

    def run(self, scheduled: list) -> list[int | None]:
        input_ids, positions, batch = self.prepare(scheduled)
        self.kv_cache.store(0, self._as_kv(input_ids), self._as_kv(positions), batch.slot_mapping)
        for seq, num_new in scheduled:
            end = seq.num_computed_tokens + num_new
            slots = torch.tensor([self.context_slot(seq, p) for p in range(end)])
            keys, values = (x[0].flatten(0, -3) for x in (self.kv_cache.k, self.kv_cache.v))
            held_tokens = keys[slots, 0, 0].long().tolist()  # (slots, H_kv, D) views of the pool
            held_positions = values[slots, 0, 0].long().tolist()
            assert held_tokens == seq.token_ids[:end], f"{seq}: its slots hold other tokens"
            assert held_positions == list(range(end)), f"{seq}: its slots hold other positions"
        self.last_scheduled = list(scheduled)
        return [FAKE_TOKEN if s.num_computed_tokens + n == s.num_tokens else None
                for s, n in scheduled]  # fmt: skip

    def _as_kv(self, values: torch.Tensor) -> torch.Tensor:
        k = self.kv_cache.k[0]
        return values.to(k.dtype)[:, None, None].expand(-1, *k.shape[-2:])


def max_len(seq) -> int:
    return seq.num_prompt_tokens + seq.params.max_tokens


class Harness:
    """The real engine with a fake runner; checks the scheduler's promises on every step."""

    def __init__(self, phase, runner_cls, model, config):
        self.phase, self.config = phase, config
        self.trace = phase.StepTrace()
        self.engine = phase.LLMEngine(model, config=config, trace=self.trace)
        self.engine.runner = runner_cls(model, config, self.engine.block_manager)
        self.seqs: list = []

    @property
    def scheduler(self):
        return self.engine.scheduler

    def add(self, prompt: int | list[int], max_tokens: int):
        """Queues a request; an int prompt is that many distinct tokens."""
        if isinstance(prompt, int):
            prompt = [(len(self.seqs) + i) % TINY_MODEL["vocab_size"] for i in range(prompt)]
        request_id = self.engine.add_request(
            prompt, self.phase.SamplingParams(max_tokens=max_tokens)
        )
        self.seqs.append(self.engine.requests[request_id].seq)
        return self.seqs[-1]

    def abort(self, seq) -> None:
        self.engine.abort_request(seq.request_id)
        self.scheduler.check_invariants()

    def step(self):
        running_before = list(self.scheduler.running)
        waiting_before = list(self.scheduler.waiting)
        unfinished = [s for s in self.seqs if not s.is_finished]
        # Uncomputed tokens (a prefix-cache hit may cut a waiting one's), and tokens in all.
        remaining = {id(s): s.num_tokens - s.num_computed_tokens for s in unfinished}
        num_tokens = {id(s): s.num_tokens for s in unfinished}
        self.engine.runner.last_scheduled = []
        self.engine.step()
        self.scheduler.check_invariants()
        record = self.trace.steps[-1]
        self.check_step(record, running_before, waiting_before, remaining, num_tokens)
        return record

    def check_step(self, record, running_before, waiting_before, remaining, num_tokens) -> None:
        config, scheduler = self.config, self.scheduler
        scheduled = self.engine.runner.last_scheduled
        if remaining:
            assert scheduled, "a step ran nothing"
        assert sum(n for _, n in scheduled) <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        assert len({id(s) for s, _ in scheduled}) == len(scheduled), "scheduled twice"
        for seq, num_new in scheduled:
            assert 1 <= num_new <= remaining[id(seq)]
            if not config.enable_chunked_prefill:  # caught up with all it had: not chunked
                assert seq.num_computed_tokens == num_tokens[id(seq)], "a prompt was chunked"
        # LIFO: the victims are the most recently admitted, newest first, and nobody is admitted
        # in the step that preempted.
        k = len(record.preempted)
        if k:
            assert record.preempted == [s.seq_id for s in running_before[::-1][:k]]
            self.check_victims(running_before[::-1][:k])
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

    def check_victims(self, victims: list) -> None:
        """Recompute: the victims go back to the front of the waiting queue (oldest first) with
        nothing computed."""
        waiting = list(self.scheduler.waiting)
        assert waiting[: len(victims)] == victims[::-1]
        assert all(s.num_computed_tokens == 0 for s in victims)

    def drain(self) -> None:
        for _ in range(steps_bound(self.seqs)):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not done after {steps_bound(self.seqs)} steps")


def steps_bound(seqs: list) -> int:
    """Liveness bound: the oldest running sequence always runs (alone, it always finds room), so
    requests finish one after another at worst, each recomputed at most once per try."""
    return sum(2 * (max_len(s) + 2) for s in seqs) + 1
