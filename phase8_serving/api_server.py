"""The OpenAI-compatible HTTP server: FastAPI routes in front of the async engine.

Problem: an engine inside a Python object serves nobody; users have HTTP clients, mostly the
official `openai` library, and expect its endpoints, its JSON and its streaming format.
Idea: a FastAPI app (served by uvicorn) whose handlers are the front desk: the body is validated
at the door (protocol.py), then `OpenAIServing` (serving_engine.py) turns it into token ids,
hands the order to the kitchen (`AsyncLLM`) and carries the dishes back, at once or course by
course as server-sent events. This file holds the routes and what guards all of them.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET or DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items (OpenAI's Responses API,
serving_responses.py), GET /v1/models,
GET /v1/models/{id}, POST /tokenize and POST /detokenize (vLLM's: a prompt's or a chat's token
ids, and back),
GET /version, GET /health, GET /metrics (Prometheus text), GET /openapi.json (FastAPI's, from
protocol.py's models), GET /dashboard (dashboard.py: the engine, live in a browser; off with
`enable_dashboard=False`), GET /load (vLLM's, with `enable_server_load_tracking`), and
SageMaker's GET or POST /ping (/health) and POST /invocations (a chat or completions body, told
apart by `messages`).

A web page on another origin may call the API from a browser (CORS, vLLM's defaults: any origin,
method and header; `allowed_origins` narrows it). Nothing one client sends stalls the others: a
body over `max_request_body_bytes` is a 413 before it is read whole (plain ASGI middleware, as
are the API key's and CORS': none puts a task between a stream and its client); the rest is
serving_engine.py's.

Invariant: anything a client can send gets a 2xx or a 4xx in the OpenAI error shape, never a
5xx: bad bodies 400 (not FastAPI's 422), a lone surrogate anywhere 400, an unknown model 404, a
missing or wrong API key 401, a body over the limit 413; a dead engine core is a 5xx (and
/health says 503), a failed step a 500 or an SSE error event: never a hang.
"""

import contextlib
import gc
import importlib.metadata
import logging
import secrets
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncLLM, EngineDeadError
from .config import ServerConfig
from .dashboard import add_dashboard, dashboard_credential
from .metrics import CONTENT_TYPE
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InvalidRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from .responses import model_card
from .serving_engine import FastJSONResponse, OpenAIServing, error_response
from .serving_responses import ResponsesServing

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/ping", "/version")  # reachable without the API key
try:
    VERSION = importlib.metadata.version("mini-vllm")
except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
    VERSION = "unknown (not installed)"


@contextlib.asynccontextmanager
async def frozen_startup_heap(app: FastAPI):
    """Marks everything alive at start-up (torch, the tokenizer, the app: ~200,000 objects) as
    permanent, so the collector's full passes stop walking it (vLLM's API server does the same).
    Each pass walked them all (0.17 s on the 2-core test machine), and admitting W's 256
    requests set off several; a W request's admission took 3.5 ms of CPU there, 2.9 after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mini-vllm", summary="OpenAI-compatible server",
                  default_response_class=FastJSONResponse, lifespan=frozen_startup_heap,
                  **(docs if config.disable_fastapi_docs else {}))  # fmt: skip
    # behind a proxy's prefix: FastAPI puts it in each request's scope, and the routes serve
    # /llm/v1/... and /v1/... alike (vLLM sets it so too; uvicorn's would serve only the first)
    app.root_path = config.root_path
    server = OpenAIServing(llm, config)
    _install_error_handlers(app, config)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.serve(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.serve(body, request)

    responses = ResponsesServing(server)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> dict:
        return responses.input_items(response_id, after, limit, order)

    def card(name: str) -> dict:
        return model_card(name, config.max_model_len, config.model_root)

    @app.get("/v1/models")
    async def models() -> dict:
        names = (config.model_name, *config.model_aliases)  # each name a card, as vLLM lists
        return {"object": "list", "data": [card(name) for name in names]}

    @app.get("/v1/models/{model_id:path}")  # :path: hub ids have a slash (Qwen/Qwen3-0.6B)
    async def model(model_id: str) -> dict:
        server.check_model(model_id)
        return card(model_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await server.detokenize(body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_alive else 503)

    for method in ("GET", "POST"):  # SageMaker's /health; a route a method: one operation id
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}")

    @app.post("/invocations")  # SageMaker's one route: a chat body or a completions body
    async def invocations(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("the body is not valid JSON") from None
        chat = isinstance(body, dict) and "messages" in body
        try:
            parsed = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as e:  # answered as a route's invalid body is
            raise RequestValidationError(e.errors()) from None
        return await server.serve(parsed, request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE)

    if config.enable_server_load_tracking:
        app.state.server_load = 0
        app.add_middleware(LoadTrackingMiddleware)

        @app.get("/load")  # vLLM's, for a load balancer: which server is least busy
        async def server_load() -> dict:
            return {"server_load": app.state.server_load}

    if config.enable_dashboard:
        add_dashboard(app, llm, config.model_name)
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if config.allowed_origins:
        # outermost (added last): a browser's preflight carries no API key, and an error's
        # response needs the CORS headers too, or the page cannot read it
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods),
                           allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)  # fmt: skip
    return app


def route_path(scope) -> str:
    """The path the routes see: behind a proxy's prefix (--root-path /llm), /llm/v1/models and
    /v1/models are both /v1/models, as Starlette routes them."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


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


class LoadTrackingMiddleware:
    """Plain ASGI: counts the generation requests in progress (`app.state.server_load`, GET
    /load), each from its arrival until its response, streamed or not, has been sent or its
    client has gone."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.PATHS:
            return await self.app(scope, receive, send)
        state = scope["app"].state  # Starlette puts the app in every scope
        state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load -= 1


class RequestIdHeaderMiddleware:
    """Plain ASGI (vLLM's --enable-request-id-headers): every response carries X-Request-Id,
    the request's own if it sent one (a proxy's trace id), else a new one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def with_header(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", given)]
            await send(message)

        await self.app(scope, receive, with_header)


class ApiKeyMiddleware:
    """Plain ASGI (not Starlette's BaseHTTPMiddleware, which would put its own task between a
    streaming response and the client and delay the disconnect that aborts the request)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = route_path(scope) if scope["type"] == "http" else None
        if path is not None and path not in OPEN_PATHS:
            # a browser's EventSource sends no headers: the dashboard takes ?key= or a cookie
            given = dict(scope["headers"]).get(b"authorization")
            given = given or dashboard_credential(scope, path) or b""
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
        # every error, not the first: a client fixing its request sees all it must change
        messages, params = [], []
        for error in exc.errors():
            loc = [str(part) for part in error.get("loc", ()) if part != "body"]
            if error["type"] == "json_invalid":  # its loc is a character offset, not a field
                loc = []
            msg = f"{error['msg']} [type={error['type']}]"  # pydantic's words, as vLLM sends them
            messages.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
            params.append(loc[0] if loc else None)
        return error_response(400, "; ".join(messages), param=params[0])  # the first's field

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))
