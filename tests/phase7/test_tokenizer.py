"""Phase 7 tokenizer: ids, chat prompts and EOS ids as transformers has them; streaming text.

Oracles: transformers' AutoTokenizer on the same files (ids, `apply_chat_template`), and the
tokenizer's own full `decode` for the incremental detokenizer.
"""

import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phase7_optim.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "你好，世界 😀"},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "2+2?"},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
]
QWEN3_ONLY = [
    [  # reasoning inside the content, and under the name some clients use
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Ok.", "reasoning": "why not"},
    ],
    [  # tool calls: arguments go through the tojson filter (non-ASCII must stay as is)
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
]
TEXTS = ["Hello, world!", "你好世界", "In 2024, 12345 people a1b2", "  spaces\n\n\ttabs 😀 é"]


@functools.cache
def hf_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module", params=["qwen3", "smollm2"])
def tokenizers(request, tiny_qwen3_tied_dir, smollm2_dir):
    """(ours, transformers') for one checkpoint directory, and its name."""
    directory = tiny_qwen3_tied_dir if request.param == "qwen3" else smollm2_dir
    return Tokenizer.from_dir(directory), hf_tokenizer(directory), request.param


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_tied_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3_tied_dir)


@pytest.mark.slow  # phase 6's tokenizer, unchanged
def test_encode_matches_transformers(tokenizers):
    ours, theirs, _ = tokenizers
    for text in TEXTS:
        assert ours.encode(text) == theirs(text).input_ids
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text).input_ids)


def test_known_qwen3_ids(qwen3):
    assert qwen3.encode("你好世界") == [108386, 99489]
    assert qwen3.encode("Hello, world!") == [9707, 11, 1879, 0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizers, add_generation_prompt):
    ours, theirs, name = tokenizers
    for messages in CONVERSATIONS + (QWEN3_ONLY if name == "qwen3" else []):
        expected = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_chat_template_kwargs_reach_the_template(qwen3, tiny_qwen3_tied_dir):
    theirs = hf_tokenizer(tiny_qwen3_tied_dir)
    messages = CONVERSATIONS[0]
    prompt = qwen3.apply_chat_template(messages, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    kwargs = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt == theirs.apply_chat_template(messages, **kwargs)


def test_chat_template_with_tools_matches_transformers(qwen3, tiny_qwen3_tied_dir):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    expected = hf_tokenizer(tiny_qwen3_tied_dir).apply_chat_template(
        CONVERSATIONS[1], tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert qwen3.apply_chat_template(CONVERSATIONS[1], tools=tools) == expected


def test_default_system_prompt_of_smollm2(smollm2_dir):
    prompt = Tokenizer.from_dir(smollm2_dir).apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_eos_token_ids(qwen3, smollm2_dir):
    # generation_config.json lists both; tokenizer_config.json's eos_token is <|im_end|>.
    assert qwen3.eos_token_ids == {151645, 151643}
    assert Tokenizer.from_dir(smollm2_dir).eos_token_ids == {2}


VALID_TEXT = st.text(
    st.one_of(
        st.sampled_from(
            list("ab xyz,.!\n") + list("你好世界中文测试") + ["😀", "🎉", "👩", "\u200d", "💻", "é"]
        ),
        st.characters(codec="utf-8"),
    ),
    max_size=30,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=VALID_TEXT, chunks=st.lists(st.integers(1, 3), min_size=1, max_size=8))
def test_incremental_detokenizer_deltas_add_up(qwen3, text, chunks):
    prompt = qwen3.encode("Say:")
    ids = qwen3.encode(text)
    detok = IncrementalDetokenizer(qwen3, prompt)
    deltas, i, step = [], 0, 0
    while i < len(ids):
        size = chunks[step % len(chunks)]
        deltas.append(detok.add_tokens(ids[i : i + size]))
        i, step = i + size, step + 1
    deltas.append(detok.flush())
    assert "".join(deltas) == qwen3.decode(ids) == detok.output_text
    assert not any("\ufffd" in d for d in deltas), "a delta split a multi-byte character"


def test_incremental_detokenizer_holds_back_a_split_character(qwen3):
    ids = qwen3.encode("a🫠")  # the emoji is three tokens
    assert len(ids) == 4, "the test needs a character spread over several tokens"
    detok = IncrementalDetokenizer(qwen3)
    assert [detok.add_tokens([i]) for i in ids] == ["a", "", "", "🫠"]


def test_find_stop_string():
    assert find_stop_string("Hello wor", ["world"], 3) is None
    match = find_stop_string("Hello world! Bye", ["Bye", "world"], 7)
    assert (match.stop, match.index) == ("world", 6)
    # A stop string wholly inside text that was already checked is not found again.
    assert find_stop_string("world and more", ["world"], 4) is None
