"""Replay: the dashboard on a recorded step trace, with a step slider (`mini-vllm replay`).

Problem: phases 4-8 record every step of a run as Chrome trace JSON (trace.py). Perfetto shows
its timeline, but not the state a step left behind: who was waiting, how far each request got,
and where the KV cache's memory went, which is where phase 4's contiguous regions and phase 5's
paged blocks differ.
Idea: each step's state rides in the trace as one object-snapshot event ("ph": "O"); this file
turns the trace into the frames the live dashboard draws (snapshot.py's format), one per step,
and serves the same page over them. Phase 4's map is in token slots (regions), phase 5's and
later in blocks; the page draws either.
"""

import json
from collections import defaultdict
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse

from .dashboard import DASHBOARD_PATH, add_page_routes
from .trace import REQUEST_FIELDS  # the same fields in every phase's trace


def load_frames(path: str | Path) -> list[dict]:
    """The frames of a trace written by `StepTrace.to_chrome()`; ValueError if it is not one."""
    try:
        trace = json.loads(Path(path).read_text())
        events = trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a Chrome trace JSON file: {e}") from e
    states = [e for e in events if e.get("ph") == "O" and e.get("name") == "scheduler"]
    if not states:
        raise ValueError(
            f"{path} holds no scheduler states: record it again with the current StepTrace "
            "(phases 4-8's trace.py)"
        )
    batches: dict[int, dict] = defaultdict(lambda: {"prefill_tokens": 0, "decode_tokens": 0,
                                                    "num_seqs": 0})  # fmt: skip
    preempted: dict[int, list[str]] = defaultdict(list)
    for e in events:
        step = e.get("args", {}).get("step")
        if e.get("ph") == "X":
            batch = batches[step]
            batch["num_seqs"] += 1
            kind, *tokens = e["name"].split()  # "prefill 16" or "decode"
            batch["prefill_tokens" if kind == "prefill" else "decode_tokens"] += int(
                tokens[0] if tokens else 1
            )
        elif e.get("ph") == "i" and e["name"] == "preempted":
            preempted[step].append(str(e["tid"]))
    frames, num_preemptions = [], 0
    for event in sorted(states, key=lambda e: e["args"]["snapshot"]["step"]):
        state = event["args"]["snapshot"]
        step = state["step"]
        num_preemptions += len(preempted[step])
        frames.append(_frame(state, event["ts"] / 1e6, batches[step], preempted[step],
                             num_preemptions))  # fmt: skip
    return frames


def _frame(state: dict, time_s: float, batch: dict, preempted: list[str], num_preemptions: int):
    requests = [dict(zip(REQUEST_FIELDS, r, strict=True)) for r in state["requests"]]
    count = lambda status: sum(r["status"] == status for r in requests)  # noqa: E731
    return {
        "step": state["step"],
        "time": time_s,
        "requests": [_request(r) for r in requests],
        "num_running": count("running"),
        "num_swapped": count("swapped"),
        "num_waiting": count("waiting"),
        "batch": {**batch, "token_budget": None},  # the trace does not record the budget
        "preempted": preempted,
        "num_preemptions": num_preemptions,
        "kv": state["kv"],
        "kv_usage": kv_usage(state["kv"]),
        "prefix_cache": None,
        "cost_s": 0.0,
    }


def _request(r: dict) -> dict:
    return {
        "id": str(r["seq_id"]),
        "seq_id": r["seq_id"],
        "status": r["status"],
        "prompt_tokens": r["num_prompt_tokens"],
        "computed_tokens": r["num_computed_tokens"],
        "output_tokens": r["num_tokens"] - r["num_prompt_tokens"],
        "max_tokens": r["max_tokens"],
        "kv_held": r["kv_held"],
    }


def kv_usage(kv: dict) -> float:
    """Fraction of the pool taken: reserved slots (phase 4), referenced blocks (phase 5+)."""
    if kv["unit"] == "slot":
        return sum(capacity for _, _, capacity, _ in kv["regions"]) / kv["num_slots"]
    sampled = sum(count for count, *_ in kv["runs"])
    return sum(count for count, _, ref_cnt, _ in kv["runs"] if ref_cnt > 0) / sampled


def build_replay_app(path: str | Path) -> FastAPI:
    frames = load_frames(path)
    app = FastAPI(title="mini-vllm replay")
    add_page_routes(app, {"mode": "replay", "trace": Path(path).name, "num_frames": len(frames)})

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(DASHBOARD_PATH)

    @app.get(DASHBOARD_PATH + "/frames", include_in_schema=False)
    async def all_frames() -> JSONResponse:
        return JSONResponse(frames)

    return app
