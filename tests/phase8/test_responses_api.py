"""POST /v1/responses (OpenAI's Responses API) through the `openai` SDK: items in, items out,
named events streamed, conversations stored and continued by id, and 400s for what it cannot do.

Oracles: the same request as a chat (greedy: the same tokens, the same usage), POST /tokenize of
the chat the items should have become (the input token count), the SDK's own event and response
types (every streamed event parses as the type it names), and hand-written replies split at every
point (the streamed items equal the whole ones).
"""

import json

import httpx
import pytest
from openai.types.responses import Response

from phase8_serving.api_server import build_app
from phase8_serving.config import ServerConfig
from phase8_serving.protocol import ResponsesRequest
from phase8_serving.reasoning import ReasoningStream
from phase8_serving.responses import ChoiceStream
from phase8_serving.serving_responses import OutputItems, ResponseStore, SeamTrim
from phase8_serving.streaming import OutputDelta
from phase8_serving.tool_calls import ToolCallStream

from .conftest import MAX_MODEL_LEN, MODEL_NAME, assert_openai_error

GREEDY = {"temperature": 0.0}
JSON = {"content-type": "application/json"}
FLAG = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


def chat(http, messages, **fields) -> dict:
    body = {"messages": messages, **GREEDY, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def count_tokens(http, messages) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def test_a_response_is_the_chat_it_stands_for(client, http):
    """A string input is one user message; instructions a system message before it; the reply
    the chat's, token for token, and its usage the chat's."""
    response = client.responses.create(
        model=MODEL_NAME, input="Hi", instructions="Be brief.", max_output_tokens=6, **GREEDY
    )
    same = chat(http, [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi"}], max_tokens=6)  # fmt: skip
    assert isinstance(response, Response) and response.object == "response"
    assert response.id.startswith("resp_") and response.model == MODEL_NAME
    assert response.output_text == same["choices"][0]["message"]["content"]
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == same["usage"]["completion_tokens"]
    assert response.usage.total_tokens == same["usage"]["total_tokens"]
    finished = same["choices"][0]["finish_reason"]
    assert response.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    assert response.instructions == "Be brief." and response.max_output_tokens == 6


def test_a_stream_adds_up_to_the_whole_response(client):
    """Every event parses as the SDK type it names, sequence numbers count up from 0, the text
    deltas add up to the done text and to the non-streamed response's."""
    request = {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 8, **GREEDY}
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.id != whole.id
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)  # fmt: skip
    # the same prompt again: its full blocks were found in the prefix cache
    assert final.usage.input_tokens_details.cached_tokens > 0


def test_a_conversation_goes_on_from_a_stored_response(client, http):
    """previous_response_id: the stored conversation (input and reply, not its instructions)
    comes before the new input; GET returns the stored response; DELETE forgets it."""
    first = client.responses.create(model=MODEL_NAME, input="A", instructions="S",
                                    max_output_tokens=2, **GREEDY)  # fmt: skip
    second = client.responses.create(model=MODEL_NAME, input="B", previous_response_id=first.id,
                                     max_output_tokens=2, **GREEDY)  # fmt: skip
    history = [{"role": "user", "content": "A"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "B"}]  # fmt: skip
    assert second.usage.input_tokens == count_tokens(http, history)
    assert second.previous_response_id == first.id and second.instructions is None
    assert client.responses.retrieve(first.id).output_text == first.output_text
    http.delete(f"/v1/responses/{first.id}").raise_for_status()
    assert_openai_error(http.get(f"/v1/responses/{first.id}"), 404)
    gone = {"input": "B", "previous_response_id": first.id}
    assert_openai_error(http.post("/v1/responses", json=gone), 404, "previous_response_id")
    unstored = client.responses.create(model=MODEL_NAME, input="A", store=False,
                                       max_output_tokens=1)  # fmt: skip
    assert_openai_error(http.get(f"/v1/responses/{unstored.id}"), 404)


def test_a_stored_responses_input_items_are_listed(client, http):
    """GET /v1/responses/{id}/input_items (the SDK's `responses.input_items.list`): the
    response's own input (not its predecessors'), each item with an id, newest first, in pages."""
    history = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
               {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                "text": "C"}]}]  # fmt: skip
    first = client.responses.create(model=MODEL_NAME, input=history, max_output_tokens=1)
    short = client.responses.create(model=MODEL_NAME, input="A", max_output_tokens=1)
    second = client.responses.create(model=MODEL_NAME, input="D", previous_response_id=short.id,
                                     max_output_tokens=1)  # fmt: skip
    listed = client.responses.input_items.list(first.id, order="asc")
    assert [(i.role, i.content[0].text) for i in listed.data] == [
        ("user", "A"), ("assistant", "B"), ("user", "C")]  # fmt: skip
    assert all(i.id for i in listed.data) and not listed.has_more
    newest = client.responses.input_items.list(first.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["C", "B"] and newest.has_more
    rest = client.responses.input_items.list(first.id, limit=2, after=newest.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["A"]
    (own,) = client.responses.input_items.list(second.id).data
    assert own.content[0].text == "D"
    assert_openai_error(http.get(f"/v1/responses/{first.id}/input_items?limit=0"), 400, "limit")
    assert_openai_error(http.get(f"/v1/responses/{first.id}/input_items?after=x"), 400, "after")
    assert_openai_error(http.get("/v1/responses/resp_none/input_items"), 404)


def test_function_calls_and_their_outputs_are_chat_messages(client, http):
    """A named tool choice comes back as a function_call item whose arguments fit the schema
    (streamed as argument deltas); sent back with its output, the two are the chat's assistant
    tool call and tool message."""
    tool = {"type": "function", "name": "f", "parameters": FLAG}
    request = {"model": MODEL_NAME, "input": "Q", "tools": [tool], "max_output_tokens": 24,
               "tool_choice": {"type": "function", "name": "f"}, **GREEDY}  # fmt: skip
    response = client.responses.create(**request)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "f"
    assert set(json.loads(call.arguments)) == {"a"}
    events = list(client.responses.create(**request, stream=True))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == call.arguments and done.name == "f"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}
    history = [{"type": "message", "role": "user", "content": "Q"},
               call.model_dump(exclude_none=True), output]  # fmt: skip
    after = client.responses.create(model=MODEL_NAME, input=history, max_output_tokens=1)
    as_chat = [{"role": "user", "content": "Q"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": "f", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "ok"}]  # fmt: skip
    assert after.usage.input_tokens == count_tokens(http, as_chat)


def test_text_format_and_logprobs(client, http):
    """text.format json_schema constrains the reply as response_format does; logprobs come back
    only when include asks, the chat's."""
    schema = {"format": {"type": "json_schema", "name": "flag", "schema": FLAG}}
    response = client.responses.create(model=MODEL_NAME, input="Q", text=schema,
                                       max_output_tokens=24, **GREEDY)  # fmt: skip
    assert set(json.loads(response.output_text)) == {"a"}
    request = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, "top_logprobs": 2,
               **GREEDY}  # fmt: skip
    plain = client.responses.create(**request)
    assert plain.output[0].content[0].logprobs == []
    scored = client.responses.create(**request, include=["message.output_text.logprobs"])
    same = chat(http, [{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True,
                top_logprobs=2)  # fmt: skip
    entries = [e.model_dump() for e in scored.output[0].content[0].logprobs]
    assert entries == same["choices"][0]["logprobs"]["content"]
    streamed = client.responses.create(**request, include=["message.output_text.logprobs"],
                                       stream=True)  # fmt: skip
    pieces = [lp.model_dump() for e in streamed if e.type == "response.output_text.delta"
              for lp in e.logprobs]  # fmt: skip
    assert pieces == entries


REFUSED = [  # body fields -> the param the 400 names
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input",
    ),
    ({"input": [{"type": "web_search_call", "id": "1"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, None),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
    ({"input": "x" * MAX_MODEL_LEN}, "input"),
    ({"temperature": 3.0}, "temperature"),
    ({"stream_options": {"include_obfuscation": False}}, None),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"n": 2}, "n"),
    ({"instructions": "\ud800"}, "instructions"),  # sent escaped: the JSON is valid
]


@pytest.mark.parametrize("fields, param", REFUSED)
def test_what_it_cannot_do_is_a_400_naming_the_field(http, fields, param):
    body = json.dumps({"input": "Hi", "max_output_tokens": 2, **fields})  # ASCII, escaped
    response = http.post("/v1/responses", content=body, headers=JSON)
    assert_openai_error(response, 400, param)


def test_after_hostile_requests_the_server_still_answers(http):
    for fields, _ in REFUSED:
        http.post("/v1/responses", content=json.dumps({"input": "Hi", **fields}),
                  headers=JSON)  # fmt: skip
    assert_openai_error(http.post("/v1/responses", json={"model": "other", "input": "Hi"}), 404)
    response = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 3})
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] >= 1


def test_the_store_keeps_the_newest(live_server):
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": str(i)}, [], [])
    assert list(store.entries) == ["1", "2"]
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, max_stored_responses=0)
    url = live_server.host.serve(build_app(live_server.llm, config))
    with httpx.Client(base_url=url, timeout=30) as http:
        created = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1}).json()
        assert_openai_error(http.get(f"/v1/responses/{created['id']}"), 404)
    with pytest.raises(ValueError, match="max_stored_responses"):
        ServerConfig(MODEL_NAME, MAX_MODEL_LEN, max_stored_responses=-1)


THINKING = (
    '<think>\nplan\n</think>\n\nLet me see.\n<tool_call>\n{"name": "f", "arguments": {}}\n'
    "</tool_call>"
)


def items_of(pieces: list[str], streaming: bool) -> tuple[list[dict], list[dict]]:
    choice = ChoiceStream(0, tokenizer=None)
    choice.reasoning, choice.tools = ReasoningStream("qwen3"), ToolCallStream("auto")
    output = OutputItems(choice, streaming)
    for i, piece in enumerate(pieces):
        delta = OutputDelta(piece, [], None, "stop" if i == len(pieces) - 1 else None)
        choice.add(delta)
        output.feed(delta)
    output.finish("completed")
    return output.items, output.take_events()


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_reasoning_content_and_calls_become_items_however_the_text_is_cut():
    """A thinking reply with a tool call: a reasoning item, a message, a function call, the
    seams' newlines trimmed; cut into any two pieces, streamed, the same items and events whose
    deltas add up to them."""
    whole, _ = items_of([THINKING], streaming=False)
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"][0]["text"] == "plan"
    assert whole[1]["content"][0]["text"] == "Let me see."
    assert (whole[2]["name"], whole[2]["arguments"]) == ("f", "{}")
    for cut in range(len(THINKING) + 1):
        items, events = items_of([THINKING[:cut], THINKING[cut:]], streaming=True)
        assert without_ids(items) == without_ids(whole), cut
        for index, item in enumerate(items):
            deltas = "".join(e["delta"] for e in events if e.get("output_index") == index
                             and e["type"].endswith(".delta"))  # fmt: skip
            call = item["type"] == "function_call"
            text = item["arguments"] if call else item["content"][0]["text"]
            assert deltas == text, (cut, index)


def test_seam_trim_holds_a_trailing_run_until_text_follows():
    trim = SeamTrim()
    assert [trim.feed(t) for t in ["\n\n", "a \n", "\n", "b", " "]] == ["", "a", "", " \n\nb", ""]


HOSTILE = [None, -1, 0, 1, 2**63, -(2**63) - 1, 1e308, float("nan"), float("inf"), True, "x", "",
           "\x00", [], [1], ["x"], [[]], [None], {}, {"a": 1}, {"type": "x"},
           {"type": "function", "name": "f"}, {"format": {"type": "json_object"}},
           [{"type": "function", "name": "f"}], [{"role": "user", "content": "hi"}],
           [{"type": "input_text", "text": "hi"}], "a" * 70000]  # fmt: skip
ITEM_BASES = {
    "message": {"role": "user", "content": "hi"},
    "function_call": {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    "function_call_output": {"type": "function_call_output", "call_id": "c", "output": "o"},
    "reasoning": {"type": "reasoning", "summary": []},
}


def hostile_bodies():
    """Every request field and every input item field at each hostile value (streamed too)."""
    base = {"input": "hi", "max_output_tokens": 3, "temperature": 0}
    for field in ResponsesRequest.model_fields:
        for value in HOSTILE:
            yield {**base, field: value}
            yield {**base, field: value, "stream": True}
    keys = ("type", "role", "content", "call_id", "name", "arguments", "output", "summary", "id",
            "status", "encrypted_content")  # fmt: skip
    for item in ITEM_BASES.values():
        for key in keys:
            for value in HOSTILE:
                yield {**base, "input": [{"role": "user", "content": "q"}, {**item, key: value}]}


def test_hostile_bodies_get_no_server_error(http):
    """About 3,000 bodies a careless or hostile client could send: each a 2xx or a 4xx in
    OpenAI's shape, a stream that is answered ends in response.completed or .incomplete, and
    the server answers correctly afterwards."""
    server_errors = []
    for body in hostile_bodies():
        reply = http.post("/v1/responses", content=json.dumps(body, allow_nan=True), headers=JSON)
        if reply.status_code >= 500 or "Traceback" in reply.text:
            server_errors.append((body, reply.status_code, reply.text[:200]))
        elif reply.status_code == 200 and body.get("stream") is True:
            assert "event: response.completed" in reply.text or (
                "event: response.incomplete" in reply.text)  # fmt: skip
        elif reply.status_code != 200:
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert not server_errors, server_errors[:5]
    after = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 3})
    assert after.status_code == 200 and after.json()["usage"]["output_tokens"] >= 1
