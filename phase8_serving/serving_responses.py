"""Responses: OpenAI's newer API, POST /v1/responses, served by the chat machinery.

Problem: the `openai` SDK now leads with `client.responses.create(input=..., instructions=...)`.
A request is a list of typed items (messages, the model's function calls and their outputs,
reasoning); the reply is a list of output items; a stream is a sequence of named events
(`response.created`, `response.output_text.delta`, ..., `response.completed`); and a
conversation can go on from a stored response by its id (`previous_response_id`) instead of
sending it all again.
Idea: a Responses request is a chat in other clothes. Its items become chat messages (a function
call an assistant's `tool_calls`, its output a tool message), its settings a
`ChatCompletionRequest`, which the chat path validates, templates and runs as it runs any chat;
the chat's split of the text into reasoning, content and tool calls (reasoning.py,
tool_calls.py) becomes output items. One builder, `OutputItems`, makes the items from that split
as it arrives: streamed, it also writes each event; whole, it is fed the text at once, so a
stream's final response and the whole response are the same.
Stored responses live in memory: the newest `max_stored_responses`, each with the conversation
that led to it, for GET /v1/responses/{id} and `previous_response_id` (a server restart forgets
them, as vLLM's in-memory store does).

Invariant: every event of a stream carries the next `sequence_number`; the final event's
response holds exactly the text the deltas added up to.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from .async_engine import EngineDeadError, EngineStepError, RequestStream
from .protocol import ChatCompletionRequest, InvalidRequest, ResponsesRequest
from .reasoning import THINK_END, ReasoningStream, reply_parser
from .responses import ChoiceStream, chat_logprobs
from .serving_engine import (
    EngineStreamingResponse,
    FastJSONResponse,
    OpenAIServing,
    check_no_lone_surrogate,
    dumps,
    error_response,
    unless_disconnected,
)
from .streaming import OutputDelta
from .tool_calls import ToolCallStream

logger = logging.getLogger(__name__)
MAX_ITEMS_PAGE = 100  # input items a page lists at most (OpenAI's limit)
Stored = tuple[dict, list[dict], list[dict]]  # (the response, its conversation, its input items)
# chat's names for the fields a Responses request spells otherwise, for errors
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "max_tokens": "max_output_tokens", "response_format": "text",
                     "top_logprobs": "top_logprobs", "logprobs": "include"}  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """The newest `capacity` stored responses, by id, each with the chat messages of its
    conversation (its input and its output, not its instructions: OpenAI does not carry those
    over to the next response) and its own input items, as GET .../input_items lists them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict, messages: list[dict], items: list[dict]) -> None:
        self.entries[response["id"]] = (response, messages, items)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)  # the oldest goes

    def get(
        self, response_id: str, param: str | None = None
    ) -> tuple[dict, list[dict], list[dict]]:
        found = self.entries.get(response_id)
        if found is None:
            raise InvalidRequest(f"Response with id '{response_id}' not found.", param, 404,
                                 "response_not_found")  # fmt: skip
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.entries[response_id]


class SeamTrim:
    """Streamed text without its leading newlines and trailing whitespace, the seams between
    reasoning, content and tool calls: a trailing run is held until text follows it."""

    def __init__(self):
        self.started = False
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip("\n")
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body) :]
        return out


class OutputItems:
    """A response's output items, built from a choice's split text as it arrives; with
    `streaming`, also the events that tell a client so (`take_events`)."""

    def __init__(self, choice: ChoiceStream, streaming: bool):
        self.choice = choice
        self.streaming = streaming
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item text goes into
        self.trim: SeamTrim | None = None  # its seam rule, where the text is split
        self.calls: dict[int, dict] = {}  # function_call items by the chat's call index
        self.events: list[dict] = []
        self.sequence_number = 0

    def emit(self, kind: str, **fields) -> None:
        if self.streaming:
            self.events.append({"type": kind, "sequence_number": self.sequence_number, **fields})
            self.sequence_number += 1

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def feed(self, delta: OutputDelta) -> None:
        """One delta of the choice (already added to it): its reasoning, content and calls."""
        finished = delta.finish_reason is not None
        if not self.choice.splits:
            self._text("message", delta.text, delta.logprobs)
            return
        fields = self.choice.split_delta(delta.text, finished)
        if fields.get("reasoning_content"):
            self._text("reasoning", fields["reasoning_content"], None)
        if fields.get("content"):
            self._text("message", fields["content"], None)
        for call in fields.get("tool_calls", ()):
            self._call(call)

    def _text(self, kind: str, text: str, logprobs) -> None:
        if self.open is not None and self.open["type"] != kind:
            self._close_open()
        if self.open is None:
            if not text and not logprobs:
                return
            self._open(kind)
        if self.trim is not None:
            text = self.trim.feed(text)
        entries = chat_logprobs(self.choice, logprobs)["content"] if logprobs else []
        if not text and not entries:
            return
        part, item = self._part(), self.open
        part["text"] += text
        if kind == "message":
            part["logprobs"] += entries
            self.emit("response.output_text.delta", item_id=item["id"], output_index=self._index(),
                      content_index=0, delta=text, logprobs=entries)  # fmt: skip
        else:
            self.emit("response.reasoning_text.delta", item_id=item["id"],
                      output_index=self._index(), content_index=0, delta=text)  # fmt: skip

    def _part(self) -> dict:
        return self.open["content"][0]

    def _index(self) -> int:
        return len(self.items) - 1

    def _open(self, kind: str) -> None:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "encrypted_content": None, "status": "in_progress"}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        self.trim = SeamTrim() if self.choice.splits else None
        self.emit("response.output_item.added", output_index=self._index(), item=_copy(item))
        item["content"].append(part)
        self.emit("response.content_part.added", item_id=item["id"], output_index=self._index(),
                  content_index=0, part=dict(part, text=""))  # fmt: skip

    def _close_open(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        index = self.items.index(item)
        part = item["content"][0]
        if item["type"] == "message":
            self.emit("response.output_text.done", item_id=item["id"], output_index=index,
                      content_index=0, text=part["text"], logprobs=part["logprobs"])  # fmt: skip
        else:
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                      content_index=0, text=part["text"])  # fmt: skip
        self.emit("response.content_part.done", item_id=item["id"], output_index=index,
                  content_index=0, part=part)  # fmt: skip
        item["status"] = status
        self.emit("response.output_item.done", output_index=index, item=item)

    def _call(self, delta: dict) -> None:
        """A chat tool call delta: a new call (its id and name), or more of its arguments."""
        if self.open is not None:
            self._close_open()
        item = self.calls.get(delta["index"])
        if item is None:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": delta["id"],
                    "name": delta["function"]["name"], "arguments": "",
                    "status": "in_progress"}  # fmt: skip
            self.calls[delta["index"]] = item
            self.items.append(item)
            self.emit("response.output_item.added", output_index=self._index(), item=_copy(item))
        arguments = delta["function"].get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            self.emit("response.function_call_arguments.delta", item_id=item["id"],
                      output_index=self.items.index(item), delta=arguments)  # fmt: skip

    def finish(self, status: str) -> None:
        """Closes every item still open: a message cut by max_output_tokens is "incomplete"."""
        if not self.items:  # nothing said: an empty message, as OpenAI returns one
            self._open("message")
        if self.open is not None:
            self._close_open("incomplete" if status == "incomplete" else "completed")
        for item in self.calls.values():
            index = self.items.index(item)
            self.emit("response.function_call_arguments.done", item_id=item["id"],
                      output_index=index, name=item["name"],
                      arguments=item["arguments"])  # fmt: skip
            item["status"] = "completed"
            self.emit("response.output_item.done", output_index=index, item=item)


def _copy(item: dict) -> dict:
    return {**item, "content": list(item["content"])} if "content" in item else dict(item)


class ResponsesServing:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, on `OpenAIServing`'s chat path."""

    def __init__(self, server: OpenAIServing):
        self.server = server
        self.config = server.config
        self.store = ResponseStore(server.config.max_stored_responses)

    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id)[0]

    def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, after: str | None, limit: int, order: str) -> dict:
        """GET /v1/responses/{id}/input_items: the stored response's own input items (not its
        previous responses'), newest first unless `order` is "asc", `limit` a page, `after` an
        item's id to page on from."""
        if not 1 <= limit <= MAX_ITEMS_PAGE:
            raise InvalidRequest(f"limit must be in [1, {MAX_ITEMS_PAGE}], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise InvalidRequest(f"order must be 'asc' or 'desc', got {order!r}", "order")
        items = self.store.get(response_id)[2]
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequest(f"after: no input item {after!r} in this response", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit}  # fmt: skip

    def _chat(self, body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict]]:
        """The chat this request is, and its conversation's messages (without instructions)."""
        history = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id, "previous_response_id")[1]
        messages = history + body.input_messages()
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            chat = ChatCompletionRequest.model_validate(
                {"model": body.model, "messages": system + messages, **body.chat_fields()}
            )
        except ValidationError as e:  # said in this API's names
            messages, params = [], []
            for error in e.errors():
                loc = [str(part) for part in error.get("loc", ())]
                if loc:
                    loc[0] = CHAT_TO_RESPONSES.get(loc[0], loc[0])
                messages.append(f"{'.'.join(loc)}: {error['msg']}" if loc else error["msg"])
                params.append(loc[0] if loc else None)
            raise InvalidRequest("; ".join(messages), params[0]) from None
        return chat, messages

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        check_no_lone_surrogate(body)
        server = self.server
        server.check_model(body.model)
        server.check_priority(body.priority)
        chat, messages = self._chat(body)
        try:
            prompts = await server.llm.run_in_tokenizer_pool(server.prompt_token_ids, chat)
        except InvalidRequest as e:
            raise InvalidRequest(str(e), CHAT_TO_RESPONSES.get(e.param, e.param)) from None
        choice = ChoiceStream(0, server.tokenizer)
        if chat.tool_mode != "none":
            function = chat.tool_function()
            choice.tools = ToolCallStream(chat.tool_mode, function and function.name,
                                          chat.tool_schemas())  # fmt: skip
        if self.config.reasoning_parser is not None:
            parser = reply_parser(self.config.reasoning_parser, server.tokenizer, prompts[0])
            choice.reasoning = ReasoningStream(parser)
        if body.logprobs and choice.splits:
            raise InvalidRequest(
                "include message.output_text.logprobs is not supported with tools or a "
                "reasoning parser (the logprobs would cover text that is not the message)",
                "include",
            )
        response_id, request_id = server.ids("resp", body, request, sep="_")  # OpenAI's resp_
        if self.config.enable_log_requests:
            logger.info("%s: %d prompt tokens, stream=%s", request_id, len(prompts[0]),
                        bool(body.stream))  # fmt: skip
        try:
            stream = await server.open_requests(request_id, chat, prompts)
        except InvalidRequest as e:
            raise InvalidRequest(str(e), CHAT_TO_RESPONSES.get(e.param, e.param)) from None
        output = OutputItems(choice, bool(body.stream))  # logprobs come if the chat asked
        shell = self._shell(response_id, body)
        if body.stream:
            events = self._events(stream, output, shell, body, prompts[0], messages)
            return EngineStreamingResponse(events, stream, request_id)
        try:
            client_left = await unless_disconnected(request, _collect(stream, output))
        except (EngineStepError, EngineDeadError) as e:
            return error_response(500, f"Internal server error: {e}")
        finally:
            stream.close()
        if client_left:
            return Response(status_code=499)
        return FastJSONResponse(self._finish(shell, output, stream, body, prompts[0], messages))

    def _shell(self, response_id: str, body: ResponsesRequest) -> dict:
        """The response's fields that echo the request, and its status so far."""
        text = body.text.model_dump(by_alias=True) if body.text else {"format": {"type": "text"}}
        tool_choice = body.tool_choice or ("auto" if body.tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.config.model_name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": text,
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in body.tools or ()],
            "top_logprobs": body.top_logprobs,
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def _finish(
        self, shell: dict, output: OutputItems, stream: RequestStream, body: ResponsesRequest,
        prompt: list[int], messages: list[dict],
    ) -> dict:  # fmt: skip
        """The whole response, once the choice has ended; stored if asked."""
        choice = output.choice
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        cut = {"reason": "max_output_tokens"} if status == "incomplete" else None
        output.finish(status)
        cached = stream.collector.num_cached_tokens.get(0, 0)
        response = {
            **shell,
            "status": status,
            "incomplete_details": cut,
            "output": output.items,
            "usage": {
                "input_tokens": len(prompt),
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": len(choice.token_ids),
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(output)},
                "total_tokens": len(prompt) + len(choice.token_ids),
            },
        }
        if body.store:
            self.store.put(response, messages + [_as_message(output.items)], listed_items(body))
        return response

    def _reasoning_tokens(self, output: OutputItems) -> int:
        """The output tokens up to the end of the thoughts (up to the one token `</think>` is,
        where the vocabulary has it; else the reasoning text re-encoded)."""
        items = output.items
        thoughts = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
        if not thoughts:
            return 0
        ids = output.choice.token_ids
        end = self.server.tokenizer.backend.token_to_id(THINK_END)
        if end is not None and end in ids:
            return ids.index(end) + 1
        return len(self.server.tokenizer.encode(thoughts, add_special_tokens=False))

    async def _events(
        self, stream: RequestStream, output: OutputItems, shell: dict, body: ResponsesRequest,
        prompt: list[int], messages: list[dict],
    ) -> AsyncIterator[bytes]:  # fmt: skip
        output.emit("response.created", response=shell)
        output.emit("response.in_progress", response=shell)
        yield _events(output.take_events())
        tail = b""
        try:
            async for deltas in stream:
                for delta in deltas.values():
                    output.choice.add(delta)
                    output.feed(delta)
                if output.events:
                    yield _events(output.take_events())
            response = self._finish(shell, output, stream, body, prompt, messages)
            output.emit(f"response.{response['status']}", response=response)
        except (EngineStepError, EngineDeadError) as e:
            output.emit("error", code="server_error", message=f"Internal server error: {e}",
                        param=None)  # fmt: skip
            failed = {**shell, "status": "failed",
                      "error": {"code": "server_error", "message": str(e)}}  # fmt: skip
            output.emit("response.failed", response=failed)
        finally:
            stream.close()
            tail = _events(output.take_events())
        yield tail


def listed_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as OpenAI lists it: each item with an id (its own, or a new one)
    and a status, a message's text as parts."""
    if isinstance(body.input, str):
        part = {"type": "input_text", "text": body.input}
        return [{"id": new_id("msg"), "type": "message", "role": "user", "content": [part],
                 "status": "completed"}]  # fmt: skip
    listed = []
    for item in body.input:
        fields = item.model_dump(exclude_none=True)
        if item.type == "message" and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            fields["content"] = [{"type": kind, "text": item.content}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}[item.type]  # fmt: skip
        listed.append({**fields, "id": item.id or new_id(prefix), "status": "completed"})
    return listed


def _as_message(items: list[dict]) -> dict:
    """A response's output as the assistant message the chat template renders next time."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += item["content"][0]["text"]
        elif item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }  # fmt: skip
            )
    return message


def _events(events: list[dict]) -> bytes:
    """Server-sent events as OpenAI sends them: each named, no [DONE] at the end."""
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n"
                    for e in events)  # fmt: skip


async def _collect(stream: RequestStream, output: OutputItems) -> None:
    async for deltas in stream:
        for delta in deltas.values():
            output.choice.add(delta)
    choice = output.choice  # fed once with the whole text: the stream's split, in one piece
    output.feed(OutputDelta(choice.text, choice.token_ids, choice.logprobs, choice.finish_reason))
