"""Phase 7 (as phase 6): one bad request never breaks the engine (real text, chat, checkpoints).

The issue's reproductions, word for word: `generate(["Hi", "Good morning"], [greedy, bad])` with a
bad seed, top_k or temperature once failed inside `step()`, left the request running and broke
every later call; `generate(["Hello", 123])` left "Hello" queued. Each test here triggers one
failure, then checks with `tests.robustness.assert_engine_recovered` that the engine answers like
one that never failed. Options and messages are checked before the slow load and the template.
"""

import math

import pytest
import torch

from phase7_optim import LLM, SamplingParams
from tests.robustness import assert_engine_recovered

PROMPTS = ["Hi", "Good morning"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SMALL_STEPS = {"max_num_batched_tokens": 4, "max_num_seqs": 1}  # a failure finds one waiting


@pytest.fixture(scope="module")
def llm(tiny_qwen3_tied_dir) -> LLM:
    return LLM(tiny_qwen3_tied_dir, dtype="float32", **SMALL_STEPS)


@pytest.fixture(scope="module")
def expected(tiny_qwen3_tied_dir) -> list[list[int]]:
    fresh = LLM(tiny_qwen3_tied_dir, dtype="float32", **SMALL_STEPS)
    return [out.outputs[0].token_ids for out in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_recovered(llm: LLM, expected) -> None:
    manager = llm.engine.block_manager
    assert_engine_recovered(llm, PROMPTS, GREEDY, expected, lambda: manager.num_used_blocks)
    assert manager.num_free_blocks == llm.engine.kv_cache_config.num_blocks


BAD_SAMPLING = [
    ({"seed": "abc"}, TypeError),
    ({"seed": 1.5}, TypeError),
    ({"seed": 2**70}, ValueError),
    ({"top_k": 1.5}, TypeError),
    ({"temperature": 1e-40}, ValueError),
    ({"temperature": math.inf}, ValueError),
    ({"stop": [3]}, TypeError),
    ({"stop": ""}, ValueError),  # an empty stop string would end every request at once
    ({"stop_token_ids": ["<|im_end|>"]}, TypeError),
    ({"skip_special_tokens": "yes"}, TypeError),
]


@pytest.mark.parametrize("kwargs, error", BAD_SAMPLING, ids=[str(k) for k, _ in BAD_SAMPLING])
def test_issue_reproductions(kwargs, error, llm, expected):
    (field,) = kwargs
    with pytest.raises(error, match=field):
        llm.generate(PROMPTS, [GREEDY, SamplingParams(**kwargs)], use_tqdm=False)
    assert_recovered(llm, expected)


def test_stop_is_one_string_or_a_list():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[7]).stop == ("a", "b")
    hash(SamplingParams(stop=["a"], stop_token_ids=[7]))  # stored as tuples: frozen, hashable


def test_prompts_are_checked_before_anything_is_queued(llm, expected):
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str or a list of token ids"):
        llm.generate(["Hello", 123], GREEDY, use_tqdm=False)
    assert_recovered(llm, expected)  # "Hello" did not stay queued
    with pytest.raises(TypeError, match="prompts must be a str or a list"):
        llm.generate(b"Hello", GREEDY, use_tqdm=False)
    (out,) = llm.generate("Hello", GREEDY, use_tqdm=False)  # one prompt, as in vLLM
    assert out.prompt == "Hello"
    assert_recovered(llm, expected)


class ModelError(RuntimeError):
    """What a failing forward pass raises (a CUDA error, an out-of-memory, a bug)."""


def test_model_error_frees_every_block_and_the_engine_recovers(llm, expected, monkeypatch):
    forward, calls = llm.engine.model.forward, iter(range(3))

    def forward_failing_on_the_third_call(*args, **kwargs):
        if next(calls, None) == 2:
            raise ModelError("the forward pass failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.engine.model, "forward", forward_failing_on_the_third_call)
    with pytest.raises(ModelError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # "Hi" mid-run, "Good morning" waiting
    monkeypatch.undo()
    assert_recovered(llm, expected)


BAD_MESSAGES = {
    "empty conversation": ([], ValueError, "messages is an empty conversation"),
    "empty conversation in a batch": (
        [[{"role": "user", "content": "Hi"}], []],
        ValueError,
        r"messages\[1\] is an empty conversation",
    ),
    "a string": ("Hi", TypeError, "messages must be a list"),
    "a message without content": ([{"role": "user"}], TypeError, r"messages\[0\]\['content'\]"),
    "content not a string": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 5}],
        TypeError,
        r"messages\[1\]\['content'\]",
    ),
    "role not a string": ([{"role": None, "content": "Hi"}], TypeError, r"\['role'\]"),
    "a message that is not a dict": ([["user", "Hi"]], TypeError, r"messages\[0\]\[0\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_chat_checks_messages_before_the_template(case, llm, expected, monkeypatch):
    messages, error, message = BAD_MESSAGES[case]

    def template_must_not_run(*args, **kwargs):
        raise AssertionError("the chat template ran on unchecked messages")

    monkeypatch.setattr(llm.engine.tokenizer, "apply_chat_template", template_must_not_run)
    with pytest.raises(error, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_recovered(llm, expected)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_num_seqs": True}, TypeError, "max_num_seqs"),
        ({"block_size": 2.5}, TypeError, "block_size"),
        ({"enable_prefix_caching": "no"}, TypeError, "enable_prefix_caching"),
        ({"dtype": "float64"}, ValueError, "dtype"),
        ({"dtype": 16}, ValueError, "dtype"),
        ({"device": "gpu0"}, ValueError, "device"),
        ({"device": 0}, TypeError, "device"),
        ({"trace": "trace.json"}, TypeError, "trace"),
    ],
)
def test_options_fail_before_the_slow_load(kwargs, error, message, tmp_path):
    with pytest.raises(error, match=message):
        LLM(tmp_path / "never-read", **kwargs)  # loading would raise FileNotFoundError instead


def test_model_argument_type_is_checked():
    with pytest.raises(TypeError, match="model must be a str"):
        LLM(model=torch.nn.Linear(2, 2))


def test_command_line_rejects_bad_sampling_flags_before_loading(monkeypatch, capsys):
    import phase7_optim.__main__ as cli

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "LLM", no_load)
    monkeypatch.setattr("sys.argv", ["python -m phase7_optim", "--temperature", "-1", "Hi"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2  # argparse's usage error
    assert "SamplingParams.temperature" in capsys.readouterr().err
