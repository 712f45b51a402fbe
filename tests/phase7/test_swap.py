"""Phase 7 carries phase 5's preemption modes: on a real (tiny random) Qwen3 checkpoint, swap and
recompute under a tight KV cache give the tokens of an unpressured run, and really preempt."""

import pytest

from phase7_optim import LLM, EngineConfig, SamplingParams, StepTrace

PROMPTS = [list(range(100, 100 + n)) for n in (5, 23, 11, 17)]
MAX_TOKENS = 12
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 12  # holds the longest request (10 blocks) and a little more: someone is preempted


def run(model_dir, **engine_kwargs) -> tuple[list[list[int]], int, bool]:
    trace = StepTrace()
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, trace=trace, **engine_kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done, swapped = {}, False
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        engine.scheduler.check_invariants()
        swapped |= bool(engine.scheduler.swapped)
    return [done[i] for i in ids], sum(len(r.preempted) for r in trace.steps), swapped


@pytest.fixture(scope="module")
def unpressured(tiny_qwen3_tied_dir):
    tokens, preemptions, _ = run(tiny_qwen3_tied_dir)
    assert preemptions == 0
    return tokens


@pytest.mark.slow  # phase 5's lesson; phase 7's own rule is the refusal below
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_give_the_unpressured_tokens(tiny_qwen3_tied_dir, unpressured, mode):
    tokens, preemptions, swapped = run(
        tiny_qwen3_tied_dir, num_kv_blocks=NUM_KV_BLOCKS, preemption_mode=mode,
        num_cpu_kv_blocks=32 if mode == "swap" else 0,
    )  # fmt: skip
    assert tokens == unpressured
    assert preemptions > 0 and swapped == (mode == "swap")


def test_swap_is_refused_under_tensor_parallelism():
    # Only rank 0 schedules, so only rank 0 would copy its blocks to the CPU pool: the other
    # ranks' KV heads would be lost. The config says so before anything is spawned.
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(preemption_mode="swap", num_cpu_kv_blocks=4, tensor_parallel_size=2)
    EngineConfig(preemption_mode="swap", num_cpu_kv_blocks=4)  # one rank: fine
