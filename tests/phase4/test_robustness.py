"""Phase 4: one bad request never breaks the engine.

Every case here once left the engine broken: a bad `SamplingParams` failed deep inside `step()`,
the failed request stayed in `running`, and every later `generate` raised the same error while
holding its KV slots; a non-prompt among good prompts left the good ones queued, to run silently
inside the next call. Each test triggers one failure and then checks, with
`tests.robustness.assert_engine_recovered`, that the engine answers like one that never failed.
"""

import math

import pytest
import torch

from phase4_scheduler import (
    LLM,
    BPETokenizer,
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    TinyTransformer,
)
from tests.robustness import assert_engine_recovered

CONFIG = ModelConfig(max_position_embeddings=64)
PROMPTS = [[5, 17, 3, 99], [42, 8], [7, 7, 7, 1, 2, 3, 4, 5, 6, 60]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SMALL_STEPS = {"max_num_batched_tokens": 4, "max_num_seqs": 2}  # a failure finds some waiting


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyTransformer(CONFIG).eval()


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    outputs = LLM(model, **SMALL_STEPS).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def assert_recovered(llm: LLM, expected) -> None:
    block_manager = llm.engine.block_manager
    assert_engine_recovered(
        llm, PROMPTS, GREEDY, expected, lambda: block_manager.num_reserved_slots
    )


# The reproductions: each once passed construction and failed inside a later step.
BAD_SAMPLING = [
    ({"seed": "abc"}, TypeError),
    ({"seed": 1.5}, TypeError),
    ({"seed": 2**70}, ValueError),  # torch.Generator takes 64-bit seeds
    ({"top_k": 1.5}, TypeError),
    ({"temperature": 1e-40}, ValueError),  # 1/T overflows: inf logits, NaN probabilities
    ({"temperature": math.nan}, ValueError),
    ({"stop_token_ids": [1.5]}, TypeError),
    ({"stop_token_ids": 3}, TypeError),  # one int is not a list of them
    ({"ignore_eos": "no"}, TypeError),
]


@pytest.mark.parametrize("kwargs, error", BAD_SAMPLING, ids=[str(k) for k, _ in BAD_SAMPLING])
def test_bad_sampling_params_fail_at_construction_and_the_engine_still_answers(
    kwargs, error, model, expected
):
    llm = LLM(model, **SMALL_STEPS)
    (field,) = kwargs
    with pytest.raises(error, match=field):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=6, **kwargs)], use_tqdm=False)
    assert_recovered(llm, expected)


def test_stop_token_ids_are_stored_as_a_tuple():
    params = SamplingParams(stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)
    hash(params)  # frozen and hashable: no list inside


def test_bad_prompts_leave_nothing_queued(model, expected):
    llm = LLM(model, **SMALL_STEPS)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate([PROMPTS[0], 123], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a str or a list"):
        llm.generate(b"Hello", GREEDY, use_tqdm=False)  # bytes are not text
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        llm.generate([b"Hello"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be ints"):
        llm.generate([PROMPTS[0], [1, True]], GREEDY, use_tqdm=False)  # a bool is not a token
    with pytest.raises(TypeError, match=r"sampling_params\[1\]"):
        llm.generate(PROMPTS[:2], [GREEDY, {"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    assert_recovered(llm, expected)


def test_bad_add_request_arguments_change_nothing(model):
    engine = LLMEngine(model, config=EngineConfig(**SMALL_STEPS))
    engine.add_request(PROMPTS[0], GREEDY, request_id="first")
    engine.step()

    def state():
        return list(engine.requests), engine.scheduler.running[:], [*engine.scheduler.waiting]

    before = state()
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request(PROMPTS[1], {"temperature": 0})
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(PROMPTS[1], GREEDY, request_id=7)
    with pytest.raises(TypeError, match="prompt must be a str or a list"):
        engine.add_request((1, 2), GREEDY)
    assert state() == before
    engine.scheduler.check_invariants()


def test_a_bare_string_is_one_prompt():
    tokenizer = BPETokenizer.train(["the cat sat on the mat. " * 4], vocab_size=280)
    torch.manual_seed(0)
    model = TinyTransformer(ModelConfig(vocab_size=tokenizer.vocab_size)).eval()
    llm = LLM(model, tokenizer)
    (out,) = llm.generate("the cat", GREEDY, use_tqdm=False)  # not five one-letter prompts
    assert out.prompt == "the cat" and out.prompt_token_ids == tokenizer.encode("the cat")


class ModelError(RuntimeError):
    """What a failing forward pass raises (a CUDA error, an out-of-memory, a bug)."""


def fail_on_call(model: torch.nn.Module, monkeypatch, call: int) -> None:
    """Makes the model's `call`-th forward pass from now on raise ModelError."""
    forward, calls = model.forward, iter(range(1, call + 1))

    def failing_forward(*args, **kwargs):
        if next(calls, None) == call:
            raise ModelError("the forward pass failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)


def test_model_error_in_generate_aborts_every_request_of_the_call(model, expected, monkeypatch):
    llm = LLM(model, **SMALL_STEPS)
    fail_on_call(model, monkeypatch, call=3)  # some requests running, one still waiting
    with pytest.raises(ModelError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_recovered(llm, expected)


def test_failed_step_aborts_what_it_ran_and_the_rest_continues(model, expected, monkeypatch):
    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=1))
    ran, waited = (engine.add_request(p, GREEDY) for p in PROMPTS[:2])
    fail_on_call(model, monkeypatch, call=2)
    engine.step()  # `ran` prefills
    with pytest.raises(ModelError):
        engine.step()
    monkeypatch.undo()
    assert ran not in engine.requests and engine.requests[waited].seq in engine.scheduler.waiting
    engine.scheduler.check_invariants()
    assert engine.block_manager.num_reserved_slots == 0
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
        engine.scheduler.check_invariants()
    assert done[waited].outputs[0].token_ids == expected[1]


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        ({"max_num_seqs": True}, TypeError, "max_num_seqs"),
        ({"max_num_batched_tokens": 2.5}, TypeError, "max_num_batched_tokens"),
        ({"num_kv_slots": 0}, ValueError, "num_kv_slots"),
        ({"enable_chunked_prefill": 1}, TypeError, "enable_chunked_prefill"),
        ({"max_num_sequences": 4}, TypeError, "max_num_sequences"),  # a misspelt option
    ],
)
def test_engine_options_are_checked(kwargs, error, field, model):
    with pytest.raises(error, match=field):
        LLM(model, **kwargs)


def test_engine_arguments_are_checked(model):
    with pytest.raises(TypeError, match="tokenizer must be a BPETokenizer"):
        LLMEngine(model, EngineConfig())  # the config where the tokenizer goes
    with pytest.raises(TypeError, match="eos_token_id"):
        LLM(model, eos_token_id="<|end|>")
