"""The dashboard: the running server's engine, live in a browser, at GET /dashboard.

Problem: Prometheus numbers say how busy a server is, not what its scheduler does. A learner
who has read about continuous batching, chunked prefill, preemption, paged blocks and prefix
sharing wants to watch them happen.
Idea: the engine's state leaves the engine core as snapshots (snapshot.py) in the step messages
it already sends (engine_core.py), at a bounded rate and only while someone watches;
`DashboardHub` adds the serving numbers of the last minute (output tok/s, TTFT, TPOT, from the
same metrics /metrics shows) and fans each frame out to every open page as server-sent events
(GET /dashboard/events). The page (static/dashboard.html and dashboard.js, our own code, served
from the installed package) draws them. The same page replays a recorded trace (replay.py), so
this file serves the page for both.

The hub knows nothing of processes: `watch(True)` when the first page opens and `watch(False)`
when the last one closes tell its owner to start and stop the snapshots, which the owner hands
to `publish` (`add_dashboard` wires both to `AsyncLLM`). With data parallelism the page shows one
engine core, the first (`DASHBOARD_CORE`): every core runs the same configuration and gets a
share of the requests; the serving numbers are the whole server's.

Invariants:
- no page open, no snapshot taken: the hub watches only while a client is connected;
- the hub sends at most one frame per `MIN_FRAME_INTERVAL_S` to a page, always the newest,
  and never queues more than one frame per page (a slow browser skips frames, it never lags);
- with `--api-key`, the page and its events need the key like every route; a browser cannot put
  it in an EventSource's headers, so the dashboard's paths also accept it as `?key=` (the page
  then sets an HttpOnly cookie for the rest) or in that cookie.
"""

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from importlib import resources
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from .async_engine import AsyncLLM

DASHBOARD_PATH = "/dashboard"
DASHBOARD_CORE = 0  # with data parallelism, the engine core the page shows
MIN_FRAME_INTERVAL_S = 0.1  # at most 10 frames a second to a page: what a person can follow
KEY_COOKIE = "mini_vllm_dashboard_key"
WINDOW_S = 60.0  # output tok/s, TTFT and TPOT are averaged over the last minute
# The histograms and counter behind the rolling numbers (vLLM's names, as /metrics shows them).
TOTALS = {
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:e2e_request_latency_seconds_count": "finished_requests",
}


def metric_totals(registry: CollectorRegistry) -> dict[str, float]:
    """The running totals behind the rolling numbers, read from the server's metrics registry."""
    totals = dict.fromkeys(TOTALS.values(), 0.0)
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name in TOTALS:
                totals[TOTALS[sample.name]] = sample.value
    return totals


class RollingWindow:
    """Metric totals sampled over time; rates and means over the last `WINDOW_S` seconds."""

    def __init__(self):
        self.samples: deque[tuple[float, dict[str, float]]] = deque()

    def add(self, now: float, totals: dict[str, float]) -> dict:
        self.samples.append((now, totals))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()  # the oldest kept sample is the window's baseline
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        delta = {k: last[k] - first[k] for k in last}
        return {
            "window_s": t1 - t0,
            "output_tok_s": delta["generation_tokens"] / (t1 - t0) if t1 > t0 else 0.0,
            "ttft_s": _mean(delta["ttft_sum"], delta["ttft_count"]),
            # mean gap between a request's tokens: TPOT, averaged over tokens, not requests
            "tpot_s": _mean(delta["itl_sum"], delta["itl_count"]),
            "finished_requests": delta["finished_requests"],
            "generation_tokens": last["generation_tokens"],  # since the server started
        }


def _mean(total: float, count: float) -> float | None:
    return total / count if count else None


class DashboardHub:
    """Fans snapshots out to the open pages, each one with the serving numbers of the minute."""

    def __init__(self, registry: CollectorRegistry, watch: Callable[[bool], None]):
        self.registry = registry
        self.watch = watch  # watch(True): send me snapshots; watch(False): stop
        self.clients: set[asyncio.Queue[str]] = set()
        self.latest: str | None = None  # the newest frame, for a page that just opened
        self.window = RollingWindow()
        self._last_sent = 0.0
        self._pending: dict | None = None  # a snapshot that came too soon, sent when due

    @property
    def watching(self) -> bool:
        """Whether a page is open."""
        return bool(self.clients)

    def publish(self, snapshot: dict) -> None:
        """Sends `snapshot` (with the minute's numbers) to every page, at most one per interval."""
        if not self.watching:
            return  # one that was on its way when the last page closed
        now = time.monotonic()
        wait = self._last_sent + MIN_FRAME_INTERVAL_S - now
        if wait > 0:
            if self._pending is None:
                asyncio.get_running_loop().call_later(wait, self._send_pending)
            self._pending = snapshot
            return
        self._last_sent = now
        serving = self.window.add(now, metric_totals(self.registry))
        self.latest = json.dumps({**snapshot, "serving": serving})
        for mailbox in self.clients:
            if mailbox.full():
                mailbox.get_nowait()  # the page has not read the last one yet: replace it
            mailbox.put_nowait(self.latest)

    def _send_pending(self) -> None:
        snapshot, self._pending = self._pending, None
        if snapshot is not None:
            self.publish(snapshot)

    def connect(self) -> asyncio.Queue[str]:
        mailbox: asyncio.Queue[str] = asyncio.Queue(maxsize=1)
        if self.latest is not None:
            mailbox.put_nowait(self.latest)
        if not self.clients:
            self.watch(True)  # the engine sends its state at once, then while it changes
        self.clients.add(mailbox)
        return mailbox

    def disconnect(self, mailbox: asyncio.Queue[str]) -> None:
        if mailbox not in self.clients:
            return
        self.clients.discard(mailbox)
        if not self.clients:
            self.watch(False)
            self.latest = None  # a later page waits for the engine's state, not this old one
            self._pending = None
            self.window = RollingWindow()  # the next watcher's minute starts when they come

    async def events(self, mailbox: asyncio.Queue[str]) -> AsyncIterator[str]:
        while True:
            yield f"data: {await mailbox.get()}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that unregister their page however the response ends (the generator's
    own `finally` may run late: see serving_engine.EngineStreamingResponse)."""

    def __init__(self, hub: DashboardHub):
        self.hub, self.mailbox = hub, hub.connect()
        super().__init__(hub.events(self.mailbox), media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hub.disconnect(self.mailbox)
            await self.body_iterator.aclose()


def dashboard_credential(scope, path: str) -> bytes | None:
    """`Bearer <key>` from a dashboard path's `?key=` or cookie, for the API key middleware
    (`path`: the request's, without a proxy's prefix)."""
    if not path.startswith(DASHBOARD_PATH):
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    key = query.get("key", [None])[0]
    for name, value in scope["headers"]:
        if key is None and name == b"cookie":
            cookies = dict(
                part.strip().split("=", 1)
                for part in value.decode("latin-1").split(";")
                if "=" in part
            )
            key = cookies.get(KEY_COOKIE)
    return f"Bearer {key}".encode() if key is not None else None


def static_text(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def add_page_routes(app: FastAPI, info: dict) -> None:
    """The page, its script, and `info` (what it shows: {"mode": "live" | "replay", ...})."""

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    async def page(request: Request) -> Response:
        response = HTMLResponse(static_text("dashboard.html"))
        key = request.query_params.get("key")
        if key is not None:  # reached here, so it is the right key: the page's fetches reuse it
            path = request.scope["path"]  # /dashboard, or behind a proxy's prefix /llm/dashboard
            response.set_cookie(KEY_COOKIE, key, path=path, httponly=True, samesite="strict")
        return response

    @app.get(DASHBOARD_PATH + "/dashboard.js", include_in_schema=False)
    async def script() -> Response:
        return Response(static_text("dashboard.js"), media_type="text/javascript")

    @app.get(DASHBOARD_PATH + "/info", include_in_schema=False)
    async def page_info() -> JSONResponse:
        return JSONResponse(info)


def add_dashboard(app: FastAPI, llm: AsyncLLM, model_name: str) -> DashboardHub:
    """The live dashboard of `llm`'s engine core `DASHBOARD_CORE`, fed while a page is open."""
    hub = DashboardHub(llm.metrics.registry, lambda on: llm.watch_engine(on, [DASHBOARD_CORE]))

    def publish(core: int, snapshot: dict) -> None:
        if core == DASHBOARD_CORE:
            hub.publish(snapshot)

    llm.on_engine_stats(publish)
    add_dashboard_routes(app, hub, model_name)
    return hub


def add_dashboard_routes(app: FastAPI, hub: DashboardHub, model_name: str) -> None:
    """The live dashboard: the page, and the event stream that feeds it."""
    add_page_routes(app, {"mode": "live", "model": model_name})

    @app.get(DASHBOARD_PATH + "/events", include_in_schema=False)
    async def events() -> Response:
        return _EventStream(hub)
