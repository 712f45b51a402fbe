"""The front end's side of the process boundary: start engine cores, talk to them, notice deaths.

Problem: the front end (async_engine.py) must reach one engine core or several (data
parallelism), spawned by itself or started elsewhere as `mini-vllm engine-core --address ...`,
without ever blocking its event loop, and must learn at once when one of them dies: a request
waiting on a dead core would otherwise wait forever.
Idea (vLLM v1's `AsyncMPClient`, mini-sglang's `utils/mp.py`): one ZeroMQ DEALER socket per core,
connected to the core's ROUTER address (`ipc://` by default, `tcp://host:port` across machines),
msgpack by msgspec both ways. Startup is a blocking handshake (`Hello` -> `CoreInfo`); afterwards
one asyncio task per core reads its messages. A spawned core is watched through its process
sentinel (readable the moment the process ends); a core started elsewhere through its heartbeat
(`engine_core.HEARTBEAT_INTERVAL_S` when idle, a message per step when busy).

Invariants:
- only the event loop that called `start` uses the asyncio sockets;
- a core is reported dead once (`on_dead`), and nothing is sent to it afterwards;
- each request goes to the live core with the fewest requests in flight, then the fewest tokens.
"""

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from .core_messages import (
    AddRequests,
    CoreInfo,
    CoreInput,
    CoreOutput,
    EngineCoreRequest,
    EngineState,
    GetState,
    Heartbeat,
    Hello,
    Shutdown,
    make_socket,
)
from .engine_core import EngineCoreSpec, run_engine_core

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 900.0  # loading a checkpoint and capturing CUDA graphs takes minutes at most
HEARTBEAT_TIMEOUT_S = 30.0  # a core started elsewhere that says nothing this long is dead
SHUTDOWN_TIMEOUT_S = 30.0  # a spawned core is killed if it has not exited by then
POLL_MS = 100


class EngineDeadError(RuntimeError):
    """An engine core died; the requests it held cannot finish."""


def ipc_address(index: int) -> str:
    return f"ipc://{tempfile.gettempdir()}/mini-vllm-{uuid.uuid4().hex[:12]}-core{index}"


@dataclass
class CoreConnection:
    """One engine core as the front end sees it."""

    index: int
    address: str
    socket: zmq.Socket
    process: BaseProcess | None  # None: started elsewhere, watched by heartbeat
    info: CoreInfo | None = None
    num_requests: int = 0  # in flight, for load balancing
    num_tokens: int = 0  # prompt + max_tokens of those requests
    last_heard: float = field(default_factory=time.monotonic)
    dead: str | None = None  # why, once it died
    async_socket: zmq.asyncio.Socket | None = None
    pending_adds: list[EngineCoreRequest] = field(default_factory=list)  # this loop turn's


class EngineCoreClient:
    """Engine cores behind one front end: `spawn` them, or `connect` to running ones."""

    def __init__(self, connections: list[CoreConnection], context: zmq.Context):
        self.cores = connections
        self.context = context
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreOutput)
        self.tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._call_ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}

    @classmethod
    def spawn(cls, spec: EngineCoreSpec, data_parallel_size: int = 1) -> "EngineCoreClient":
        """Starts `data_parallel_size` cores; on CUDA core i sees only its own GPUs."""
        mp = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        context = zmq.Context()
        connections = []
        try:
            for i in range(data_parallel_size):
                core_spec = spec
                if data_parallel_size > 1 and _on_cuda(spec):
                    tp = spec.config.tensor_parallel_size
                    gpus = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
                    core_spec = replace(spec, visible_devices=gpus)
                address = ipc_address(i)
                process = mp.Process(
                    target=run_engine_core, name=f"engine-core-{i}",
                    args=(core_spec, address, os.getpid(), logging.getLogger().getEffectiveLevel()),
                )  # fmt: skip
                process.start()
                connections.append(CoreConnection(i, address, _dealer(context, address), process))
            client = cls(connections, context)
            client._handshake()
        except BaseException:
            for c in connections:
                _stop_process(c.process, timeout=0)
            context.destroy(linger=0)
            raise
        return client

    @classmethod
    def connect(cls, addresses: list[str]) -> "EngineCoreClient":
        """Connects to cores started with `mini-vllm engine-core --address ADDRESS`."""
        context = zmq.Context()
        connections = [
            CoreConnection(i, a, _dealer(context, a), None) for i, a in enumerate(addresses)
        ]
        client = cls(connections, context)
        try:
            client._handshake()
        except BaseException:
            context.destroy(linger=0)
            raise
        return client

    @property
    def info(self) -> CoreInfo:
        return self.cores[0].info

    def _handshake(self) -> None:
        """Blocks until every core has answered `Hello` (or one died, or the time is up)."""
        for core in self.cores:
            core.socket.send(self.encoder.encode(Hello()))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for core in self.cores:
            while core.info is None:
                if core.socket.poll(POLL_MS):
                    message = self.decoder.decode(core.socket.recv())
                    if isinstance(message, CoreInfo):
                        core.info = message
                elif core.process is not None and not core.process.is_alive():
                    raise RuntimeError(
                        f"engine core {core.index} exited with code {core.process.exitcode} "
                        "while starting (its error is printed above)"
                    )
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"engine core {core.index} at {core.address} did not answer")
            core.last_heard = time.monotonic()

    # -- the event loop's side ------------------------------------------------------------------

    def start(self, on_message: Callable[[int, CoreOutput], None],
              on_dead: Callable[[int, str], None]) -> None:  # fmt: skip
        """Starts reading every core's messages on the running loop."""
        self.loop = asyncio.get_running_loop()
        self.on_dead = on_dead
        for core in self.cores:
            core.async_socket = zmq.asyncio.Socket.from_socket(core.socket)
            self.tasks.append(asyncio.create_task(self._read(core, on_message)))
            if core.process is not None:
                self.loop.add_reader(core.process.sentinel, self._process_exited, core)
        if any(core.process is None for core in self.cores):
            self.tasks.append(asyncio.create_task(self._watch_heartbeats()))

    async def _read(self, core: CoreConnection, on_message) -> None:
        while core.dead is None:
            frame = await core.async_socket.recv()
            while frame is not None:
                self._handle(core, frame, on_message)
                frame = _received(core.async_socket)

    def _handle(self, core: CoreConnection, frame: bytes, on_message) -> None:
        message = self.decoder.decode(frame)
        core.last_heard = time.monotonic()
        if isinstance(message, EngineState):
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif not isinstance(message, Heartbeat):
            try:
                on_message(core.index, message)
            except Exception:  # a front-end bug must not stop the reading of outputs
                logger.exception("handling engine core %d's message failed", core.index)

    def _process_exited(self, core: CoreConnection) -> None:
        self.loop.remove_reader(core.process.sentinel)
        self._mark_dead(core, f"engine core {core.index} died (exit code {core.process.exitcode})")

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S / 10)
            for core in self.cores:
                silent = time.monotonic() - core.last_heard
                if core.process is None and core.dead is None and silent > HEARTBEAT_TIMEOUT_S:
                    self._mark_dead(core, f"engine core {core.index} at {core.address} has "
                                          f"been silent for {silent:.0f} s")  # fmt: skip

    def _mark_dead(self, core: CoreConnection, reason: str) -> None:
        if core.dead is not None:
            return
        core.dead = reason
        logger.error("%s", reason)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self.on_dead(core.index, reason)

    @property
    def is_alive(self) -> bool:
        """Every core lives (a spawned core's process is asked directly: its sentinel's callback
        may not have run yet)."""
        return all(
            core.dead is None and (core.process is None or core.process.is_alive())
            for core in self.cores
        )

    def least_loaded(self) -> CoreConnection:
        live = [c for c in self.cores if c.dead is None]
        if not live:
            raise EngineDeadError(self.cores[0].dead)
        return min(live, key=lambda c: (c.num_requests, c.num_tokens))

    def send(self, core: CoreConnection, message: CoreInput) -> None:
        """Queues a message for a core without waiting (ZeroMQ sends in its own thread), after
        the requests added before it (`add`).

        Through the asyncio socket: an operation on the plain one could consume the edge of the
        socket's file descriptor that the asyncio reader waits on, and the reader would sleep.
        """
        self._flush_adds(core)
        if core.dead is None:
            core.async_socket.send(self.encoder.encode(message), copy=False)

    def add(self, core: CoreConnection, requests: list[EngineCoreRequest]) -> None:
        """Sends requests to a core at the end of this event-loop turn, in one `AddRequests`
        with every other request added meanwhile (or before any other message to that core).
        A burst of HTTP requests then reaches the core together, and it runs one step for all
        of them, not one each (with the stub runner's short steps, the core's CPU per admitted
        W request fell by half)."""
        if not core.pending_adds:
            self.loop.call_soon(self._flush_adds, core)
        core.pending_adds += requests

    def _flush_adds(self, core: CoreConnection) -> None:
        requests, core.pending_adds = core.pending_adds, []
        if requests and core.dead is None:  # a dead core's requests fail with it (on_dead)
            core.async_socket.send(self.encoder.encode(AddRequests(requests)), copy=False)

    async def get_state(self, core: CoreConnection) -> EngineState:
        """The core's state after it handled every message sent before this call."""
        if core.dead is not None:
            raise EngineDeadError(core.dead)
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self.loop.create_future()
        self.send(core, GetState(call_id))
        return await future

    def shutdown(self) -> None:
        """Stops the cores this front end spawned (killing stragglers) and closes the sockets; a
        core started on its own keeps running for the next front end."""
        for task in self.tasks:
            task.cancel()
        for core in self.cores:
            if core.process is not None and self.loop is not None and not self.loop.is_closed():
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(core.process.sentinel)
            if core.dead is None and core.process is not None:
                with contextlib.suppress(zmq.ZMQError):
                    core.socket.send(self.encoder.encode(Shutdown()), zmq.NOBLOCK)
        for core in self.cores:
            _stop_process(core.process, SHUTDOWN_TIMEOUT_S)
            core.socket.close(linger=0)
        self.context.term()


def _received(socket: zmq.asyncio.Socket) -> bytes | None:
    """A message already received, or None. pyzmq answers a non-blocking recv at once, without
    the waiting machinery of a blocking one: a front end behind its core reads the backlog of
    step outputs (a message per step, thousands when steps are short) at a fraction of the cost."""
    try:
        return socket.recv(zmq.NOBLOCK).result()
    except zmq.Again:
        return None


def _dealer(context: zmq.Context, address: str) -> zmq.Socket:
    socket = make_socket(context, zmq.DEALER)
    socket.connect(address)
    return socket


def _on_cuda(spec: EngineCoreSpec) -> bool:
    if spec.device is not None:
        return str(spec.device).startswith("cuda")
    import torch

    return torch.cuda.is_available()  # the driver only: no CUDA context in the front end


def _stop_process(process: BaseProcess | None, timeout: float) -> None:
    if process is None or process.pid is None:
        return
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
