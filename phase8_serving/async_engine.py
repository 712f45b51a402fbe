"""Async engine: the engine loop in its own thread, one stream of outputs per request.

Problem: `LLM.generate` takes a list of prompts known in advance and returns when all are done.
A server's requests arrive one at a time, at any time, from clients that each wait on their own
connection, want their tokens as soon as they exist, and may hang up halfway.
Idea (vLLM's AsyncLLM): a background thread owns the `LLMEngine` and does nothing but step it.
The event loop talks to that thread through one command queue (add, abort) and gets outputs back
through one asyncio queue per request (`RequestStream`), filled with `call_soon_threadsafe`. A
web server's handlers (the front desk) never touch the engine (the kitchen); they hand in orders
and pick up dishes.

Invariants:
- only the engine thread calls the engine, so the engine needs no locks;
- `add_request` returns only after the engine accepted the request, so a bad request fails with
  its own `ValueError` (the server answers 400) before any response starts, and nothing changes;
- a request whose stream is closed before it finished is aborted: its KV blocks are freed by the
  engine thread's next command drain, which happens before its next step;
- if a step raises, every request in flight gets that error and is aborted; the loop goes on;
- `snapshot()` (the dashboard's) is taken by the engine thread between two steps, like a command;
- on a GPU, phase 7's CUDA graphs were captured when the engine was built, before this thread
  exists; the thread makes the engine's GPU its current device, so its replays, kernels, copies
  and tensor-parallel broadcasts all go to that GPU's default stream, as they would in the
  thread that built the engine (nothing here creates a stream).
"""

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .engine import LLMEngine, RequestOutput
from .metrics import EngineMetrics, EngineStats
from .sampling import SamplingParams
from .snapshot import engine_snapshot

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.1  # an idle engine thread rechecks for shutdown this often


class EngineStepError(RuntimeError):
    """A step failed inside the engine; the requests it was running were aborted."""


def deliver_all(deliveries: list[tuple["RequestStream", RequestOutput]]) -> None:
    """Hands one step's outputs to their streams with one wake-up of each event loop, not one per
    request: at 256 running requests, 256 cross-thread wake-ups a step cost more than the step."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_batch, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _put_batch(batch: list[tuple["RequestStream", RequestOutput]]) -> None:
    for stream, item in batch:
        stream._put_now(item)


class RequestStream:
    """The outputs of one request, as an async iterator; the last one has `finished` set."""

    def __init__(self, request_id: str, llm: "AsyncLLM", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._llm = llm
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _put_now(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Aborts the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Snapshot:
    taken: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Shutdown:
    pass


@dataclass
class _Timing:
    """Per-request clock for the latency metrics (engine thread only)."""

    arrival: float
    last_token: float | None = None


class AsyncLLM:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.stats = EngineStats()  # replaced whole after every step (readers never see a mix)
        self.metrics = EngineMetrics(model_name, lambda: self.stats)
        self._commands: queue.SimpleQueue[_Add | _Abort | _Snapshot | _Shutdown] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, tuple[RequestStream, _Timing]] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # -- the event loop's side -------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queues a request; raises ValueError (from the engine) if it is invalid."""
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        command = _Add(request_id, prompt_token_ids, params, stream)
        self._commands.put(command)
        try:
            await asyncio.wrap_future(command.accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the engine was busy; no-op if unknown
            raise
        return stream

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def snapshot(self) -> dict:
        """The engine's state between two steps (snapshot.py), for the dashboard."""
        command = _Snapshot()
        self._commands.put(command)
        return await asyncio.wrap_future(command.taken)

    def shutdown(self) -> None:
        self._commands.put(_Shutdown())
        self._thread.join()

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.runner.device.type == "cuda":
            torch.cuda.set_device(self.engine.runner.device)  # a new thread starts on GPU 0
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=not busy, timeout=IDLE_POLL_S)
            except queue.Empty:
                command = None
            while command is not None:
                if isinstance(command, _Shutdown):
                    return
                self._handle(command)
                command = self._commands.get_nowait() if not self._commands.empty() else None
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, command: _Add | _Abort | _Snapshot) -> None:
        if isinstance(command, _Snapshot):
            if command.taken.set_running_or_notify_cancel():  # False: the page left meanwhile
                command.taken.set_result(engine_snapshot(self.engine))
            return
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            self._streams.pop(command.request_id, None)
            self._publish_stats()
            return
        try:
            self.engine.add_request(command.prompt_token_ids, command.params, command.request_id)
        except ValueError as e:
            command.accepted.set_exception(e)
            return
        self._streams[command.request_id] = (command.stream, _Timing(time.perf_counter()))
        self.metrics.prompt_tokens.inc(len(command.prompt_token_ids))
        command.accepted.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug or an exhausted device: fail what was running, keep going
            logger.exception("engine step failed; aborting %d requests", len(self._streams))
            for request_id, (stream, _) in self._streams.items():
                self.engine.abort_request(request_id)
                stream.put(EngineStepError(f"the engine failed: {e}"))
            self._streams.clear()
            self._publish_stats()
            return
        now = time.perf_counter()
        self._publish_stats()  # before delivery: a client that got its answer sees it counted
        deliveries: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            stream, timing = entry
            self._observe(timing, now, out.finished)
            deliveries.append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        deliver_all(deliveries)

    def _observe(self, timing: _Timing, now: float, finished: bool) -> None:
        """One new token for a request (each step adds at most one per request)."""
        m = self.metrics
        m.generation_tokens.inc()
        if timing.last_token is None:
            m.time_to_first_token.observe(now - timing.arrival)
        else:
            m.inter_token_latency.observe(now - timing.last_token)
        timing.last_token = now
        if finished:
            m.e2e_request_latency.observe(now - timing.arrival)

    def _publish_stats(self) -> None:
        engine, bm = self.engine, self.engine.block_manager
        self.stats = EngineStats(
            num_running=len(engine.scheduler.running),
            # swapped-out requests (phase 5) wait too, with their KV blocks on the CPU
            num_waiting=len(engine.scheduler.waiting) + len(engine.scheduler.swapped),
            kv_cache_usage=bm.num_used_blocks / len(bm.blocks),
            prefix_cache_queries=bm.num_queried_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            num_preemptions=engine.num_preemptions,
        )
