"""Phase 5 engine: paged KV memory and prefix caching change no token, only memory and work.

The oracle is phase 4 (contiguous slot regions) with the same weights, loaded through
`load_state_dict`. Both run greedily; any difference is a bug unless the top-2 logits at the first
differing token nearly tie (float32 sums in another batch shape differ by ~1e-6), which
`assert_same_greedy` checks with the model's own full-sequence logits and says so.
The engine is driven step by step so that `scheduler.check_invariants()` runs after every step.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import phase1_naive
import phase4_scheduler as p4
import phase5_paged as p5

NEAR_TIE = 1e-4  # top-1/top-2 logit gap below which two correct implementations may disagree


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return p4.TinyTransformer(p4.ModelConfig()).state_dict()


def build(mod, state):
    model = mod.TinyTransformer(mod.ModelConfig()).eval()
    model.load_state_dict(state)
    return model


def run(mod, state, prompts, max_tokens, trace=None, **config):
    """Greedy outputs in prompt order, and the engine (checking invariants after every step)."""
    engine = mod.LLMEngine(build(mod, state), config=mod.EngineConfig(**config), trace=trace)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    ids = [
        engine.add_request(p, mod.SamplingParams(temperature=0.0, max_tokens=m))
        for p, m in zip(prompts, max_tokens, strict=True)
    ]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    return [done[i] for i in ids], engine


def assert_same_greedy(state, prompts, got, want):
    """Equal, or the first difference sits on a near-tie of the reference logits."""
    model = phase1_naive.TinyTransformer(phase1_naive.ModelConfig()).eval()
    model.load_state_dict(state)
    for prompt, g, w in zip(prompts, got, want, strict=True):
        if g == w:
            continue
        i = next((k for k, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        assert i is not None, f"same tokens, different lengths: {g} vs {w}"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + w[:i]]))[0, -1]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] < NEAR_TIE, f"prompt {prompt}: token {i} differs: {g} vs {w}"


def mixed_prompts(seed=0, n=6, shared=40):
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(shared)]
    lengths = [1, 16, 32, 7, 23, 48][:n]  # block-size multiples, one token, ragged
    prompts = [[rng.randrange(512) for _ in range(k)] for k in lengths]
    return prompts + [system + p for p in prompts[: n // 2]]


@pytest.mark.parametrize("block_size", [1, 16, 7])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_identical_to_phase4(state, block_size, caching):
    prompts = mixed_prompts()
    want, _ = run(p4, state, prompts, 12)
    got, engine = run(p5, state, prompts, 12, block_size=block_size, enable_prefix_caching=caching)
    assert_same_greedy(state, prompts, got, want)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.parametrize("budget", [1, 3, 10])
def test_chunked_prefill_with_tiny_budgets(state, budget):
    prompts = mixed_prompts(seed=1)
    want, _ = run(p4, state, prompts, 6)
    got, _ = run(p5, state, prompts, 6, block_size=7, max_num_batched_tokens=budget)
    assert_same_greedy(state, prompts, got, want)


@pytest.mark.parametrize("caching", [True, False])
def test_heavy_preemption_with_room_for_one_request(state, caching):
    prompts = mixed_prompts(seed=2)
    max_tokens = 10
    block_size = 4
    longest = max(len(p) for p in prompts) + max_tokens
    trace = p5.StepTrace()
    want, _ = run(p4, state, prompts, max_tokens)
    config = {"block_size": block_size, "num_kv_blocks": -(-longest // block_size)}
    got, _ = run(p5, state, prompts, max_tokens, trace, enable_prefix_caching=caching, **config)
    assert_same_greedy(state, prompts, got, want)
    assert sum(len(r.preempted) for r in trace.steps) > 0


def total_scheduled(trace) -> int:
    return sum(sum(r.prefill.values()) + len(r.decode) for r in trace.steps)


def test_prefix_cache_hits_skip_the_shared_prompt(state):
    rng = random.Random(3)
    system = [rng.randrange(512) for _ in range(64)]
    prompts = [system + [rng.randrange(512) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    want, _ = run(p4, state, prompts, 5)
    work, hits = {}, {}
    for caching in (True, False):
        trace = p5.StepTrace()
        # A budget below two prompts: later requests are admitted after the first one's prefix
        # blocks are registered, so they hit them.
        got, engine = run(p5, state, prompts, 5, trace=trace, max_num_batched_tokens=80,
                          enable_prefix_caching=caching)  # fmt: skip
        assert_same_greedy(state, prompts, got, want)
        work[caching] = total_scheduled(trace)
        hits[caching] = engine.block_manager.num_hit_tokens
    # The second request is admitted in the first step, before the prefix is registered; the
    # four after it hit the whole 64-token prefix, and exactly the hit tokens are not computed.
    assert hits[False] == 0 and hits[True] >= 4 * 64
    assert work[False] - work[True] == hits[True]


def test_fully_cached_prompt_computes_only_its_last_token(state):
    prompt = list(range(100, 132))  # exactly 2 blocks of 16
    want, _ = run(p4, state, [prompt], 4)
    engine = p5.LLMEngine(build(p5, state), config=p5.EngineConfig(), trace=p5.StepTrace())
    greedy = p5.SamplingParams(temperature=0.0, max_tokens=4)
    outputs = []
    for _ in range(2):  # the second time every full block of the prompt is cached
        rid = engine.add_request(prompt, greedy)
        while engine.has_unfinished_requests():
            outputs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
            engine.scheduler.check_invariants()
        assert rid not in engine.requests
    assert outputs == [want[0], want[0]]
    # 31 of 32 tokens could be hits, but hits come in whole blocks and never include the last
    # token: the second block (tokens 16..31) is recomputed, and its logits sample a token.
    assert engine.block_manager.num_hit_tokens == 16
    first_prefill = [r.prefill for r in engine.trace.steps if r.prefill]
    assert [sum(p.values()) for p in first_prefill] == [32, 16]


def test_duplicate_prompts_in_one_step_then_a_prompt_starting_with_their_continuation(state):
    """Regression: the second copy's blocks are private; its later blocks once got registered
    as if they started a sequence, and a prompt beginning with those tokens reused them."""
    first, _ = run(p4, state, [[1, 2, 3, 4, 5]], 6)
    prompts = [[1, 2, 3, 4, 5]] * 2 + [[5, *first[0][:3], 9]]
    want, _ = run(p4, state, prompts, 6)
    engine = p5.LLMEngine(build(p5, state), config=p5.EngineConfig(block_size=2))
    greedy = p5.SamplingParams(temperature=0.0, max_tokens=6)
    for p in prompts[:2]:
        engine.add_request(p, greedy)
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    got = []
    rid = engine.add_request(prompts[2], greedy)
    while engine.has_unfinished_requests():
        got += [o.outputs[0].token_ids for o in engine.step() if o.request_id == rid and o.finished]
    assert got == [want[2]]


def test_preempting_a_sequence_that_shares_cached_blocks(state):
    system = list(range(300, 316))  # 4 blocks of 4
    prompts = [system + [1], system + [2]]
    want, _ = run(p4, state, prompts, 12)
    trace = p5.StepTrace()
    # Budget 17: the first prompt fills step 1, the second is admitted at step 2 and hits the
    # 4 system blocks. 9 blocks cannot hold both (8 + 4 private), so the second is preempted
    # while the first keeps running over the shared blocks; it comes back and hits them again.
    got, engine = run(p5, state, prompts, 12, trace=trace, block_size=4, num_kv_blocks=9,
                      max_num_batched_tokens=17)  # fmt: skip
    assert_same_greedy(state, prompts, got, want)
    assert [s for r in trace.steps for s in r.preempted] != []
    assert engine.block_manager.num_hit_tokens >= 2 * 16  # hit on admission and on re-admission


def test_abort_frees_blocks(state):
    engine = p5.LLMEngine(build(p5, state), config=p5.EngineConfig(block_size=4, num_kv_blocks=64))
    greedy = p5.SamplingParams(temperature=0.0, max_tokens=50)
    ids = [engine.add_request(list(range(10 + i, 30 + i)), greedy) for i in range(3)]
    for _ in range(3):
        engine.step()
    held = len(engine.block_manager.block_tables[engine.requests[ids[1]].seq.seq_id])
    free_before = engine.block_manager.num_free_blocks
    engine.abort_request(ids[1])
    engine.scheduler.check_invariants()
    assert engine.block_manager.num_free_blocks == free_before + held
    for i in (ids[0], ids[2]):
        engine.abort_request(i)
    engine.scheduler.check_invariants()
    assert engine.block_manager.num_free_blocks == 64 and not engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------------------
# Property test: random shared-prefix workloads, block sizes, budgets and KV capacities


@st.composite
def workloads(draw):
    system = draw(st.lists(st.integers(0, 511), max_size=40))
    n = draw(st.integers(1, 5))
    prompts = [
        system[: draw(st.integers(0, len(system)))] + draw(st.lists(st.integers(0, 511),
                                                                    min_size=1, max_size=12))
        for _ in range(n)
    ]  # fmt: skip
    max_tokens = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 7, 16]))
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    min_blocks = -(-longest // block_size)  # one request must always fit
    config = {
        "block_size": block_size,
        "num_kv_blocks": draw(st.integers(min_blocks, 3 * min_blocks + 4)),
        "max_num_batched_tokens": draw(st.integers(1, 64)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "enable_prefix_caching": draw(st.booleans()),
    }
    return prompts, max_tokens, config


@settings(max_examples=60, deadline=None)
@given(workload=workloads())
def test_engine_property_same_tokens_as_phase4(state, workload):
    prompts, max_tokens, config = workload
    want, _ = run(p4, state, prompts, max_tokens)
    got, engine = run(p5, state, prompts, max_tokens, **config)  # check_invariants every step
    assert_same_greedy(state, prompts, got, want)
    assert engine.block_manager.num_free_blocks == config["num_kv_blocks"]
