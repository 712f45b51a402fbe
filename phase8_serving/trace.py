"""Step trace: a recording of what the scheduler did, step by step, to look at in Perfetto.

Problem: continuous batching, chunked prefill and preemption are invisible in the final output;
the only evidence is timing.
Idea: record per step which sequences ran with how many prefill and decode tokens, who was
admitted, preempted or finished, and how many KV slots were in use and reserved; and the state
after the step: every unfinished request's progress (`REQUEST_FIELDS`) and the KV cache's map
(`kv_map`: free, cached, held or shared blocks). `to_chrome()` writes Chrome trace-event JSON
(open it at ui.perfetto.dev: one track per sequence, a counter track for the KV cache; the state
rides along as one object-snapshot event per step, which `mini-vllm replay` plays back);
`plot()` draws the same timeline as a PNG.
A token counts as prefill while the sequence has not yet caught up with its prompt (or, after a
preemption, with everything it had generated); afterwards each step's single token is decode.
"""

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from .block_manager import BlockManager
from .scheduler import Scheduler

# One request's state after a step, in this order (a list per request keeps the JSON small).
# `kv_held`: the KV blocks its block table holds (on the GPU).
REQUEST_FIELDS = ("seq_id", "status", "num_prompt_tokens", "num_computed_tokens", "num_tokens",
                  "max_tokens", "kv_held")  # fmt: skip


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    prefill: dict[int, int]  # seq_id -> prefill tokens this step
    decode: list[int]  # seq_ids that decoded one token
    admitted: list[int]
    preempted: list[int]
    finished: list[int]
    kv_used: int
    kv_reserved: int
    requests: list[list]  # REQUEST_FIELDS of every unfinished request, after the step
    kv_map: dict  # kv_map(): where the KV cache's memory went, after the step


@dataclass
class StepTrace:
    steps: list[StepRecord] = field(default_factory=list)

    def record(self, start: float, end: float, out, finished, scheduler: Scheduler) -> None:
        prefill, decode = {}, []
        for seq, num_new in out.scheduled:
            # `num_computed_tokens` was already advanced by the engine when this is called.
            is_decode = num_new == 1 and seq.num_computed_tokens > seq.num_prompt_tokens
            if is_decode:
                decode.append(seq.seq_id)
            else:
                prefill[seq.seq_id] = num_new
        self.steps.append(
            StepRecord(
                step=len(self.steps),
                start=start,
                end=end,
                prefill=prefill,
                decode=decode,
                admitted=[s.seq_id for s in out.admitted],
                preempted=[s.seq_id for s in out.preempted],
                finished=[s.seq_id for s in finished],
                kv_used=scheduler.block_manager.num_used_slots,
                kv_reserved=scheduler.block_manager.num_reserved_slots,
                requests=request_states(scheduler),
                kv_map=kv_map(scheduler.block_manager),
            )
        )

    def to_chrome(self, path: str | Path, summary: dict | None = None) -> None:
        """Writes Chrome trace-event JSON: a slice per sequence per step, instants for events;
        `summary` goes under the format's free-form "otherData" key (Perfetto shows it)."""
        t0 = self.steps[0].start if self.steps else 0.0
        us = lambda t: (t - t0) * 1e6  # noqa: E731
        events = []
        for r in self.steps:
            for seq_id, n in r.prefill.items():
                events.append(_slice(f"prefill {n}", seq_id, us(r.start), us(r.end), r.step))
            for seq_id in r.decode:
                events.append(_slice("decode", seq_id, us(r.start), us(r.end), r.step))
            for kind in ("admitted", "preempted", "finished"):
                for seq_id in getattr(r, kind):
                    events.append(
                        {"name": kind, "ph": "i", "s": "t", "pid": 1, "tid": seq_id,
                         "ts": us(r.start), "args": {"step": r.step}}
                    )  # fmt: skip
            events.append(
                {"name": "kv slots", "ph": "C", "pid": 1, "ts": us(r.start),
                 "args": {"used": r.kv_used, "reserved": r.kv_reserved}}
            )  # fmt: skip
            state = {"step": r.step, "requests": r.requests, "kv": r.kv_map}
            events.append(
                {"name": "scheduler", "ph": "O", "id": "0x1", "pid": 1, "ts": us(r.end),
                 "args": {"snapshot": state}}
            )  # fmt: skip
        Path(path).write_text(json.dumps({"traceEvents": events, "otherData": summary or {}}))

    def plot(self, path: str | Path, title: str = "scheduler steps") -> None:
        """Draws steps (x) x sequences (y): blue = prefill, green = decode, red x = preempted."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, kv) = plt.subplots(2, 1, figsize=(9, 5), sharex=True,
                                     gridspec_kw={"height_ratios": [3, 1]})  # fmt: skip
        for r in self.steps:
            for seq_id, n in r.prefill.items():
                ax.barh(seq_id, 1, left=r.step, color="tab:blue", alpha=min(1.0, 0.3 + n / 64))
            for seq_id in r.decode:
                ax.barh(seq_id, 1, left=r.step, color="tab:green")
            for seq_id in r.preempted:
                ax.plot(r.step + 0.5, seq_id, "rx", markersize=8)
        ax.set(ylabel="sequence", title=title + "  (blue: prefill, green: decode, x: preempted)")
        steps = [r.step for r in self.steps]
        kv.plot(steps, [r.kv_used for r in self.steps], label="used")
        kv.plot(steps, [r.kv_reserved for r in self.steps], label="reserved")
        kv.set(xlabel="step", ylabel="KV slots")
        kv.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def request_states(scheduler: Scheduler) -> list[list]:
    """REQUEST_FIELDS of every unfinished request: running (in admission order), swapped out,
    then waiting."""
    bm = scheduler.block_manager
    return [
        [seq.seq_id, seq.status.value, seq.num_prompt_tokens, seq.num_computed_tokens,
         seq.num_tokens, seq.params.max_tokens, _kv_held(bm, seq.seq_id)]
        for seq in (*scheduler.running, *scheduler.swapped, *scheduler.waiting)
    ]  # fmt: skip


def _kv_held(block_manager: BlockManager, seq_id: int) -> int:
    return len(block_manager.block_tables.get(seq_id, ()))


def kv_map(block_manager: BlockManager, stride: int = 1) -> dict:
    """The block pool, run-length encoded in block-id order: runs of [count, owner, ref_cnt,
    cached], where owner is the seq_id of the one table holding the block (None when free or
    shared) and cached is 1 if the block is in the prefix cache (a free cached block can still be
    hit, until it is evicted for reuse). `stride` > 1 samples every stride-th block only, for a
    pool too large to draw block by block."""
    owner: dict[int, int] = {}
    for seq_id, table in block_manager.block_tables.items():
        owner.update(dict.fromkeys(table, seq_id))
    cells = [
        (
            owner.get(b.block_id) if b.ref_cnt == 1 else None,
            b.ref_cnt,
            int(b.block_hash is not None),
        )
        for b in block_manager.blocks[::stride]
    ]
    runs = [[sum(1 for _ in group), *cell] for cell, group in itertools.groupby(cells)]
    return {"unit": "block", "num_blocks": len(block_manager.blocks),
            "block_size": block_manager.block_size, "stride": stride, "runs": runs}  # fmt: skip


def _slice(name: str, seq_id: int, start_us: float, end_us: float, step: int) -> dict:
    return {"name": name, "ph": "X", "pid": 1, "tid": seq_id, "ts": start_us,
            "dur": max(end_us - start_us, 1.0), "args": {"step": step}}  # fmt: skip
