"""Phase 4 engine with the real TinyTransformer: scheduling changes when tokens are computed, never
which tokens come out.

Oracle: phase 3's `generate` (one request at a time, its own KV cache) on the same weights. Every
engine here is stepped by hand so that `check_invariants()` runs after every step.
"""

import random

import pytest
import torch

import phase3_kvcache
from phase4_scheduler import (
    LLM,
    BPETokenizer,
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    StepTrace,
    TinyTransformer,
)

CONFIG = ModelConfig(max_position_embeddings=128)
_rng = random.Random(4)  # a seed whose greedy paths have no near-ties (see `oracle`)
PROMPTS = [[_rng.randrange(CONFIG.vocab_size) for _ in range(n)] for n in (5, 2, 17, 31, 9)]
MAX_TOKENS = [12, 20, 6, 16, 10]
LONGEST = max(len(p) + m for p, m in zip(PROMPTS, MAX_TOKENS, strict=True))
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit along the oracle's path; float32 noise is ~1e-6
MAX_STEPS = 2000


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=max_tokens, seed=seed)


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return TinyTransformer(CONFIG).state_dict()


@pytest.fixture(scope="module")
def phase3_model(state):
    model = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**vars(CONFIG))).eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def model(state):
    model = TinyTransformer(CONFIG).eval()
    model.load_state_dict(state)
    return model


def phase3_generate(model, prompt, params: SamplingParams, eos_token_id=None) -> list[int]:
    p3 = phase3_kvcache.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        max_tokens=params.max_tokens, seed=params.seed,
    )  # fmt: skip
    return phase3_kvcache.generate(model, prompt, p3, eos_token_id)


@pytest.fixture(scope="module")
def oracle(phase3_model):
    pairs = zip(PROMPTS, MAX_TOKENS, strict=True)
    outputs = [phase3_generate(phase3_model, p, greedy(m)) for p, m in pairs]
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = phase3_model(torch.tensor([prompt + out[:-1]]))[0, len(prompt) - 1 :]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "near-tie: pick other prompts"
    return outputs


def run(engine: LLMEngine, prompts, params) -> list:
    """Adds every request, steps until done, checking invariants each step; outputs in order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests(), "engine did not finish"
    assert not engine.block_manager.regions and not engine.requests
    return [done[i] for i in ids]


def num_preemptions(trace: StepTrace) -> int:
    return sum(len(r.preempted) for r in trace.steps)


ENGINE_CONFIGS = {
    "default": EngineConfig(),
    **{f"chunks_of_{n}": EngineConfig(max_num_batched_tokens=n) for n in (1, 2, 3, 4)},
    # A little more room than the longest request: some run together, then one is preempted
    # (with room for the longest alone, admission's watermark would run them one at a time).
    "heavy_preemption": EngineConfig(num_kv_slots=LONGEST + 12),
    "heavy_preemption_chunks_of_3": EngineConfig(
        num_kv_slots=LONGEST + 12, max_num_batched_tokens=3
    ),
    # Without chunking, a prompt runs whole or waits; the budget still fits the longest request.
    "no_chunked_prefill": EngineConfig(
        max_num_batched_tokens=LONGEST, enable_chunked_prefill=False
    ),
    "one_at_a_time": EngineConfig(max_num_seqs=1),
}


@pytest.mark.parametrize("name", sorted(ENGINE_CONFIGS))
def test_greedy_matches_phase3(name, model, oracle):
    trace = StepTrace()
    engine = LLMEngine(model, config=ENGINE_CONFIGS[name], trace=trace)
    outs = run(engine, PROMPTS, [greedy(m) for m in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == oracle
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if name.startswith("heavy_preemption"):
        assert num_preemptions(trace) > 0, "the config was meant to preempt"


def test_mixed_sampling_params_and_seeded_sampling_ignores_batch_mates(model, phase3_model, oracle):
    """Greedy and seeded requests in one batch. A seeded request's tokens depend on its seed only:
    the same alone, beside others, under preemption and in phase 3."""
    params = [seeded(m, seed=i) if i % 2 else greedy(m) for i, m in enumerate(MAX_TOKENS)]
    expected = [
        phase3_generate(phase3_model, p, sp) if sp.seed is not None else oracle[i]
        for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))
    ]
    for config in (EngineConfig(), EngineConfig(num_kv_slots=LONGEST, max_num_batched_tokens=3)):
        outs = run(LLMEngine(model, config=config), PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == expected
    alone = run(LLMEngine(model), PROMPTS[1:2], params[1:2])
    assert alone[0].outputs[0].token_ids == expected[1]
    assert expected[1] != oracle[1], "the seeded request should not just be greedy"


def test_finish_reasons(model, oracle):
    path = oracle[1]  # 20 greedy tokens of PROMPTS[1]
    eos, stop = path[3], path[5]
    cut = lambda token: path[: path.index(token) + 1]  # noqa: E731
    engine = LLMEngine(model, eos_token_id=eos)
    params = [greedy(20), greedy(20, ignore_eos=True), greedy(20, stop_token_ids=(stop,))]
    params.append(greedy(3))  # stops before EOS
    outs = [o.outputs[0] for o in run(engine, [PROMPTS[1]] * 4, params)]
    assert (outs[0].token_ids, outs[0].finish_reason) == (cut(eos), "stop")
    assert (outs[1].token_ids, outs[1].finish_reason) == (path, "length")
    assert outs[2].finish_reason == "stop"
    assert outs[2].token_ids == min(cut(eos), cut(stop), key=len)  # EOS still applies
    assert eos not in path[:3]
    assert (outs[3].token_ids, outs[3].finish_reason) == (path[:3], "length")


def test_abort_running_request_frees_its_region(model, oracle):
    engine = LLMEngine(model, config=EngineConfig(max_num_batched_tokens=8))
    ids = [engine.add_request(p, greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    victim = engine.requests[ids[2]].seq
    while victim.num_output_tokens < 2:
        engine.step()
        engine.scheduler.check_invariants()
    assert victim in engine.scheduler.running
    engine.abort_request(ids[2])
    engine.abort_request(ids[2])  # twice, and unknown ids: ignored
    engine.abort_request("no such request")
    engine.scheduler.check_invariants()
    assert victim.seq_id not in engine.block_manager.regions
    assert victim.finish_reason.value == "abort" and ids[2] not in engine.requests
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.scheduler.check_invariants()
    assert sorted(done) == sorted(ids[:2] + ids[3:])
    for i in (0, 1, 3, 4):
        assert done[ids[i]].outputs[0].token_ids == oracle[i]
    assert not engine.block_manager.regions


def test_abort_waiting_request(model, oracle):
    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=1))
    ids = [engine.add_request(PROMPTS[i], greedy(MAX_TOKENS[i])) for i in range(2)]
    engine.step()
    engine.abort_request(ids[1])  # never ran
    engine.scheduler.check_invariants()
    assert not engine.scheduler.waiting
    outs = run(engine, [], [])
    assert outs == [] and not engine.has_unfinished_requests()


def engine_state(engine: LLMEngine):
    s = engine.scheduler
    regions = {i: vars(r).copy() for i, r in engine.block_manager.regions.items()}
    return list(engine.requests), list(s.waiting), list(s.running), regions


BAD_REQUESTS = {
    "empty prompt": ([], greedy(4), {}),
    "negative token id": ([1, -1], greedy(4), {}),
    "token id past the vocab": ([1, CONFIG.vocab_size], greedy(4), {}),
    "float token id": ([1, 2.0], greedy(4), {}),
    "longer than the context": ([1] * 100, greedy(29), {}),
    "text without a tokenizer": ("hello", greedy(4), {}),
    "duplicate request_id": ([1, 2], greedy(4), {"request_id": "first"}),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_raises_and_changes_nothing(case, model):
    engine = LLMEngine(model, config=EngineConfig(max_num_batched_tokens=4))
    engine.add_request([1, 2, 3, 4, 5, 6], greedy(8), request_id="first")
    engine.step()  # "first" is running mid-prefill, holding a region
    before = engine_state(engine)
    prompt, params, kwargs = BAD_REQUESTS[case]
    with pytest.raises(ValueError):
        engine.add_request(prompt, params, **kwargs)
    assert engine_state(engine) == before
    engine.scheduler.check_invariants()


@pytest.mark.parametrize(
    "config, max_tokens",
    [
        (EngineConfig(num_kv_slots=32), 27),  # 6 + 27 tokens can never fit in the KV cache
        (EngineConfig(max_num_batched_tokens=16, enable_chunked_prefill=False), 11),  # one step
    ],
)
def test_request_that_can_never_run_is_rejected(config, max_tokens, model):
    engine = LLMEngine(model, config=config)
    engine.add_request([1] * 6, greedy(max_tokens - 1))  # one token less fits
    with pytest.raises(ValueError):
        engine.add_request([1] * 6, greedy(max_tokens))
    assert len(engine.requests) == 1 and len(engine.scheduler.waiting) == 1


def test_llm_generate_is_all_or_nothing(model, oracle):
    llm = LLM(model, max_num_batched_tokens=8)
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], [], PROMPTS[1]], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    with pytest.raises(ValueError):
        llm.generate(PROMPTS[:2], [greedy(4)], use_tqdm=False)
    outs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle
    assert [o.prompt_token_ids for o in outs] == PROMPTS


CORPUS = ["the cat sat on the mat. the dog sat on the log. " * 4, "hello world, hello there."]


def test_text_prompts_with_a_trained_tokenizer():
    tok = BPETokenizer.train(CORPUS, vocab_size=300, special_tokens=["<|end|>"])
    eos = tok.token_to_id("<|end|>")
    config = ModelConfig(vocab_size=tok.vocab_size, max_position_embeddings=64)
    torch.manual_seed(1)
    model = TinyTransformer(config).eval()
    reference = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**vars(config))).eval()
    reference.load_state_dict(model.state_dict())
    llm = LLM(model, tokenizer=tok, eos_token_id=eos)
    texts = ["the cat sat", "hello world"]
    outs = llm.generate(texts, greedy(10), use_tqdm=False)
    for text, out in zip(texts, outs, strict=True):
        assert out.prompt == text and out.prompt_token_ids == tok.encode(text)
        ids = out.outputs[0].token_ids
        assert ids == phase3_generate(reference, tok.encode(text), greedy(10), eos)
        assert out.outputs[0].text == tok.decode(ids)
