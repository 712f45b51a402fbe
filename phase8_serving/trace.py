"""Step trace: a recording of what the scheduler did, step by step, to look at in Perfetto.

Problem: continuous batching, chunked prefill and preemption are invisible in the final output;
the only evidence is timing.
Idea: record per step which sequences ran with how many prefill and decode tokens, who was
admitted, preempted or finished, and how many KV slots were in use and reserved. `to_chrome()`
writes Chrome trace-event JSON (open it at ui.perfetto.dev: one track per sequence, a counter
track for the KV cache); `plot()` draws the same timeline as a PNG.
A token counts as prefill while the sequence has not yet caught up with its prompt (or, after a
preemption, with everything it had generated); afterwards each step's single token is decode.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from .block_manager import BlockManager


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


@dataclass
class StepTrace:
    steps: list[StepRecord] = field(default_factory=list)

    def record(self, start: float, end: float, out, finished, block_manager: BlockManager) -> None:
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
                kv_used=block_manager.num_used_slots,
                kv_reserved=block_manager.num_reserved_slots,
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
                         "ts": us(r.start)}
                    )  # fmt: skip
            events.append(
                {"name": "kv slots", "ph": "C", "pid": 1, "ts": us(r.start),
                 "args": {"used": r.kv_used, "reserved": r.kv_reserved}}
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


def _slice(name: str, seq_id: int, start_us: float, end_us: float, step: int) -> dict:
    return {"name": name, "ph": "X", "pid": 1, "tid": seq_id, "ts": start_us,
            "dur": max(end_us - start_us, 1.0), "args": {"step": step}}  # fmt: skip
