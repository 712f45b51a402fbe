"""Phase 4 step trace: what the scheduler did each step, as Chrome trace JSON and a PNG."""

import json

import pytest
import torch

from phase4_scheduler import EngineConfig, LLMEngine, ModelConfig, SamplingParams, TinyTransformer
from phase4_scheduler.trace import StepTrace


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig(max_position_embeddings=128)).eval()


def traced(model, config: EngineConfig, requests: list[tuple[list[int], int]]) -> StepTrace:
    trace = StepTrace()
    engine = LLMEngine(model, config, trace=trace)
    for prompt, max_tokens in requests:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    return trace


@pytest.fixture(scope="module")
def chunked(model):
    """Two requests decoding when a 40-token prompt arrives in 6-token steps."""
    requests = [([1, 2], 12), ([3], 12), (list(range(40)), 4)]
    return traced(model, EngineConfig(max_num_batched_tokens=6), requests)


@pytest.fixture(scope="module")
def preempting(model):
    """12 KV slots: the first request reserves 10, the next two get one slot each and collide."""
    return traced(model, EngineConfig(num_kv_slots=12), [([1, 2], 8), ([3], 6), ([4], 6)])


def test_chunked_prefill_shares_steps_with_decodes(chunked):
    mixed = [r for r in chunked.steps if r.prefill and r.decode]
    assert mixed, "no step ran a prefill chunk beside decodes"
    assert all(r.decode == [0, 1] and r.prefill == {2: 4} for r in mixed[:3])
    assert sum(sum(r.prefill.values()) for r in chunked.steps) == 2 + 1 + 40
    assert all(r.kv_used <= r.kv_reserved for r in chunked.steps)


def test_preemption_is_recorded_even_when_the_step_runs_nothing(preempting):
    preempted = [r for r in preempting.steps if r.preempted]
    # 1 must grow into 2's slot: 2 goes (LIFO); then 1 itself, walled in by the pool's end.
    assert [r.preempted for r in preempted] == [[2], [1], [2]]
    # The last time, request 2 is alone but its region sits at the end of the pool: it
    # preempts itself, nothing runs that step, and it restarts at slot 0 with room to grow.
    lone = preempted[-1]
    assert not lone.prefill and not lone.decode and lone.kv_used == 0
    assert sorted(sum((r.finished for r in preempting.steps), [])) == [0, 1, 2]


def test_chrome_json_and_png(chunked, preempting, tmp_path):
    for name, trace in [("chunked", chunked), ("preempting", preempting)]:
        trace.to_chrome(tmp_path / f"{name}.json")
        events = json.loads((tmp_path / f"{name}.json").read_text())["traceEvents"]
        slices = [e for e in events if e["ph"] == "X"]
        assert {e["name"].split()[0] for e in slices} == {"prefill", "decode"}
        assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
        counters = [e for e in events if e["ph"] == "C" and e["name"] == "kv slots"]
        assert len(counters) == len(trace.steps)
        assert all(set(e["args"]) == {"used", "reserved"} for e in counters)
        trace.plot(tmp_path / f"{name}.png", title=name)
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert instants.count("preempted") == 3 and instants.count("finished") == 3
