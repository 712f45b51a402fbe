"""Phase 5 step trace: each step's state is recorded, with the paged KV cache's block map."""

import json

import pytest
import torch

from phase5_paged import EngineConfig, LLMEngine, ModelConfig, SamplingParams, TinyTransformer
from phase5_paged.trace import StepTrace


@pytest.fixture(scope="module")
def shared_prefix_trace() -> tuple[StepTrace, int]:
    """Five requests with one 24-token prefix in 4-token blocks, in a cache too small for all."""
    torch.manual_seed(0)
    model = TinyTransformer(ModelConfig(max_position_embeddings=128)).eval()
    trace, num_blocks = StepTrace(), 18
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
    engine = LLMEngine(model, config=config, trace=trace)
    for i in range(5):
        prompt = list(range(1, 25)) + [100 + i] * (i + 1)
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12 + 4 * i))
        engine.step()  # one arrival per step: later prompts find the prefix in the cache
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    return trace, num_blocks


def test_each_step_records_the_requests_and_the_block_map(shared_prefix_trace):
    trace, num_blocks = shared_prefix_trace
    for r in trace.steps:
        runs = r.kv_map["runs"]
        assert r.kv_map["unit"] == "block" and sum(count for count, *_ in runs) == num_blocks
        # every block-table entry is one reference: the blocks held add up to the ref counts
        held = sum(request[-1] for request in r.requests)
        assert held == sum(count * ref_cnt for count, _, ref_cnt, _ in runs)
        owners = {owner for _, owner, ref_cnt, _ in runs if ref_cnt == 1}
        running = {request[0] for request in r.requests if request[1] == "running"}
        assert owners <= running
        assert all(request[-1] == 0 for request in r.requests if request[1] == "waiting")
    runs = [run for r in trace.steps for run in r.kv_map["runs"]]
    assert any(ref_cnt > 1 for _, _, ref_cnt, _ in runs), "no block was shared"
    assert any(ref_cnt == 0 and cached for _, _, ref_cnt, cached in runs), "none stayed cached"
    assert any(r.preempted for r in trace.steps), "the test must preempt"
    assert trace.steps[-1].requests == []


def test_the_state_rides_in_the_chrome_json(shared_prefix_trace, tmp_path):
    trace, _ = shared_prefix_trace
    trace.to_chrome(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    states = [e["args"]["snapshot"] for e in events if e["ph"] == "O"]
    assert [s["step"] for s in states] == [r.step for r in trace.steps]
    assert states[3]["kv"] == trace.steps[3].kv_map
    assert all("step" in e["args"] for e in events if e["ph"] == "i")


def test_a_stride_samples_a_large_pool():
    from phase5_paged.block_manager import BlockManager
    from phase5_paged.trace import kv_map

    assert sum(count for count, *_ in kv_map(BlockManager(10, 4), stride=3)["runs"]) == 4
