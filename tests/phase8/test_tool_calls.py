"""Tool calls: Hermes blocks parsed (whole and streamed), named and required calls generated under
their schemas, the server's fields, history and 400s.

Oracles: hand-written replies with known calls; a named call's arguments, which must parse and
match the function's schema (a random model writes them only under the grammar); the streamed
pieces, which must add up to the whole response.
"""

import json
import re
from types import SimpleNamespace

import httpx
import pytest

from phase8_serving.api_server import build_app
from phase8_serving.config import ServerConfig
from phase8_serving.protocol import ChatCompletionRequest
from phase8_serving.serving_engine import OpenAIServing
from phase8_serving.tokenizer import Tokenizer
from phase8_serving.tool_calls import ToolCallStream, parse_hermes, parse_required
from tests import assets

from .conftest import MODEL_NAME, assert_openai_error

# short enough for the tiny server's context (48 byte tokens; a chat prompt takes 21)
WEATHER = {"type": "object", "properties": {"c": {"enum": ["P", "O"]}, "d": {"type": "boolean"}},
           "required": ["c", "d"]}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "w", "description": "weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "n"}},
]
MESSAGES = [{"role": "user", "content": "Hi"}]
REPLY = ('Let me check.\n<tool_call>\n{"name": "w", "arguments": {"c": "P", "d": true}}\n'
         '</tool_call>\n<tool_call>\n{"name": "n", "arguments": "{}"}\n</tool_call>')  # fmt: skip


def test_hermes_blocks_become_content_and_calls():
    content, calls = parse_hermes(REPLY)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("w", {"c": "P", "d": True}), ("n", {})]  # fmt: skip
    assert len({c["id"] for c in calls}) == 2
    assert parse_hermes("no calls here") is None
    assert parse_hermes("<tool_call>{not json}</tool_call>") is None
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>') is None  # no name


@pytest.mark.parametrize("pieces", [[REPLY], list(REPLY), [REPLY[:14], REPLY[14:20], REPLY[20:]]])
def test_a_stream_sends_the_content_and_then_the_calls(pieces):
    """However the text is cut, the content goes out before the first tag (never a piece of the
    tag), and the calls once the choice ends."""
    stream = ToolCallStream("auto")
    sent, calls = "", []
    for i, piece in enumerate(pieces):
        content, new_calls = stream.feed(piece, finished=i == len(pieces) - 1)
        assert "<" not in content
        sent += content
        calls += new_calls
    assert sent.rstrip() == "Let me check."  # a newline before the tag may already be out
    assert [c["function"]["name"] for c in calls] == ["w", "n"] and stream.called


# Qwen3.5's (and Qwen3-Coder's) format: XML in the same tags, each value read by its schema
XML_REPLY = (
    "Checking.\n<tool_call>\n<function=w>\n<parameter=c>\nP\n</parameter>\n"
    "<parameter=d>\ntrue\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=n>\n</function>\n</tool_call>"
)
SCHEMAS = {"w": WEATHER, "n": None}


def test_xml_blocks_become_calls_with_values_typed_by_the_schema():
    content, calls = parse_hermes(XML_REPLY, SCHEMAS)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("w", {"c": "P", "d": True, "extra": [1, 2]}), ("n", {})]  # fmt: skip
    numbers = {"type": "object", "properties": {"i": {"type": "integer"}, "x": {"type": "number"},
                                                "s": {"type": "string"}}}  # fmt: skip
    text = ("<tool_call><function=f><parameter=i>7</parameter><parameter=x>2.5</parameter>"
            "<parameter=s>\n007\n</parameter><parameter=i2>eight</parameter></function>"
            "</tool_call>")  # fmt: skip
    (call,) = parse_hermes(text, {"f": numbers})[1]
    assert json.loads(call["function"]["arguments"]) == {"i": 7, "x": 2.5, "s": "007",
                                                         "i2": "eight"}  # fmt: skip
    assert parse_hermes("<tool_call><function=f><parameter=a>1</tool_call>") is None  # cut short
    assert parse_hermes("<tool_call><function=f></function>trailing</tool_call>") is None


@pytest.mark.parametrize("cut", range(0, len(XML_REPLY) + 1, 7))
def test_an_xml_stream_sends_the_content_and_then_the_calls(cut):
    stream = ToolCallStream("auto", schemas=SCHEMAS)
    first, _ = stream.feed(XML_REPLY[:cut], finished=False)
    rest, calls = stream.feed(XML_REPLY[cut:], finished=True)
    assert (first + rest).rstrip() == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"c": "P", "d": True, "extra": [1, 2]}, {}]  # fmt: skip


def test_text_that_only_looks_like_a_tag_is_released():
    stream = ToolCallStream("auto")
    assert stream.feed("a <to", finished=False) == ("a ", [])  # may begin <tool_call>
    assert stream.feed("day", finished=False) == ("<today", [])
    assert stream.feed(" <tool_call>{oops", finished=False) == (" ", [])
    assert stream.feed("</tool_call>", finished=True) == ("<tool_call>{oops</tool_call>", [])
    assert not stream.called  # no call: everything is content


def test_named_and_required_replies():
    named = ToolCallStream("named", "w")
    content, calls = named.message('{"c":"P","d":false}')
    assert content is None and calls[0]["function"] == {
        "name": "w",
        "arguments": '{"c":"P","d":false}',
    }
    assert not named.called  # a forced call ends "stop", as OpenAI's
    calls = parse_required(
        '[{"name":"w","parameters":{"c":"O","d":true}},{"name":"n","parameters":{}}]'
    )
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("w", '{"c": "O", "d": true}'), ("n", "{}")]  # fmt: skip
    assert parse_required('[{"name":"w","param') is None  # cut by max_tokens


def test_required_calls_follow_parallel_tool_calls():
    """`required` is an array of calls; parallel_tool_calls=false makes it one call."""
    from phase8_serving import structured_output as so

    def accepts(parallel, text):
        body = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=parallel)  # fmt: skip
        params = body.structured_outputs_params()
        grammar = so.Grammar(so.compile_spec(params.kind, params.spec), so.Vocabulary({}, 8))
        state = grammar.start
        for byte in text.encode():
            state = grammar.advance(state, byte)
        return () in state

    two = '[{"name":"n","parameters":{}},{"name":"w","parameters":{"c":"P","d":true}}]'
    assert accepts(None, two) and accepts(True, two) and not accepts(False, two)
    assert accepts(False, '[{"name":"n","parameters":{}}]')
    assert not accepts(None, '[{"name":"x","parameters":{}}]')  # not a tool
    assert not accepts(None, "[]")  # at least one


def test_tools_reach_the_chat_template():
    """Qwen3's template lists the tools in a system turn and renders a history's calls and
    tool results."""
    tokenizer = Tokenizer.from_dir(assets.qwen3_tokenizer_dir())
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    body = ChatCompletionRequest(messages=history, tools=TOOLS)
    text = OpenAIServing._render_chat(SimpleNamespace(tokenizer=tokenizer), body)
    assert "<tools>" in text and '"name": "w"' in text and '"description": "weather"' in text
    assert '<tool_call>\n{"name": "w", "arguments": {"c": "P"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


# -- through the server ------------------------------------------------------------------------


def chat(http, **body) -> httpx.Response:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 27, "temperature": 1.0, **body}
    return http.post("/v1/chat/completions", json=body)


NAMED = {"type": "function", "function": {"name": "w"}}


def test_a_named_call_is_the_functions_arguments(http):
    response = chat(http, tool_choice=NAMED, n=3, seed=4)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        message = choice["message"]
        assert message["content"] is None and choice["finish_reason"] == "stop"
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "w" and arguments["c"] in ("P", "O")
        assert isinstance(arguments["d"], bool)


def test_a_streamed_named_call_adds_up_to_the_response(http):
    whole = chat(http, tool_choice=NAMED, seed=9).json()["choices"][0]["message"]
    streamed = chat(http, tool_choice=NAMED, seed=9, stream=True)
    deltas = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "w" and calls[0]["id"].startswith("chatcmpl-tool-")
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert arguments == whole["tool_calls"][0]["function"]["arguments"]
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "stop"


def test_a_required_call_cut_short_keeps_its_text(http):
    """`required` generates a JSON array of calls; this context is too short for one, and what
    was written stays the content (nothing invented), the finish reason 'length'."""
    choice = chat(http, tool_choice="required", seed=1).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith('[{"name":')


def test_tool_choice_none_and_a_history_of_calls(http):
    message = chat(http, tool_choice="none", max_tokens=3).json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"}]  # fmt: skip
    response = chat(http, messages=history, max_tokens=3)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["tool_calls"] == []  # auto: nothing parsed


BAD = {
    "no tools to call": ({"tools": [], "tool_choice": "required"}, "no tools"),
    "auto without tools": ({"tools": None, "tool_choice": "auto"}, "only allowed when tools"),
    "an unknown name": ({"tool_choice": {"type": "function", "function": {"name": "x"}}},
                        "not among the tools"),
    "with response_format": ({"tool_choice": NAMED, "response_format": {"type": "json_object"}},
                             "cannot be combined"),
    "a bad function name": ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                            "tools"),
    "a schema it cannot enforce": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "a+"}}}}}], "tool_choice": "required"}, "'pattern'"),
    "functions": ({"functions": [{"name": "f"}]}, "functions"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_requests_are_400s(http, case):
    body, words = BAD[case]
    error = assert_openai_error(chat(http, **body), 400)
    assert words in error["message"], error["message"]
    assert chat(http, tools=None, max_tokens=2).status_code == 200  # still serving


def test_the_server_reads_an_xml_call_by_its_tools_schema(live_server):
    """A Qwen3.5-style reply (forced by a regex: a random model writes it only so) comes back as
    a call whose values are typed by the request's tool schema (`s` the string "7", not 7)."""
    typed = {"type": "object", "properties": {"s": {"type": "string"}, "d": {"type": "boolean"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": typed}}]
    config = ServerConfig(MODEL_NAME, 128, chat_template="{{ messages[0].content }}")  # 128: the
    url = live_server.host.serve(build_app(live_server.llm, config))  # model's whole context
    reply = "<tool_call><function=f><parameter=s>7</parameter><parameter=d>true</parameter>"
    reply += "</function></tool_call>"
    body = {"messages": MESSAGES, "tools": tools, "max_tokens": 120,
            "structured_outputs": {"regex": re.escape(reply)}}  # fmt: skip
    with httpx.Client(base_url=url, timeout=60) as http:
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and choice["finish_reason"] == "tool_calls"
    assert json.loads(call["function"]["arguments"]) == {"s": "7", "d": True}
    live_server.wait_until_idle(timeout=2.0)
