"""Serving: one OpenAI request from its validated body to its response (vLLM's `OpenAIServing`).

Problem: between the routes (api_server.py) and the engine (`AsyncLLM`) sits the work every
completion and chat request shares: check what the client sent, turn it into token ids and
`SamplingParams`, open its engine requests, and carry the results back, either at once (a JSON
body) or step by step as server-sent events (`data: {chunk}\n\n` ... `data: [DONE]\n\n`),
closing its engine requests however that ends.
Idea: `OpenAIServing` is vLLM's `OpenAIServing` with its completion and chat subclasses in one:
the two endpoints differ only in how the prompt is made (a chat template) and how the JSON is
shaped (responses.py).

Nothing one client sends stalls the others: more than `max_choices_per_request` prompts x n is
a 400 before any tokenizing; tokenizing and chat templates run in the front end's thread pool,
never on the event loop; every prompt of a request enters the engine in one message and leaves
it in one abort. A streamed step is one write per HTTP request (every choice's chunk of that
step together), its JSON made by orjson or msgspec where installed.

Invariants:
- every request this server opened in the engine is closed when its handler ends, however it
  ends (done, error, client gone): `RequestStream.close()` aborts it and frees its KV blocks; a
  client that leaves is one log line, not a traceback;
- usage counts are the token ids the engine received and produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .async_engine import (
    AsyncLLM,
    EngineDeadError,
    EngineStepError,
    RequestStream,
    check_prompt,
)
from .beam_search import BeamSearch, BeamSearchParams
from .config import ServerConfig, check_priority
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InvalidRequest,
    SamplingRequest,
    TokenizeRequest,
    error_body,
)
from .reasoning import ReasoningStream, reply_parser
from .responses import (
    ChoiceStream,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    usage,
    usage_chunk,
)
from .streaming import OutputDelta
from .tool_calls import ToolCallStream

logger = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # protocol.RequestId's rule, for the header

try:  # the fastest JSON encoder installed: orjson, then msgspec, then the standard library
    import orjson

    dumps = orjson.dumps
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import msgspec

        dumps = msgspec.json.encode
    except ImportError:

        def dumps(payload) -> bytes:
            return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


class FastJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return dumps(content)


class ErrorResponse(JSONResponse):
    """ASCII-escaped JSON: an error may quote anything a client sent, a lone surrogate too."""

    def render(self, content) -> bytes:
        return json.dumps(content).encode()


def error_response(status: int, message: str, param: str | None = None, code=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorResponse(error_body(message, kind, param, code), status_code=status)


class OpenAIServing:
    """The handlers' shared work: prompts to token ids, requests into the engine, results out."""

    def __init__(self, llm: AsyncLLM, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        if config.chat_template is not None:  # --chat-template: the front end renders chats
            self.tokenizer = copy.copy(llm.tokenizer)
            self.tokenizer.chat_template = config.chat_template

    def check_model(self, model: str | None) -> None:
        config = self.config
        if model is not None and model != config.model_name and model not in config.model_aliases:
            raise InvalidRequest(
                f"The model `{model}` does not exist.", "model", 404, "model_not_found"
            )

    def ids(self, kind: str, body, request: Request, sep: str = "-") -> tuple[str, str]:
        """-> (the response's id, this server's own id for the request: its engine requests'
        and its log lines'). A client may name the request (vLLM's X-Request-Id header, or the
        body's `request_id`): the response's id is then "<kind><sep><name>", and the server's
        id that with a random suffix, as two requests may share a name."""
        own = uuid.uuid4().hex
        name = request.headers.get("x-request-id") or body.request_id
        if name is None:
            return f"{kind}{sep}{own}", f"{kind}{sep}{own}"
        if not REQUEST_ID.fullmatch(name):
            raise InvalidRequest("X-Request-Id must be 1 to 256 printable ASCII characters",
                                 "request_id")  # fmt: skip
        return f"{kind}{sep}{name}", f"{kind}{sep}{name}-{own[:12]}"

    def check_priority(self, priority: int) -> None:
        """Before any tokenizing: a priority other than 0 needs --scheduling-policy priority."""
        try:
            check_priority(priority, self.llm.info.scheduling_policy)
        except ValueError as e:
            raise InvalidRequest(str(e), "priority") from None

    async def serve(self, body: SamplingRequest, request: Request) -> Response:
        check_no_lone_surrogate(body)  # before anything quotes the client's text back
        self.check_model(body.model)
        self.check_priority(body.priority)
        chat = isinstance(body, ChatCompletionRequest)
        num_choices = body.n * (1 if chat else len(body.prompts()))
        if num_choices > self.config.max_choices_per_request:
            raise InvalidRequest(
                f"This request asks for {num_choices} completions (prompts x n); the server "
                f"allows {self.config.max_choices_per_request} (--max-choices-per-request).",
                "n" if chat else "prompt",
            )
        if isinstance(body, CompletionRequest) and body.has_token_ids:
            prompts = self.prompt_token_ids(body)  # nothing to tokenize: no hop to a thread
        else:
            prompts = await self.llm.run_in_tokenizer_pool(self.prompt_token_ids, body)
        response_id, request_id = self.ids("chatcmpl" if chat else "cmpl", body, request)
        if not body.echo:
            echoed = None
        elif chat:  # vLLM's: the final message's content, if the reply goes on in its role
            final = body.messages[-1]
            echoed = [final.text() if final.role == "assistant" else ""]
        else:
            echoed = await self._echoed(body, prompts)
        if self.config.enable_log_requests:
            logger.info("%s: %d prompt tokens, %d choices, stream=%s", request_id,
                        sum(map(len, prompts)), num_choices, bool(body.stream))  # fmt: skip
        echo_logprobs = body.logprobs if echoed is not None and not chat else None
        choices = []
        for i in range(num_choices):
            prompt = prompts[i // body.n]
            echo = None if echoed is None else (echoed[i // body.n], prompt)
            choices.append(
                ChoiceStream(i, self.tokenizer, prompt if body.return_token_ids else None,
                             bool(body.return_tokens_as_token_ids), echo, echo_logprobs,
                             body.prompt_logprobs)
            )  # fmt: skip
            if chat and body.tool_mode != "none":
                function = body.tool_function()
                choices[-1].tools = ToolCallStream(body.tool_mode, function and function.name,
                                                   body.tool_schemas())  # fmt: skip
            if chat and self.config.reasoning_parser is not None:
                parser = reply_parser(self.config.reasoning_parser, self.tokenizer, prompt)
                choices[-1].reasoning = ReasoningStream(parser)
        meta = {"id": response_id, "created": int(time.time()), "model": self.config.model_name}
        if body.use_beam_search:
            return await self._beam_search(request_id, body, prompts, choices, meta, request)
        stream = await self.open_requests(request_id, body, prompts)  # closed however this ends
        if body.stream:
            events = self._events(stream, choices, meta, body, prompts, chat)
            return EngineStreamingResponse(events, stream, request_id)
        try:
            client_left = await unless_disconnected(request, _collect(stream, choices))
        except (EngineStepError, EngineDeadError) as e:
            return error_response(500, f"Internal server error: {e}")
        finally:
            stream.close()
        if client_left:
            logger.info("%s: the client disconnected; its requests were aborted", request_id)
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        for choice in choices:
            if choice.splits:
                choice.end_chat()
        build = chat_response if chat else completion_response
        cached = self._cached_tokens(stream, body, range(len(prompts)))
        return FastJSONResponse(build(meta, choices, usage(prompts, choices, cached)))

    async def _beam_search(
        self, request_id: str, body: SamplingRequest, prompts: list[list[int]],
        choices: list[ChoiceStream], meta: dict, request: Request,
    ) -> Response:  # fmt: skip
        """`use_beam_search`: each prompt's n likeliest continuations, best first (choice i of
        prompt p is its i-th beam), answered as any response is; never streamed, since which
        beams are best is known only at the end."""
        searches = []
        for prompt in prompts:
            max_tokens = body.sampling_params(len(prompt), self.config.max_model_len, 0).max_tokens
            params = BeamSearchParams(body.n, max_tokens, body.ignore_eos, body.length_penalty)
            try:  # the engine's checks at the longest a beam gets, before a step is sent
                check_prompt(self.llm.info, prompt, replace(params.step_params(),
                                                            max_tokens=max_tokens))  # fmt: skip
            except ValueError as e:
                raise InvalidRequest(str(e)) from e
            searches.append(BeamSearch(prompt, params, self.tokenizer.eos_token_ids))
        try:
            search = self._search(request_id, searches, body.priority)
            client_left = await unless_disconnected(request, search)
        except (EngineStepError, EngineDeadError) as e:
            return error_response(500, f"Internal server error: {e}")
        if client_left:
            logger.info("%s: the client disconnected; its requests were aborted", request_id)
            return Response(status_code=499)
        decode = functools.partial(self.tokenizer.decode,
                                   skip_special_tokens=body.skip_special_tokens)  # fmt: skip
        for p, search in enumerate(searches):
            for i, beam in enumerate(search.result(decode).sequences):
                delta = OutputDelta(beam.text, beam.output_token_ids, None, beam.finish_reason)
                choices[p * body.n + i].add(delta)
        for choice in choices:
            if choice.splits:
                choice.end_chat()
        build = chat_response if isinstance(body, ChatCompletionRequest) else completion_response
        return FastJSONResponse(build(meta, choices, usage(prompts, choices)))

    async def _search(self, request_id: str, searches: list[BeamSearch], priority: int) -> None:
        """Beam search's steps: every running beam of every prompt a one-token request, all in
        one batch, then each search keeps its best."""
        step = searches[0].params.step_params()
        for number in itertools.count():
            running = [s for s in searches if not s.done]
            if not running:
                return
            beams = [beam.tokens for s in running for beam in s.beams]
            stream = await self.llm.add_requests(f"{request_id}-{number}", beams,
                                                 [step] * len(beams), priority)  # fmt: skip
            candidates: dict[int, tuple] = {}
            try:
                async for deltas in stream:
                    for index, delta in deltas.items():
                        if delta.logprobs:
                            candidates[index] = delta.logprobs[0].top_logprobs
            finally:
                stream.close()  # a cancelled search (the client left) aborts its requests
            ordered = iter(candidates[i] for i in range(len(beams)))
            for search in running:
                search.advance([next(ordered) for _ in search.beams])

    def prompt_token_ids(self, body: SamplingRequest) -> list[list[int]]:
        """Runs in the tokenizer pool: templates and tokenizing can take seconds on big input
        (token ids alone are checked on the event loop: a hop to a thread cost more)."""
        tok, chat = self.tokenizer, isinstance(body, ChatCompletionRequest)
        special = not chat if body.add_special_tokens is None else body.add_special_tokens
        if chat:
            prompts = tok.encode_batch([self._render_chat(body)], add_special_tokens=special)
        else:
            prompts = body.prompts()
            texts = [p for p in prompts if isinstance(p, str)]
            encoded = iter(tok.encode_batch(texts, add_special_tokens=special) if texts else [])
            prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
        if body.truncate_prompt_tokens is not None:
            keep = body.truncate_prompt_tokens
            keep = self.config.max_model_len if keep == -1 else keep
            if keep > self.config.max_model_len:
                raise InvalidRequest(
                    f"truncate_prompt_tokens ({keep}) exceeds max_model_len "
                    f"({self.config.max_model_len})", "truncate_prompt_tokens",
                )  # fmt: skip
            if body.truncation_side == "right":
                prompts = [p[:keep] for p in prompts]
            else:
                prompts = [p[len(p) - keep :] if len(p) > keep else p for p in prompts]
        if not all(prompts):
            raise InvalidRequest("the prompt must contain at least one token", "prompt")
        return prompts

    def _cached_tokens(
        self, stream: RequestStream, body: SamplingRequest, prompt_indices
    ) -> int | None:
        """These prompts' tokens found in the prefix cache (each prompt's first choice's, when it
        was first admitted), if the server reports them (--enable-prompt-tokens-details)."""
        if not self.config.enable_prompt_tokens_details:
            return None
        found = stream.collector.num_cached_tokens
        return sum(found.get(p * body.n, 0) for p in prompt_indices)

    async def _echoed(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """`echo`: each prompt's text, as sent, or decoded from its token ids (in the pool), as
        truncated (truncate_prompt_tokens)."""
        if not body.has_token_ids and body.truncate_prompt_tokens is None:
            return body.prompts()
        return await self.llm.run_in_tokenizer_pool(
            lambda: [self.tokenizer.decode(p) for p in prompts]
        )

    def _render_chat(self, body: ChatCompletionRequest | TokenizeRequest) -> str:
        messages = [m.for_template() for m in body.messages]
        tools = getattr(body, "tools", None)  # /tokenize takes none
        try:
            return self.tokenizer.apply_chat_template(
                messages, body.add_generation_prompt,
                tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                continue_final_message=body.continue_final_message, tokenize=False,
                **(body.chat_template_kwargs or {}),
            )  # fmt: skip
        except Exception as e:  # the template is code we run on the client's input
            raise InvalidRequest(f"the chat template failed: {e}", "messages") from e

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """POST /tokenize: the token ids a completion or chat request with this prompt would
        send the engine (and how many the server allows, prompt and reply together)."""
        check_no_lone_surrogate(body)
        self.check_model(body.model)
        return await self.llm.run_in_tokenizer_pool(self._tokenize, body)  # as a prompt is

    def _tokenize(self, body: TokenizeRequest) -> dict:
        chat = body.messages is not None
        text = self._render_chat(body) if chat else body.prompt
        special = not chat if body.add_special_tokens is None else body.add_special_tokens
        tokens = self.tokenizer.encode_batch([text], add_special_tokens=special)[0]
        strs = None
        if body.return_token_strs:
            strs = [self.tokenizer.backend.id_to_token(t) for t in tokens]
        return {"count": len(tokens), "max_model_len": self.config.max_model_len,
                "tokens": tokens, "token_strs": strs}  # fmt: skip

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """POST /detokenize: the text of these token ids, special tokens included."""
        self.check_model(body.model)
        return await self.llm.run_in_tokenizer_pool(self._detokenize, body.tokens)

    def _detokenize(self, tokens: list[int]) -> dict:
        vocab_size = self.tokenizer.vocab_size
        outside = [t for t in tokens if not 0 <= t < vocab_size]
        if outside:
            raise InvalidRequest(
                f"tokens must be ints in [0, {vocab_size}): {outside[:5]} are out of vocabulary",
                "tokens",
            )
        return {"prompt": self.tokenizer.decode(tokens)}

    async def open_requests(
        self, request_id: str, body: SamplingRequest, prompts: list[list[int]]
    ) -> RequestStream:
        """All engine requests of this HTTP request, admitted in one message; choice index =
        prompt index * n + choice."""
        expanded, params, config = [], [], self.config
        # a chat's thoughts are read apart (reasoning.py): a grammar waits until they end
        thinks = isinstance(body, ChatCompletionRequest) and self.config.reasoning_parser
        try:
            for prompt in prompts:
                for choice in range(body.n):
                    expanded.append(prompt)
                    sampling = body.sampling_params(len(prompt), config.max_model_len, choice,
                                                    config.sampling_defaults)  # fmt: skip
                    if thinks and sampling.structured_outputs is not None:
                        parser = reply_parser(config.reasoning_parser, self.tokenizer, prompt)
                        structured = replace(sampling.structured_outputs, reasoning=parser)
                        sampling = replace(sampling, structured_outputs=structured)
                    params.append(sampling)
            return await self.llm.add_requests(request_id, expanded, params, body.priority)
        except InvalidRequest:
            raise
        except ValueError as e:  # SamplingParams' or the engine's verdict: nothing was sent
            raise InvalidRequest(str(e)) from e

    async def _events(
        self, stream: RequestStream, choices: list[ChoiceStream], meta: dict,
        body: SamplingRequest, prompts, chat: bool,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The SSE body: one write per engine step with every choice's news of that step;
        first, a chat's role, one chunk per choice."""
        chunk = chat_chunk if chat else completion_chunk
        forced = self.config.enable_force_include_usage  # then every chunk, as vLLM's flag does
        include_usage = body.include_usage or forced
        continuous_usage = body.continuous_usage or forced
        extra = {"usage": None} if include_usage else {}  # OpenAI's shape with usage on

        def usage_so_far(choice: ChoiceStream) -> dict:  # `continuous_usage_stats`
            if not continuous_usage:
                return extra
            p = choice.index // body.n
            return {"usage": usage([prompts[p]], [choice], self._cached_tokens(stream, body, [p]))}

        tail = []
        try:
            if chat:  # the role comes first, once per choice, as OpenAI sends it
                yield b"".join(
                    _sse({**chat_role_chunk(meta, c), **usage_so_far(c)}) for c in choices
                )
            scored = stream.collector.prompt_logprobs
            async for deltas in stream:
                events = []
                for index, delta in deltas.items():
                    choice = choices[index]
                    sent = choice.add(delta, scored)  # with the echo, the first time
                    if sent is None:
                        continue
                    rendered = chunk(meta, choice, sent)  # now: text_offset reads the totals
                    if rendered is not None:  # None: a chat with tools holds it all back
                        events.append(_sse({**rendered, **usage_so_far(choice)}))
                if events:
                    yield b"".join(events)
            if include_usage:
                cached = self._cached_tokens(stream, body, range(len(prompts)))
                tail.append(_sse(usage_chunk(meta, usage(prompts, choices, cached), chat)))
        except (EngineStepError, EngineDeadError) as e:  # vLLM's words, then what happened
            tail.append(_sse(error_body(f"Internal server error: {e}", "server_error", None, None)))
        finally:
            stream.close()
        yield b"".join(tail) + DONE


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events that close their engine requests however the response ends.

    When the client goes away, Starlette cancels the response wherever it is waiting; if that is
    inside `send`, the event generator is left suspended and its `finally` would run only when
    the garbage collector finalizes it. So the cleanup is done here, explicitly.
    """

    def __init__(self, events: AsyncIterator[bytes], stream: RequestStream, request_id: str):
        super().__init__(events, media_type="text/event-stream")
        self.stream = stream
        self.request_id = request_id

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # the socket broke under a write: the client is gone all the same
            pass
        finally:
            self.stream.close()  # aborts what has not finished: its KV blocks are freed
            if self.stream.abandoned:
                logger.info("%s: the client disconnected mid-stream; its requests were aborted",
                            self.request_id)  # fmt: skip
            await self.body_iterator.aclose()  # ends the generator


def _sse(payload: dict) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def check_no_lone_surrogate(body: SamplingRequest | TokenizeRequest) -> None:
    """A lone UTF-16 surrogate ("\\ud800" in JSON) is valid JSON but no text: nothing can encode
    it (the tokenizer, the reply), so it is refused up front, naming where it was."""
    # token ids hold no text: a prompt of thousands of them is neither copied nor walked
    skip = {"prompt"} if isinstance(body, CompletionRequest) and body.has_token_ids else None
    where = _lone_surrogate(body.model_dump(exclude_defaults=True, exclude=skip), "")
    if where is not None:
        raise InvalidRequest(f"{where or 'body'}: contains a lone surrogate (not valid Unicode)",
                             where.split(".")[0] or None)  # fmt: skip


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first string holding a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        inner = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key, inner) is not None:
            return inner
        if isinstance(item, str | dict | list | tuple):  # token ids need no look
            found = _lone_surrogate(item, inner)
            if found is not None:
                return found
    return None


async def _collect(stream: RequestStream, choices: list[ChoiceStream]) -> None:
    async for deltas in stream:
        for index, delta in deltas.items():
            choices[index].add(delta, stream.collector.prompt_logprobs)


async def unless_disconnected(request: Request, work) -> bool:
    """Awaits `work`; True if the client hung up first (the work is then cancelled)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # The body is already read, so the next ASGI message is http.disconnect (if it comes).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done():
        task.result()  # raises the work's error
        return False
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let the cancelled work unwind (it closes nothing: the caller does)
    return True
