"""Reasoning (`--reasoning-parser`): a thinking model's <think> text as `reasoning_content`,
whole and streamed, before the content and the tool calls read from it.

Oracles: hand-written replies cut into every possible pair of pieces (the stream must add up to
the whole split and never show part of a tag); through the server, replies forced into a
thinking shape by a regex (structured outputs), so a random model writes them.
"""

import json

import httpx
import pytest

from phase8_serving.api_server import build_app
from phase8_serving.config import ServerConfig
from phase8_serving.reasoning import ReasoningStream, reply_parser
from phase8_serving.responses import ChoiceStream
from phase8_serving.streaming import OutputDelta
from phase8_serving.tool_calls import ToolCallStream

from .conftest import MAX_MODEL_LEN, MODEL_NAME

QWEN3 = "<think>\nFirst, the plan.\n</think>\n\nThe answer."
SPLITS = {  # parser, text -> (reasoning, content)
    ("qwen3", QWEN3): ("First, the plan.", "The answer."),
    ("qwen3", "No thinking here."): (None, "No thinking here."),
    ("qwen3", "<think>\ncut short"): ("cut short", ""),
    ("deepseek_r1", "The plan.</think>The answer."): ("The plan.", "The answer."),
    ("deepseek_r1", "Thoughts, never closed"): ("Thoughts, never closed", ""),
    # Qwen3.5 may call a tool before closing its thoughts: the call ends them, and is content
    ("deepseek_r1", "Plan.<tool_call>x</tool_call>"): ("Plan.", "<tool_call>x</tool_call>"),
}


@pytest.mark.parametrize("parser, text", list(SPLITS))
def test_a_reply_splits_at_the_tags(parser, text):
    assert ReasoningStream(parser).split(text) == SPLITS[parser, text]


@pytest.mark.parametrize("parser, text", list(SPLITS))
def test_any_two_pieces_stream_the_same_split(parser, text):
    whole_reasoning, whole_content = SPLITS[parser, text]
    for cut in range(len(text) + 1):
        stream = ReasoningStream(parser)
        reasoning, content = "", ""
        for piece, last in ((text[:cut], False), (text[cut:], True)):
            r, c = stream.feed(piece, finished=last)
            assert "</" not in r and "<think" not in r + c
            reasoning, content = reasoning + r, content + c
        assert reasoning.strip("\n") == (whole_reasoning or "")
        assert content.lstrip("\n") == whole_content


def test_tool_calls_are_read_from_the_content_after_the_thoughts():
    choice = ChoiceStream(0, tokenizer=None)
    choice.reasoning, choice.tools = ReasoningStream("qwen3"), ToolCallStream("auto")
    text = '<think>\nuse n\n</think>\n\n<tool_call>\n{"name": "n", "arguments": {}}\n</tool_call>'
    fields = [choice.split_delta(text[i : i + 5], finished=i + 5 >= len(text))
              for i in range(0, len(text), 5)]  # fmt: skip
    assert "".join(f.get("reasoning_content", "") for f in fields).strip() == "use n"
    assert not any(f.get("content", "").strip() for f in fields)
    calls = [c for f in fields for c in f.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["n"]
    whole = ChoiceStream(0, tokenizer=None)
    whole.reasoning, whole.tools = ReasoningStream("qwen3"), ToolCallStream("auto")
    whole.add(OutputDelta(text, [], None, "stop"))
    whole.end_chat()
    assert whole.message["reasoning_content"] == "use n" and whole.message["content"] is None
    assert whole.message["tool_calls"][0]["function"]["name"] == "n"
    assert whole.finish_reason == "tool_calls"


def test_the_server_sends_reasoning_content(live_server):
    """With --reasoning-parser qwen3, a reply that thinks (forced by a regex here) comes back as
    reasoning_content and content, whole and streamed; without the flag, all of it is content."""
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, reasoning_parser="qwen3")
    url = live_server.host.serve(build_app(live_server.llm, config))
    thinking = {"regex": "<think>[a-z]{2,5}</think>[a-z]{2,5}"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 27, "seed": 3,
            "temperature": 1.0, "structured_outputs": thinking}  # fmt: skip
    with httpx.Client(base_url=url, timeout=30) as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    reasoning, content = message["reasoning_content"], message["content"]
    assert reasoning.isalpha() and content.isalpha() and 2 <= len(reasoning) <= 5
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    with httpx.Client(base_url=live_server.base_url, timeout=30) as plain:
        message = plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == f"<think>{reasoning}</think>{content}"
    assert "reasoning_content" not in message
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(MODEL_NAME, MAX_MODEL_LEN, reasoning_parser="other")


def test_a_chats_grammar_waits_for_its_thoughts(live_server, sent_params):
    """Under a reasoning parser a chat's structured output starts after `</think>`
    (`StructuredOutputsParams.reasoning`, which the engine's grammar reads); a completion's text
    is never split, so its grammar starts at once."""
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, reasoning_parser="deepseek_r1")
    sent = sent_params
    url = live_server.host.serve(build_app(live_server.llm, config))
    grammar = {"structured_outputs": {"json_object": True}, "max_tokens": 4}
    with httpx.Client(base_url=url, timeout=30) as http:
        chat = {"messages": [{"role": "user", "content": "Hi"}], **grammar}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "Hi", **grammar}).status_code == 200
        free = {**chat, "structured_outputs": None}
        assert http.post("/v1/chat/completions", json=free).status_code == 200
    assert [p.structured_outputs and p.structured_outputs.reasoning for p in sent] == [
        "deepseek_r1",
        None,
        None,
    ]


def test_a_prompt_that_opens_the_thoughts_makes_the_reply_start_inside_them(live_server):
    """Qwen3.5's template ends a thinking prompt with `<think>\\n`: the reply starts inside the
    thoughts, so under --reasoning-parser qwen3 everything before `</think>` is reasoning (as
    deepseek_r1's); a prompt whose think block is closed (thinking off) or absent keeps qwen3's
    rule."""
    tokenizer = live_server.llm.tokenizer
    for tail, parser in (("<think>\n", "deepseek_r1"), ("<think>\n\n</think>\n\n", "qwen3"),
                         ("assistant\n", "qwen3")):  # fmt: skip
        assert reply_parser("qwen3", tokenizer, tokenizer.encode("prompt " + tail)) == parser
    assert reply_parser("deepseek_r1", tokenizer, tokenizer.encode("x")) == "deepseek_r1"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
            "structured_outputs": {"regex": "[a-z]{2}</think>[a-z]{2}"}}  # fmt: skip
    split = {}
    for name, template in (("opened", "{{ messages[0].content }}<think>\n"),
                           ("plain", "{{ messages[0].content }}")):  # fmt: skip
        config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, reasoning_parser="qwen3",
                              chat_template=template)  # fmt: skip
        url = live_server.host.serve(build_app(live_server.llm, config))
        with httpx.Client(base_url=url, timeout=30) as http:
            message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        split[name] = (message.get("reasoning_content"), message["content"])
    reasoning, content = split["opened"]
    assert len(reasoning) == 2 and len(content) == 2 and reasoning.isalpha()
    plain_reasoning, plain_content = split["plain"]  # qwen3's rule: no opening tag, no thoughts
    assert plain_reasoning is None and "</think>" in plain_content
