"""The engine core: a process that does nothing but step the engine (vLLM v1's `EngineCore`).

Problem: with the engine in a thread of the HTTP server's process, the server kept a third of what
its engine can do. A profile at saturation (py-spy, H200) gave the engine thread 65% of the
samples, a third of them spent turning token ids into text and holding back stop strings, and the
event loop the rest; both fought for one GIL, so the GPU waited on Python that had nothing to do
with it.
Idea: the scheduler, the block manager and the model runner live in a process of their own, the
only one that touches the GPU, and speak token ids only. The front end (async_engine.py) owns
everything that is text. They speak over one ZeroMQ socket (a ROUTER here), in the messages of
core_messages.py: requests in, batched; ONE `StepOutputs` out per engine step.

Invariants:
- the core never detokenizes: the engine speaks token ids only (`TokenIdsOutput`); stop tokens,
  EOS and max_tokens end a request here, stop strings in the front end (which then aborts it);
- inputs are drained, all of them, between steps: a step never runs with an abort still unread,
  and a `GetState` reply reflects every message sent before it;
- idle, the core blocks on its socket (a heartbeat every `HEARTBEAT_INTERVAL_S`, no busy poll);
- no watcher, no snapshot: snapshots are taken only between `WatchEngine(True)` and
  `WatchEngine(False)` (or the next front end's `Hello`), each at least `snapshot_interval_s`
  after the one before and late enough that they take at most `MAX_SNAPSHOT_DUTY` of the
  core's time (its CPU time: a core descheduled mid-snapshot on a busy host is not held to
  seconds without frames); a watcher never stays on a state the engine has left (a core that
  goes idle sends the snapshot it owes when it is due);
- a failing step fails the requests in flight (finish reason "error") and the loop goes on;
- a core started by a front end exits when that front end's process is gone; a core started on
  its own serves whichever front end said `Hello` last, and drops the requests of the one before.
"""

import gc
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import msgspec
import zmq

from .config import EngineConfig
from .core_messages import (
    AbortRequests,
    AddRequests,
    CoreInfo,
    CoreInput,
    CoreOutput,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineState,
    Heartbeat,
    Hello,
    Shutdown,
    StepOutputs,
    WatchEngine,
    make_socket,
)
from .engine import LLM, LLMEngine, TokenIdsOutput
from .metrics import EngineStats
from .snapshot import engine_snapshot

logger = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 1.0  # an idle core says it is alive this often
SNAPSHOT_INTERVAL_S = 0.1  # a watched core snapshots at most ten times a second...
MAX_SNAPSHOT_DUTY = 0.0025  # ...and spends at most 0.25% of its time on snapshots
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # `mini-vllm`'s, in every process


# -- what a core is built from --------------------------------------------------------------------


def build_llm(spec: "EngineCoreSpec") -> LLM:
    """The engine a core runs, with its tensor-parallel workers if any (children of the core)."""
    kwargs = {f.name: getattr(spec.config, f.name) for f in fields(EngineConfig)}
    return LLM(spec.model, dtype=spec.dtype, device=spec.device, seed=spec.seed, **kwargs)


@dataclass(frozen=True)
class EngineCoreSpec:
    """How to build one engine core. Picklable: it travels to the spawned process, so the
    callables must be module-level functions (tests and benchmarks pass their own)."""

    model: str  # a local checkpoint directory (the front end resolved hub ids already)
    dtype: str = "auto"
    device: str | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    make_llm: Callable[["EngineCoreSpec"], LLM] = build_llm
    # engine -> plain dict for the front end's stats callback, taken only while watched (the
    # core adds "cost_s", what it took, and "step_num_tokens", the tokens each step produced
    # since the last one); None: no snapshots even when watched
    snapshot: Callable[[LLMEngine], dict] | None = engine_snapshot
    snapshot_interval_s: float = SNAPSHOT_INTERVAL_S  # the least time between two snapshots
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of this core (data parallelism)
    num_threads: int | None = None  # torch's CPU threads; None: torch's default
    seed: int | None = None  # torch's, once built: unseeded requests draw from it (`LLM(seed=)`)

    def __post_init__(self):
        if not self.snapshot_interval_s > 0:
            raise ValueError(f"snapshot_interval_s must be > 0, got {self.snapshot_interval_s}")


def engine_stats(engine: LLMEngine) -> EngineStats:
    scheduler, bm = engine.scheduler, engine.block_manager
    return EngineStats(
        num_running=len(scheduler.running),
        # swapped-out requests (phase 5) wait too, with their KV blocks on the CPU
        num_waiting=len(scheduler.waiting) + len(scheduler.swapped),
        kv_cache_usage=bm.num_used_blocks / len(bm.blocks),
        prefix_cache_queries=bm.num_queried_tokens,
        prefix_cache_hits=bm.num_hit_tokens,
        num_preemptions=engine.num_preemptions,
    )


# -- the core loop --------------------------------------------------------------------------------


class EngineCore:
    """The loop: drain the socket, step, send one message; block on the socket when idle."""

    def __init__(self, engine: LLMEngine, spec: EngineCoreSpec, socket: zmq.Socket):
        self.engine = engine
        self.spec = spec
        self.socket = socket  # a ROUTER: the front end is whichever peer spoke last
        self.peer: bytes | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        # id -> [arrival, scheduled, prompt tokens found cached], until its first output
        self.timing: dict[str, list[float | int | None]] = {}
        self.watched = False  # a front end asked for snapshots (WatchEngine)
        self.snapshot_owed = False  # watched, and the engine changed since the last snapshot
        self.next_snapshot_at = 0.0  # time.monotonic(): no snapshot before it
        self.step_num_tokens: list[int] = []  # since the last snapshot, while watched

    def run(self, parent_pid: int | None) -> None:
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:  # a syscall, ~1 us
                logger.info("the front end is gone; the engine core exits")
                return
            if not self.engine.has_unfinished_requests():
                if not self.socket.poll(math.ceil(self._idle_wait_s() * 1000)):  # ms
                    self._send_idle()
                    continue
            if not self._drain_inputs():
                return
            if self.engine.has_unfinished_requests():
                self._step()

    def _drain_inputs(self) -> bool:
        """Handles every message already received; False once told to shut down."""
        while True:
            try:
                peer, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            message = self.decoder.decode(frame)
            if isinstance(message, Hello) and self.peer not in (None, peer):
                self._abort_all()  # a new front end: the old one's requests have nobody to read
            self.peer = peer
            if isinstance(message, Shutdown):
                return False
            self._handle(message)

    def _abort_all(self) -> None:
        logger.info("a new front end connected; aborting %d requests", len(self.engine.requests))
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self.timing.clear()

    def _handle(self, message: CoreInput) -> None:
        engine = self.engine
        if isinstance(message, Hello):
            self._watch(False)  # a new front end: nobody watches yet
            self._send(core_info(engine))
        elif isinstance(message, AddRequests):
            self._add(message.requests)
            self.snapshot_owed = self.watched
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                engine.abort_request(request_id)
                self.timing.pop(request_id, None)
            self.snapshot_owed = self.watched  # an idle core still shows the freed blocks
            if not engine.requests:  # no step will follow to report it: the gauges go idle now
                self._send(StepOutputs([], time.monotonic(), engine_stats(engine)))
        elif isinstance(message, WatchEngine):
            self._watch(message.watching)
        else:  # GetState
            bm, scheduler = engine.block_manager, engine.scheduler
            self._send(
                EngineState(
                    message.call_id, len(engine.requests), len(scheduler.running),
                    len(scheduler.waiting) + len(scheduler.swapped), bm.num_free_blocks,
                    len(bm.blocks),
                )
            )  # fmt: skip

    def _add(self, requests: list[EngineCoreRequest]) -> None:
        now = time.monotonic()
        rejected = []
        for r in requests:
            try:
                self.engine.add_request(
                    r.prompt_token_ids, r.params, r.request_id, r.group_id, r.priority
                )
            except ValueError as e:  # the front end checks first; this is the last line
                rejected.append(EngineCoreOutput(r.request_id, [], None, "error", str(e)))
                continue
            self.timing[r.request_id] = [now, None, 0]
        if rejected:
            self._send(StepOutputs(rejected, time.monotonic(), engine_stats(self.engine)))

    def _step(self) -> None:
        start = time.monotonic()
        in_flight = list(self.engine.requests)
        try:
            results = self.engine.step()
        except Exception as e:  # a bug or an exhausted device: fail what was in flight, go on
            logger.exception("engine step failed; failing %d requests", len(in_flight))
            outputs = []
            for request_id in in_flight:
                self.engine.abort_request(request_id)
                self.timing.pop(request_id, None)
                outputs.append(
                    EngineCoreOutput(request_id, [], None, "error", f"the engine failed: {e}")
                )
        else:
            self._note_scheduled(start)
            outputs = [self._output(result, start) for result in results]
        if self.watched:
            self.step_num_tokens.append(sum(len(o.new_token_ids) for o in outputs))
            self.snapshot_owed = True
        now = time.monotonic()
        self._send(StepOutputs(outputs, now, engine_stats(self.engine), self._snapshot(now)))

    def _note_scheduled(self, step_start: float) -> None:
        """The requests this step admitted were first run by it (a preempted one admitted
        again has its time already)."""
        for seq in self.engine.last_schedule.admitted:
            timing = self.timing.get(seq.request_id)
            if timing is not None and timing[1] is None:
                timing[1], timing[2] = step_start, max(seq.num_cached_tokens, 0)

    def _output(self, result: TokenIdsOutput, step_start: float) -> EngineCoreOutput:
        output = EngineCoreOutput(
            result.request_id, result.new_token_ids, result.new_logprobs, result.finish_reason
        )
        if result.prompt_logprobs is not None:
            output.prompt_logprobs = result.prompt_logprobs
        timing = self.timing.pop(result.request_id, None)
        if timing is not None:  # its first output
            output.arrival_time = timing[0]
            output.scheduled_time = timing[1] if timing[1] is not None else step_start
            output.num_cached_tokens = timing[2]
        return output

    def _watch(self, watching: bool) -> None:
        self.watched = watching and self.spec.snapshot is not None
        self.snapshot_owed = self.watched  # a new watcher gets the engine's state, idle or not
        self.step_num_tokens = []

    def _snapshot(self, now: float) -> dict | None:
        """The snapshot owed to the watcher if it is due, else None; spaced so that snapshots
        take at most `MAX_SNAPSHOT_DUTY` of the core's time."""
        if not self.snapshot_owed or now < self.next_snapshot_at:
            return None
        start = time.thread_time()  # CPU time: waiting for a core of the host costs nothing here
        picture = self.spec.snapshot(self.engine)
        cost_s = time.thread_time() - start
        picture = {**picture, "cost_s": cost_s, "step_num_tokens": self.step_num_tokens}
        self.step_num_tokens = []
        self.snapshot_owed = False
        self.next_snapshot_at = now + max(self.spec.snapshot_interval_s, cost_s / MAX_SNAPSHOT_DUTY)
        return picture

    def _idle_wait_s(self) -> float:
        """How long an idle core blocks on its socket: until its next heartbeat, or until the
        snapshot it owes a watcher is due (the page then shows the engine as it went idle)."""
        if self.snapshot_owed:
            return max(0.0, min(HEARTBEAT_INTERVAL_S, self.next_snapshot_at - time.monotonic()))
        return HEARTBEAT_INTERVAL_S

    def _send_idle(self) -> None:
        """Nothing arrived while idle: the snapshot owed if it is due, else a heartbeat."""
        now = time.monotonic()
        snapshot = self._snapshot(now)
        if snapshot is None:
            self._send(Heartbeat())
        else:
            self._send(StepOutputs([], now, engine_stats(self.engine), snapshot))

    def _send(self, message: CoreOutput) -> None:
        if self.peer is not None:  # nobody to tell before the front end's first message
            self.socket.send_multipart((self.peer, self.encoder.encode(message)), copy=False)


def core_info(engine: LLMEngine) -> CoreInfo:
    model_config, config = engine.model.config, engine.config
    return CoreInfo(
        vocab_size=model_config.vocab_size,
        max_position_embeddings=model_config.max_position_embeddings,
        max_model_len=engine.kv_cache_config.max_model_len,
        # the cache as built (its size may be computed at start-up, not given in the config)
        num_kv_slots=len(engine.block_manager.blocks) * config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        device=str(engine.runner.device),
        block_size=config.block_size,
        num_cpu_kv_blocks=config.num_cpu_kv_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        tensor_parallel_size=engine.model.tp.size,
        scheduling_policy=config.scheduling_policy.value,
    )


def freeze_startup_heap() -> None:
    """Marks everything alive once the engine is built (torch, the model, the tokenizer) as
    permanent, so the collector's full passes, set off by the objects every step allocates, stop
    walking it (vLLM's engine core does the same)."""
    gc.collect()
    gc.freeze()


def run_engine_core(
    spec: EngineCoreSpec, address: str, parent_pid: int | None = None, log_level: int | None = None
) -> None:
    """The engine core process's body: bind `address`, build the engine, loop until told to stop.

    `parent_pid`: the front end that spawned this core, watched while idle; None for a core
    started on its own (`mini-vllm engine-core`), which runs until it is stopped. `log_level`:
    the front end's, for a spawned core (a spawned process starts with logging unconfigured, and
    would drop its start-up lines: the KV cache's size among them).

    Stopping is quiet. Ctrl-C, or a SIGTERM sent to the process group (a service manager's), reaches
    a spawned core together with its front end, whose call it is: the front end lets requests in
    flight finish (`--shutdown-timeout`), then sends `Shutdown`, so the core ignores both signals
    (and still exits if the front end itself is gone). A core on its own stops on either, through
    the same cleanup. Either way it exits with code 0.
    """
    if parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, stop_on_signal)
    if log_level is not None:
        logging.basicConfig(level=log_level, format=LOG_FORMAT)
    if spec.visible_devices is not None:  # before anything initializes CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    if spec.num_threads is not None:
        import torch

        torch.set_num_threads(spec.num_threads)
    context = zmq.Context()
    socket = make_socket(context, zmq.ROUTER)
    socket.bind(address)  # first: a taken address fails before the slow load
    llm = None
    try:
        llm = spec.make_llm(spec)
        freeze_startup_heap()
        EngineCore(llm.engine, spec, socket).run(parent_pid)
    except KeyboardInterrupt:  # a core on its own, stopped by Ctrl-C or SIGTERM
        logger.info("engine core stopped")
    finally:
        if llm is not None:
            llm.shutdown()
        # frozen objects are never freed: at exit triton's bindings would report them as leaks
        gc.unfreeze()
        socket.close()
        context.term()


def stop_on_signal(signum: int, frame) -> None:
    raise KeyboardInterrupt  # leaves the loop through run_engine_core's cleanup
