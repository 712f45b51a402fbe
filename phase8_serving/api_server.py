"""The OpenAI-compatible HTTP server: FastAPI routes in front of the async engine.

Problem: an engine inside a Python object serves nobody; users have HTTP clients, mostly the
official `openai` library, and expect its endpoints, its JSON and its streaming format.
Idea: a FastAPI app (served by uvicorn) whose handlers are the front desk: validate the order
(protocol.py), turn it into token ids and `SamplingParams`, hand it to the kitchen (`AsyncLLM`),
and carry the dishes back, either at once (a JSON body) or course by course as server-sent
events (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text), GET /openapi.json (FastAPI's, from protocol.py's models),
GET /dashboard (dashboard.py: the engine, live in a browser; off with `enable_dashboard=False`).

Invariants:
- anything a client can send gets a 2xx or a 4xx in the OpenAI error shape, never a 5xx:
  bad bodies 400 (not FastAPI's 422), an unknown model 404, a missing or wrong API key 401;
- every request this server opened in the engine is closed when its handler ends, however it
  ends (done, error, client gone): `RequestStream.close()` aborts it and frees its KV blocks;
- usage counts are the token ids the engine received and produced.
"""

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncLLM, EngineStepError, RequestStream
from .dashboard import DashboardHub, add_dashboard_routes, dashboard_credential
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
    usage,
    usage_chunk,
)

OPEN_PATHS = ("/health",)  # reachable without the API key


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what clients put in "model"
    max_model_len: int  # prompt + completion tokens, at most
    api_key: str | None = None  # None: no authentication
    enable_dashboard: bool = True  # GET /dashboard

    def __post_init__(self):
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def error_response(status: int, message: str, param: str | None = None, code=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="mini-vllm", summary="OpenAI-compatible server")
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
        card = {"id": config.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "mini-vllm", "max_model_len": config.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    if config.enable_dashboard:
        hub = DashboardHub(llm.metrics.registry, poll=llm.snapshot)
        add_dashboard_routes(app, hub, config.model_name)
    return app


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

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(loc)}: {first['msg']}" if loc else first["msg"]
        return error_response(400, message, param=loc[0] if loc else None)  # the body's field

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


class _Server:
    """The handlers' shared work: prompts to token ids, requests into the engine, results out."""

    def __init__(self, llm: AsyncLLM, config: ServerConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.engine.tokenizer

    async def serve(self, body: SamplingRequest, request: Request) -> Response:
        if body.model is not None and body.model != self.config.model_name:
            raise InvalidRequest(
                f"The model `{body.model}` does not exist.", "model", 404, "model_not_found"
            )
        prompts = self._prompt_token_ids(body)
        chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams = await self._open(request_id, body, prompts)
        choices = [ChoiceStream(i, s, self.tokenizer, body.stop) for i, s in enumerate(streams)]
        meta = {"id": request_id, "created": int(time.time()), "model": self.config.model_name}
        if body.stream:
            return EngineStreamingResponse(
                self._events(choices, meta, body, prompts, chat), streams
            )
        try:
            await _unless_disconnected(request, asyncio.gather(*(c.run() for c in choices)))
        except EngineStepError as e:
            return error_response(500, str(e))
        finally:
            for c in choices:
                c.stream.close()
        build = chat_response if chat else completion_response
        return JSONResponse(build(meta, choices, usage(prompts, choices)))

    def _prompt_token_ids(self, body: SamplingRequest) -> list[list[int]]:
        tok = self.tokenizer
        if isinstance(body, ChatCompletionRequest):
            messages = [m.for_template() for m in body.messages]
            try:
                text = tok.apply_chat_template(
                    messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
                )
            except Exception as e:  # the template is code we run on the client's input
                raise InvalidRequest(f"the chat template failed: {e}", "messages") from e
            return [tok.encode(text, add_special_tokens=False)]  # the template holds them
        prompts = [p if isinstance(p, list) else tok.encode(p) for p in body.prompts()]
        if not all(prompts):
            raise InvalidRequest("the prompt must contain at least one token", "prompt")
        return prompts

    async def _open(
        self, request_id: str, body: SamplingRequest, prompts: list[list[int]]
    ) -> list[RequestStream]:
        """One engine request per (prompt, choice); choice index = prompt index * n + choice."""
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                for choice in range(body.n):
                    params = body.sampling_params(len(prompt), self.config.max_model_len, choice)
                    stream_id = f"{request_id}-{len(streams)}"
                    streams.append(await self.llm.add_request(stream_id, prompt, params))
        except ValueError as e:  # SamplingParams' or the engine's verdict: nothing is left open
            for s in streams:
                s.close()
            if isinstance(e, InvalidRequest):
                raise
            raise InvalidRequest(str(e)) from e
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def _events(
        self, choices: list[ChoiceStream], meta: dict, body: SamplingRequest, prompts, chat: bool
    ) -> AsyncIterator[str]:
        chunk = chat_chunk if chat else completion_chunk
        extra = {"usage": None} if body.include_usage else {}  # OpenAI's shape with usage on
        try:
            if chat:  # the role comes first, once per choice, as OpenAI sends it
                for c in choices:
                    yield _sse({**chat_role_chunk(meta, c), **extra})
            async for payload in _merged(choices, lambda c, d: {**chunk(meta, c, d), **extra}):
                yield _sse(payload)
            if body.include_usage:
                yield _sse(usage_chunk(meta, usage(prompts, choices), chat))
        except EngineStepError as e:
            yield _sse(error_body(str(e), "server_error", None, None))
        finally:
            for c in choices:
                c.stream.close()
        yield "data: [DONE]\n\n"


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events that close their engine requests however the response ends.

    When the client goes away, Starlette cancels the response wherever it is waiting; if that is
    inside `send`, the event generator is left suspended and its `finally` would run only when
    the garbage collector finalizes it. So the cleanup is done here, explicitly.
    """

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.close()  # aborts what has not finished: its KV blocks are freed
            await self.body_iterator.aclose()  # ends the generator and its helper tasks


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merged(choices: list[ChoiceStream], render) -> AsyncIterator[dict]:
    """`render(choice, delta)` for every delta of every choice, in the order they arrive.

    Each delta is rendered as soon as its choice yields it, while the choice's totals still
    match it (a streamed completion's text_offset depends on them).
    """
    ready: asyncio.Queue[tuple[dict, bool] | Exception] = asyncio.Queue()

    async def pump(choice: ChoiceStream) -> None:
        try:
            async for delta in choice.deltas():
                await ready.put((render(choice, delta), delta.finish_reason is not None))
        except Exception as e:
            await ready.put(e)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        unfinished = len(choices)
        while unfinished:
            item = await ready.get()
            if isinstance(item, Exception):
                raise item
            payload, last = item
            unfinished -= last
            yield payload
    finally:
        for t in tasks:
            t.cancel()


async def _unless_disconnected(request: Request, work: asyncio.Future) -> None:
    """Awaits `work`; if the client hangs up first, cancels it (its streams then abort)."""
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
    await task  # raises the work's error, or CancelledError if the client left
