"""The messages between the front end and an engine core: what crosses the process boundary.

Problem: the engine core (engine_core.py) and the front end (core_client.py, async_engine.py)
live in different processes, maybe on different machines; every engine step sends news of
hundreds of requests, so the encoding must cost microseconds and say exactly what it carries.
Idea (vLLM v1's `EngineCoreRequest` and `EngineCoreOutputs`): msgspec structs, encoded as
msgpack arrays (no field names on the wire), each message led by its class name (a tagged union,
so one decoder per direction reads them all). Token ids cross the boundary, never text.
- in, batched: `AddRequests` (every prompt of the HTTP requests of one event-loop turn in one
  message), `AbortRequests` (a client left, or the front end found a stop string), `GetState`
  (a small request/reply), `WatchEngine` (a dashboard page opened or closed), and `Hello`,
  answered with `CoreInfo` (what the front end must know to validate prompts), and `Shutdown`;
- out: ONE `StepOutputs` per engine step, with every request's new token ids (logprobs when
  asked), finish reasons, the core's timestamps, `EngineStats` for /metrics and, while watched and
  at a bounded rate, a `snapshot` dict for dashboards (snapshot.py); `Heartbeat` while idle.
They travel on ZMQ sockets made by `make_socket`: a ROUTER in the core, a DEALER per front end.
"""

import msgspec
import zmq

from .logprobs import TokenLogprobs
from .metrics import EngineStats
from .sampling_params import SamplingParams


def make_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    """A socket that neither drops nor blocks however far its peer falls behind. ZMQ's default
    high-water mark (1,000 messages each side) would make the core's ROUTER silently drop the
    step outputs a slow front end has not read, leaving those requests waiting forever, and a
    DEALER block the front end's event loop. The backlog is bounded anyway: by the steps the
    engine runs meanwhile, and by the requests a front end admits."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)  # 0: no limit
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


# -- messages (front end -> core) -----------------------------------------------------------------


class Message(msgspec.Struct, tag=True, array_like=True):
    """A message of either direction: a msgpack array led by its class name (the tag)."""


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: str | None = None  # the client request it is a choice of (the scheduler's fairness)
    priority: int = 0  # lower first, under scheduling_policy "priority"


class Hello(Message):
    """The front end's first message; the core answers with its `CoreInfo`."""


class AddRequests(Message):
    requests: list[EngineCoreRequest]


class AbortRequests(Message):
    request_ids: list[str]


class GetState(Message):
    call_id: int


class WatchEngine(Message):
    """Whether someone watches this core's snapshots (the dashboard's first page opened, or its
    last one closed); a core starts unwatched."""

    watching: bool


class Shutdown(Message):
    pass


CoreInput = Hello | AddRequests | AbortRequests | GetState | WatchEngine | Shutdown


# -- messages (core -> front end) -----------------------------------------------------------------


class CoreInfo(Message):
    """What the front end checks a prompt against before sending it (the engine's own checks)."""

    vocab_size: int
    max_position_embeddings: int
    max_model_len: int  # prompt + output tokens, at most (the engine's, kv_cache_config.py)
    num_kv_slots: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    device: str
    # the cache's settings, for /metrics (vllm:cache_config_info)
    block_size: int
    num_cpu_kv_blocks: int
    enable_prefix_caching: bool
    tensor_parallel_size: int = 1  # prompt_logprobs needs 1
    scheduling_policy: str = "fcfs"  # "priority": requests' priorities count


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one step. Untracked by the garbage collector (`gc=False`: it
    holds no cycles), so the hundreds made every step set off no collections."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" (a stop token: it has no text), "length", "error"
    error: str | None = None  # why, for "error"
    arrival_time: float | None = None  # the core's clock, on a request's first output only
    scheduled_time: float | None = None  # when a step first ran it, likewise
    num_cached_tokens: int | None = None  # its prompt's prefix cache hit, likewise
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # likewise, if asked


class StepOutputs(Message):
    outputs: list[EngineCoreOutput]
    timestamp: float  # the core's clock when the step ended
    stats: EngineStats
    snapshot: dict | None = None  # `EngineCoreSpec.snapshot`'s dict, while watched (at a bounded
    # rate); a message without outputs may carry one (a core that went idle, a watcher who came)


class EngineState(Message):
    call_id: int
    num_requests: int  # requests the engine holds, running or waiting
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int


class Heartbeat(Message):
    pass


CoreOutput = CoreInfo | StepOutputs | EngineState | Heartbeat
