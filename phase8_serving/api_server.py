"""The OpenAI-compatible HTTP server: FastAPI routes in front of the async engine.

Problem: an engine inside a Python object serves nobody; users have HTTP clients, mostly the
official `openai` library, and expect its endpoints, its JSON and its streaming format.
Idea: a FastAPI app (served by uvicorn) whose handlers are the front desk: validate the order
(protocol.py), turn it into token ids and `SamplingParams`, hand it to the kitchen (`AsyncLLM`),
and carry the dishes back, either at once (a JSON body) or course by course as server-sent
events (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics (Prometheus text), GET /openapi.json (FastAPI's, from protocol.py's
models), GET /dashboard (dashboard.py: the engine, live in a browser; off with
`enable_dashboard=False`).

Nothing one client sends stalls the others: a body over `max_request_body_bytes` is a 413 before
it is read whole; more than `max_choices_per_request` prompts x n is a 400 before any tokenizing;
tokenizing and chat templates run in the front end's thread pool, never on the event loop; every
prompt of a request enters the engine in one message and leaves it in one abort. A streamed step
is one write per HTTP request (every choice's chunk of that step together), its JSON made by
orjson or msgspec where installed.

Invariants:
- anything a client can send gets a 2xx or a 4xx in the OpenAI error shape, never a 5xx:
  bad bodies 400 (not FastAPI's 422), a lone surrogate anywhere 400, an unknown model 404, a
  missing or wrong API key 401, a body over the limit 413; a dead engine core is a 5xx (and
  /health says 503), a failed step a 500 or an SSE error event: never a hang;
- every request this server opened in the engine is closed when its handler ends, however it
  ends (done, error, client gone): `RequestStream.close()` aborts it and frees its KV blocks; a
  client that leaves is one log line, not a traceback;
- usage counts are the token ids the engine received and produced.
"""

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncLLM, EngineDeadError, EngineStepError, RequestStream
from .dashboard import add_dashboard, dashboard_credential
from .metrics import CONTENT_TYPE
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    SamplingRequest,
    error_body,
)
from .responses import (
    ChoiceStream,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    model_card,
    usage,
    usage_chunk,
)

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)  # reachable without the API key
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20  # a long-context prompt as text fits well inside
DEFAULT_MAX_CHOICES_PER_REQUEST = 256  # prompts x n: an engine's worth of running requests
DONE = b"data: [DONE]\n\n"

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


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what clients put in "model"
    max_model_len: int  # prompt + completion tokens, at most
    api_key: str | None = None  # None: no authentication
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get a 413
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST  # prompts x n, at most
    enable_log_requests: bool = False  # a log line per request (uvicorn's access log too)
    enable_dashboard: bool = True  # GET /dashboard

    def __post_init__(self):
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        for name in ("max_request_body_bytes", "max_choices_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="mini-vllm", summary="OpenAI-compatible server",
                  default_response_class=FastJSONResponse)  # fmt: skip
    server = _Server(llm, config)
    _install_error_handlers(app, config)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.serve(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.serve(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(config.model_name, config.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")  # :path: hub ids have a slash (Qwen/Qwen3-0.6B)
    async def model(model_id: str) -> dict:
        if model_id != config.model_name:
            raise InvalidRequest(
                f"The model `{model_id}` does not exist.", "model", 404, "model_not_found"
            )
        return model_card(config.model_name, config.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    if config.enable_dashboard:
        add_dashboard(app, llm, config.model_name)
    return app


class RequestTooLarge(StarletteHTTPException):
    """Raised while reading a body without Content-Length that grew past the limit (an
    HTTPException, so FastAPI's body reader lets it through to the 413 handler)."""


class BodySizeLimitMiddleware:
    """Plain ASGI: a body over the limit is refused before the app reads it whole."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"The request body is larger than {self.limit} bytes (--max-request-body-bytes)."
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await error_response(413, message)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.limit:
                raise RequestTooLarge(413, message)
            return event

        await self.app(scope, limited_receive, send)


class ApiKeyMiddleware:
    """Plain ASGI (not Starlette's BaseHTTPMiddleware, which would put its own task between a
    streaming response and the client and delay the disconnect that aborts the request)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            # a browser's EventSource sends no headers: the dashboard takes ?key= or a cookie
            given = dict(scope["headers"]).get(b"authorization") or dashboard_credential(scope)
            given = given or b""
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    401, "Incorrect API key provided.", code="invalid_api_key"
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI, config: ServerConfig) -> None:
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(BodySizeLimitMiddleware, limit=config.max_request_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(loc)}: {first['msg']}" if loc else first["msg"]
        return error_response(400, message, param=loc[0] if loc else None)  # the body's field

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


class _Server:
    """The handlers' shared work: prompts to token ids, requests into the engine, results out."""

    def __init__(self, llm: AsyncLLM, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer

    async def serve(self, body: SamplingRequest, request: Request) -> Response:
        check_no_lone_surrogate(body)  # before anything quotes the client's text back
        if body.model is not None and body.model != self.config.model_name:
            raise InvalidRequest(
                f"The model `{body.model}` does not exist.", "model", 404, "model_not_found"
            )
        chat = isinstance(body, ChatCompletionRequest)
        num_choices = body.n * (1 if chat else len(body.prompts()))
        if num_choices > self.config.max_choices_per_request:
            raise InvalidRequest(
                f"This request asks for {num_choices} completions (prompts x n); the server "
                f"allows {self.config.max_choices_per_request} (--max-choices-per-request).",
                "n" if chat else "prompt",
            )
        prompts = await self.llm.run_in_tokenizer_pool(self._prompt_token_ids, body)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = await self._open(request_id, body, prompts)
        if self.config.enable_log_requests:
            logger.info("%s: %d prompt tokens, %d choices, stream=%s", request_id,
                        sum(map(len, prompts)), num_choices, bool(body.stream))  # fmt: skip
        choices = [ChoiceStream(i, self.tokenizer) for i in range(num_choices)]
        meta = {"id": request_id, "created": int(time.time()), "model": self.config.model_name}
        if body.stream:
            events = self._events(stream, choices, meta, body, prompts, chat)
            return EngineStreamingResponse(events, stream, request_id)
        try:
            client_left = await _unless_disconnected(request, _collect(stream, choices))
        except (EngineStepError, EngineDeadError) as e:
            return error_response(500, str(e))
        finally:
            stream.close()
        if client_left:
            logger.info("%s: the client disconnected; its requests were aborted", request_id)
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        build = chat_response if chat else completion_response
        return FastJSONResponse(build(meta, choices, usage(prompts, choices)))

    def _prompt_token_ids(self, body: SamplingRequest) -> list[list[int]]:
        """Runs in the tokenizer pool: templates and tokenizing can take seconds on big input."""
        tok = self.tokenizer
        if isinstance(body, ChatCompletionRequest):
            messages = [m.for_template() for m in body.messages]
            try:
                text = tok.apply_chat_template(
                    messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
                )
            except Exception as e:  # the template is code we run on the client's input
                raise InvalidRequest(f"the chat template failed: {e}", "messages") from e
            return tok.encode_batch([text], add_special_tokens=False)  # the template holds them
        prompts = body.prompts()
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(tok.encode_batch(texts) if texts else [])
        prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
        if not all(prompts):
            raise InvalidRequest("the prompt must contain at least one token", "prompt")
        return prompts

    async def _open(
        self, request_id: str, body: SamplingRequest, prompts: list[list[int]]
    ) -> RequestStream:
        """All engine requests of this HTTP request, admitted in one message; choice index =
        prompt index * n + choice."""
        expanded, params = [], []
        try:
            for prompt in prompts:
                for choice in range(body.n):
                    expanded.append(prompt)
                    params.append(
                        body.sampling_params(len(prompt), self.config.max_model_len, choice)
                    )
            return await self.llm.add_requests(request_id, expanded, params)
        except InvalidRequest:
            raise
        except ValueError as e:  # SamplingParams' or the engine's verdict: nothing was sent
            raise InvalidRequest(str(e)) from e

    async def _events(
        self, stream: RequestStream, choices: list[ChoiceStream], meta: dict,
        body: SamplingRequest, prompts, chat: bool,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The SSE body: one write per engine step with every choice's news of that step."""
        chunk = chat_chunk if chat else completion_chunk
        extra = {"usage": None} if body.include_usage else {}  # OpenAI's shape with usage on
        tail = []
        try:
            if chat:  # the role comes first, once per choice, as OpenAI sends it
                yield b"".join(_sse({**chat_role_chunk(meta, c), **extra}) for c in choices)
            async for deltas in stream:
                events = []
                for index, delta in deltas.items():
                    choice = choices[index]
                    if choice.add(delta):  # rendered now: text_offset reads the choice's totals
                        events.append(_sse({**chunk(meta, choice, delta), **extra}))
                if events:
                    yield b"".join(events)
            if body.include_usage:
                tail.append(_sse(usage_chunk(meta, usage(prompts, choices), chat)))
        except (EngineStepError, EngineDeadError) as e:
            tail.append(_sse(error_body(str(e), "server_error", None, None)))
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


def check_no_lone_surrogate(body: SamplingRequest) -> None:
    """A lone UTF-16 surrogate ("\\ud800" in JSON) is valid JSON but no text: nothing can encode
    it (the tokenizer, the reply), so it is refused up front, naming where it was."""
    where = _lone_surrogate(body.model_dump(exclude_defaults=True), "")
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
            choices[index].add(delta)


async def _unless_disconnected(request: Request, work) -> bool:
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
