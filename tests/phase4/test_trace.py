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
    engine = LLMEngine(model, config=config, trace=trace)
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
    """23 KV slots: the first request reserves 10; the other two grow until the newest must go."""
    requests = [([1, 2], 8), ([3, 4, 5, 6], 10), ([7], 6)]
    return traced(model, EngineConfig(num_kv_slots=23), requests)


def test_chunked_prefill_shares_steps_with_decodes(chunked):
    mixed = [r for r in chunked.steps if r.prefill and r.decode]
    assert mixed, "no step ran a prefill chunk beside decodes"
    assert all(r.decode == [0, 1] and r.prefill == {2: 4} for r in mixed[:3])
    assert sum(sum(r.prefill.values()) for r in chunked.steps) == 2 + 1 + 40
    assert all(r.kv_used <= r.kv_reserved for r in chunked.steps)


def test_preemption_and_readmission_are_recorded(preempting):
    preempted = [r for r in preempting.steps if r.preempted]
    assert [(r.step, r.preempted) for r in preempted] == [(5, [2])]  # the newest, once
    readmitted = [r for r in preempting.steps if 2 in r.admitted]
    assert 0 in preempting.steps[7].finished
    assert [r.step for r in readmitted] == [0, 8]  # back as soon as the first request finished
    assert readmitted[1].prefill[2] == 1 + 5  # its prompt and the 5 tokens it had, recomputed
    assert all(r.prefill or r.decode for r in preempting.steps), "a step ran nothing"
    assert all(r.kv_used <= r.kv_reserved <= 23 for r in preempting.steps)
    assert sorted(sum((r.finished for r in preempting.steps), [])) == [0, 1, 2]


def test_each_step_records_the_requests_and_the_region_map(chunked, preempting):
    for trace in (chunked, preempting):
        for r in trace.steps:
            regions = r.kv_map["regions"]
            running = [q for q in r.requests if q[1] == "running"]
            assert sorted(seq_id for seq_id, *_ in regions) == sorted(q[0] for q in running)
            assert sum(capacity for _, _, capacity, _ in regions) == r.kv_reserved
            assert sum(used for *_, used in regions) == r.kv_used
            assert all(q[-1] == 0 for q in r.requests if q[1] == "waiting")
        assert trace.steps[-1].requests == [] and trace.steps[-1].kv_map["regions"] == []
    preempted = next(r for r in preempting.steps if r.preempted)
    assert preempted.preempted[0] in [q[0] for q in preempted.requests if q[1] == "waiting"]


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
        states = [e["args"]["snapshot"] for e in events if e["ph"] == "O"]
        assert [s["kv"] for s in states] == [r.kv_map for r in trace.steps]
        trace.plot(tmp_path / f"{name}.png", title=name)
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert instants.count("preempted") == 1 and instants.count("finished") == 3
