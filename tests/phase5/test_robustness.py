"""Phase 5: one bad request never breaks the paged engine, and never leaks a KV block.

A failed step once left its request in `running`, holding blocks, so every later `generate` failed
again and the free-block count shrank. Each test triggers one failure, then checks with
`tests.robustness.assert_engine_recovered` that every block is free, the block manager's
invariants hold, and the engine answers like one that never failed. Prefix caching stays on, so
blocks a failed step cached must come back too.
"""

import pytest
import torch

from phase5_paged import LLM, EngineConfig, LLMEngine, ModelConfig, SamplingParams, TinyTransformer
from tests.robustness import assert_engine_recovered

SHARED = list(range(10, 30))  # two full blocks of 8: the prefix cache has something to keep
PROMPTS = [SHARED + [5, 17], SHARED + [42], [7, 7, 7, 1, 2, 3, 4, 5, 6, 60]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
ENGINE = {"block_size": 8, "num_kv_blocks": 16, "max_num_batched_tokens": 16, "max_num_seqs": 2}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig(max_position_embeddings=64)).eval()


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    outputs = LLM(model, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def assert_recovered(llm: LLM, expected) -> None:
    manager = llm.engine.block_manager
    assert_engine_recovered(llm, PROMPTS, GREEDY, expected, lambda: manager.num_used_blocks)
    assert manager.num_free_blocks == ENGINE["num_kv_blocks"]


@pytest.mark.parametrize(
    "kwargs, error",
    [({"seed": "abc"}, TypeError), ({"seed": 2**70}, ValueError), ({"top_k": 1.5}, TypeError)],
)
def test_bad_sampling_params_fail_at_construction(kwargs, error, model, expected):
    llm = LLM(model, **ENGINE)
    (field,) = kwargs
    with pytest.raises(error, match=field):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(**kwargs)], use_tqdm=False)
    assert_recovered(llm, expected)


class ModelError(RuntimeError):
    """What a failing forward pass raises (a CUDA error, an out-of-memory, a bug)."""


def failing_on_call(model: torch.nn.Module, call: int):
    """The model's forward, except that its `call`-th call from now on raises ModelError."""
    forward, calls = model.forward, iter(range(1, call + 1))

    def failing_forward(*args, **kwargs):
        if next(calls, None) == call:
            raise ModelError("the forward pass failed")
        return forward(*args, **kwargs)

    return failing_forward


@pytest.mark.parametrize("call", [1, 2, 4])  # first prefill; a mixed step; decodes only
def test_model_error_frees_every_block(call, model, expected, monkeypatch):
    llm = LLM(model, **ENGINE)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # the shared prefix is now cached
    monkeypatch.setattr(model, "forward", failing_on_call(model, call))
    with pytest.raises(ModelError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_recovered(llm, expected)


def test_bad_prompt_type_and_old_argument_order(model, expected):
    llm = LLM(model, **ENGINE)
    with pytest.raises(TypeError, match=r"prompts\[2\]"):
        llm.generate([*PROMPTS[:2], 123], GREEDY, use_tqdm=False)
    assert_recovered(llm, expected)
    with pytest.raises(TypeError, match="tokenizer must be a BPETokenizer"):
        LLMEngine(model, llm.engine.config)  # phase 6's order: (model, tokenizer, config, ...)


def test_failed_step_frees_the_blocks_it_ran_and_the_rest_continues(model, expected, monkeypatch):
    engine = LLMEngine(model, config=EngineConfig(**{**ENGINE, "max_num_seqs": 1}))
    ran, waited = (engine.add_request(p, GREEDY) for p in PROMPTS[1:])
    engine.step()  # `ran` prefills and holds blocks
    monkeypatch.setattr(model, "forward", failing_on_call(model, 1))
    with pytest.raises(ModelError):
        engine.step()
    monkeypatch.undo()
    assert ran not in engine.requests and engine.requests[waited].seq in engine.scheduler.waiting
    engine.scheduler.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
        engine.scheduler.check_invariants()
    assert done[waited].outputs[0].token_ids == expected[2]
