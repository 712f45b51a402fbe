"""Preemption by swap or by recompute changes when tokens are computed, never which ones come out.

The oracle is the same engine with a KV cache roomy enough that nobody is ever preempted. Under a
cache a little larger than the longest request (several are admitted, then the newest must make
room), both modes must give the same tokens, greedy and seeded-random alike, and the run must
really have preempted (and, in swap mode, swapped).
"""

import random

import pytest
import torch

from phase5_paged import (
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    StepTrace,
    TinyTransformer,
)

CONFIG = ModelConfig(max_position_embeddings=128)
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(CONFIG.vocab_size) for _ in range(n)] for n in (5, 2, 17, 31, 9)]
MAX_TOKENS = [12, 20, 6, 16, 10]
BLOCK_SIZE = 4
LONGEST_BLOCKS = max(
    -(-(len(p) + m) // BLOCK_SIZE) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)
)
NUM_KV_BLOCKS = LONGEST_BLOCKS + 3  # checked below to preempt: the test fails if it no longer does
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[0]),
    SamplingParams(temperature=0.8, top_k=50, max_tokens=MAX_TOKENS[1], seed=1),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[2]),
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS[3], seed=2),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[4]),
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(CONFIG).eval()


def run(model, config: EngineConfig) -> tuple[list[list[int]], int, bool]:
    """(token ids per request, preemptions, whether anything was ever swapped out)."""
    trace = StepTrace()
    engine = LLMEngine(model, config=config, trace=trace)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
    done, swapped = {}, False
    while engine.has_unfinished_requests():
        out = engine.step()
        done.update((o.request_id, o.outputs[0].token_ids) for o in out if o.finished)
        engine.scheduler.check_invariants()
        swapped |= bool(engine.scheduler.swapped)
    bm = engine.block_manager
    assert bm.num_free_blocks == config.num_kv_blocks and not bm.cpu_block_tables
    return [done[i] for i in ids], sum(len(r.preempted) for r in trace.steps), swapped


@pytest.fixture(scope="module")
def unpressured(model):
    tokens, preemptions, _ = run(model, EngineConfig(block_size=BLOCK_SIZE))
    assert preemptions == 0
    return tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_identical_to_an_unpressured_run(model, unpressured, mode, caching):
    config = EngineConfig(
        num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=caching,
        preemption_mode=mode, num_cpu_kv_blocks=64 if mode == "swap" else 0,
    )  # fmt: skip
    tokens, preemptions, swapped = run(model, config)
    assert tokens == unpressured
    assert preemptions > 0 and swapped == (mode == "swap")
