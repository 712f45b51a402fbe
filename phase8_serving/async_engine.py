"""Async engine: the front end of one or more engine core processes, one stream per HTTP request.

Problem: a server's requests arrive one at a time, at any time, from clients that each wait on their
own connection, want their tokens as soon as they exist, and may hang up halfway. The engine that
makes the tokens must never wait for any of that, nor share a GIL with it.
Idea (vLLM v1's `AsyncLLM`): the engine runs in engine core processes (engine_core.py) reached
through `EngineCoreClient` (core_client.py). This object, on the server's event loop, owns
everything that is text: the tokenizer (its work runs in `tokenizer_pool`, off the loop), the
output processor (output_processor.py: detokenizing, stop strings, deltas) and the metrics. A
background task per core reads one message per engine step and hands every request its delta.
The kitchen (the cores) only cooks; the front desk (this) takes orders and plates the dishes.

Invariants:
- `add_requests` checks every prompt against the core's limits first (a ValueError, before
  anything is sent), then sends all of an HTTP request's prompts in ONE message to one core
  (the least loaded; with the other requests added in the same event-loop turn), so they are
  admitted together, as one group: the core's scheduler is fair between HTTP requests, so one
  with n=16 choices does not keep another's first token waiting;
- a stream closed before it finished aborts all its unfinished engine requests in one message;
- a core that dies fails the requests it held (`EngineDeadError`) and `is_alive` turns False;
  a failed step fails its requests (`EngineStepError`); no request ever waits forever;
- a core takes snapshots (for `on_engine_stats`) only while someone watches it (`watch_engine`).
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Sequence

from .config import check_priority
from .core_client import EngineCoreClient, EngineDeadError
from .core_messages import (
    AbortRequests,
    CoreInfo,
    EngineCoreRequest,
    EngineState,
    StepOutputs,
    WatchEngine,
)
from .engine_core import EngineCoreSpec
from .metrics import EngineMetrics, EngineStats, cache_config_info
from .output_processor import (
    EngineStepError,
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
)
from .sampling_params import PROMPT_LOGPROBS_NEED_ONE_RANK, SamplingParams
from .streaming import OutputDelta
from .structured_output import check_byte_level
from .tokenizer import Tokenizer

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStepError", "RequestStream"]
logger = logging.getLogger(__name__)
TOKENIZER_THREADS = 2  # tokenizing and chat templates run here, never on the event loop
StatsCallback = Callable[[int, dict], None]  # (core index, the core's snapshot dict)


class RequestStream:
    """An HTTP request's outputs: each item maps choice indexes to their new deltas."""

    def __init__(self, llm: "AsyncLLM", request_ids: list[str], collector: RequestOutputCollector):
        self.llm = llm
        self.request_ids = request_ids  # one per choice, in choice order
        self.collector = collector
        self.unfinished = set(range(len(request_ids)))
        self.failed = False  # the engine failed it (a step error, a dead core)
        self.abandoned = False  # closed before it finished, by its reader

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> dict[int, OutputDelta]:
        if self.finished:
            raise StopAsyncIteration
        try:
            deltas = await self.collector.get()
        except (EngineStepError, EngineDeadError):
            self.failed = True
            self.close()
            raise
        self.unfinished -= {i for i, d in deltas.items() if d.finish_reason is not None}
        return deltas

    def close(self) -> None:
        """Aborts the unfinished choices; safe to call more than once."""
        if self.unfinished:
            self.abandoned = not self.failed
            self.llm.abort([self.request_ids[i] for i in sorted(self.unfinished)])
            self.unfinished.clear()


class AsyncLLM:
    def __init__(self, client: EngineCoreClient, tokenizer: Tokenizer, model_name: str):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.core_stats = [EngineStats() for _ in client.cores]
        info = client.info
        cache_info = cache_config_info(
            info.block_size, info.num_kv_slots // info.block_size, info.num_cpu_kv_blocks,
            info.enable_prefix_caching,
        )  # fmt: skip
        self.metrics = EngineMetrics(model_name, lambda: self.stats, info.max_model_len, cache_info)
        self.processor = OutputProcessor(tokenizer, self.metrics)
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="tokenizer"
        )
        self._stats_callbacks: list[StatsCallback] = []
        self._watchers = [0] * len(client.cores)  # per core, see watch_engine
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def spawn(
        cls, spec: EngineCoreSpec, model_name: str, data_parallel_size: int = 1
    ) -> "AsyncLLM":
        """Starts the engine cores (blocking until they answer) and the front end around them."""
        tokenizer = Tokenizer.from_dir(spec.model)  # a bad checkpoint fails before any spawn
        return cls(EngineCoreClient.spawn(spec, data_parallel_size), tokenizer, model_name)

    @classmethod
    def connect(cls, model_dir: str, addresses: list[str], model_name: str) -> "AsyncLLM":
        """A front end for cores started elsewhere (`mini-vllm engine-core`); `model_dir` gives
        the tokenizer, which must be the cores' checkpoint's."""
        return cls(EngineCoreClient.connect(addresses), Tokenizer.from_dir(model_dir), model_name)

    @property
    def info(self) -> CoreInfo:
        """The engine's limits (every core runs the same model and configuration)."""
        return self.client.info

    @property
    def stats(self) -> EngineStats:
        """The latest stats of every core, summed (the KV usage averaged)."""
        total = {f.name: sum(getattr(s, f.name) for s in self.core_stats)
                 for f in dataclasses.fields(EngineStats)}  # fmt: skip
        total["kv_cache_usage"] /= len(self.core_stats)
        return EngineStats(**total)

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive

    def on_engine_stats(self, callback: StatsCallback) -> None:
        """`callback(core_index, snapshot)` for every snapshot a core sends: only while it is
        watched (`watch_engine`), at a bounded rate (`EngineCoreSpec.snapshot_interval_s`). It
        runs on the event loop and must be quick."""
        self._stats_callbacks.append(callback)

    def watch_engine(self, watching: bool, cores: Sequence[int] | None = None) -> None:
        """One more watcher (True) or one fewer (False) of these cores' snapshots (default: all);
        a core snapshots while it has a watcher. Call it on the event loop."""
        self._start()
        indexes = range(len(self.client.cores)) if cores is None else cores
        if not watching and any(self._watchers[i] == 0 for i in indexes):
            raise ValueError(f"engine cores {list(indexes)}: one has no watcher to remove")
        for i in indexes:
            before = self._watchers[i]
            self._watchers[i] += 1 if watching else -1
            if (before == 0) != (self._watchers[i] == 0):  # the first came, or the last left
                self.client.send(self.client.cores[i], WatchEngine(watching))

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self.client.start(self._on_message, self._on_dead)
        elif loop is not self._loop:
            raise RuntimeError("an AsyncLLM serves the one event loop it started on")

    async def run_in_tokenizer_pool(self, fn: Callable, *args):
        """Runs CPU work a client can make large (tokenizing, templates) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    async def add_requests(
        self, request_id: str, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
        priority: int = 0,
    ) -> RequestStream:  # fmt: skip
        """Sends one engine request per (prompt, params), all to one core in one message, all of
        `priority` (lower first, under scheduling_policy "priority").

        Raises ValueError (nothing sent) if a prompt breaks the engine's limits, and
        EngineDeadError if an engine core has died.
        """
        self._start()
        check_priority(priority, self.info.scheduling_policy)
        for prompt, p in zip(prompts, params, strict=True):
            check_prompt(self.info, prompt, p)
            p.check_allowed_tokens(self.tokenizer.eos_token_ids)
            if p.bad_words:  # the engine tokenizes them again: only its own copy is used
                p.bad_words_token_ids(lambda w: self.tokenizer.encode(w, add_special_tokens=False))
            if p.structured_outputs is not None:
                check_byte_level(self.tokenizer)
        if not self.client.is_alive:
            raise EngineDeadError("an engine core has died; the server cannot take requests")
        core = self.client.least_loaded()
        collector = RequestOutputCollector()
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        requests = []
        for index, (engine_id, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
            self.processor.add(
                RequestState.start(engine_id, index, collector, self.tokenizer, prompt, p,
                                   core.index)
            )  # fmt: skip
            core.num_requests += 1
            core.num_tokens += len(prompt) + p.max_tokens
            requests.append(EngineCoreRequest(engine_id, prompt, p, request_id, priority))
        self.client.add(core, requests)
        return RequestStream(self, ids, collector)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Forgets requests here and aborts them in their cores (one message per core)."""
        by_core: dict[int, list[str]] = {}
        for state in self._release(self.processor.remove(request_ids)):
            by_core.setdefault(state.core, []).append(state.request_id)
        for core, ids in by_core.items():
            self.client.send(self.client.cores[core], AbortRequests(ids))

    async def engine_state(self) -> list[EngineState]:
        """Every core's state, after it handled everything sent to it before this call."""
        self._start()
        return await asyncio.gather(*(self.client.get_state(c) for c in self.client.cores))

    def _release(self, states: list[RequestState]) -> list[RequestState]:
        for state in states:
            core = self.client.cores[state.core]
            core.num_requests -= 1
            core.num_tokens -= state.num_prompt_tokens + state.max_tokens
        return states

    def _on_message(self, core: int, message) -> None:
        if not isinstance(message, StepOutputs):
            return
        finished, to_abort = self.processor.process(message)
        self._release(finished)
        if to_abort:  # stop strings found here: the core would otherwise go on generating
            self.client.send(self.client.cores[core], AbortRequests(to_abort))
        self.core_stats[core] = message.stats
        if message.snapshot is not None:
            for callback in self._stats_callbacks:
                callback(core, message.snapshot)

    def _on_dead(self, core: int, reason: str) -> None:
        self._release(self.processor.fail_core(core, EngineDeadError(reason)))

    def shutdown(self) -> None:
        self.client.shutdown()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def check_prompt(info: CoreInfo, prompt: list[int], params: SamplingParams) -> None:
    """The engine's own admission checks, made before the request leaves the front end."""
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    params.check_token_ids(info.vocab_size)
    if params.prompt_logprobs is not None and info.tensor_parallel_size > 1:
        raise ValueError(PROMPT_LOGPROBS_NEED_ONE_RANK)
    if min(prompt) < 0 or max(prompt) >= info.vocab_size:
        outside = [t for t in prompt if not 0 <= t < info.vocab_size]
        raise ValueError(
            f"prompt token ids must be ints in [0, {info.vocab_size}): {outside[:5]} are out of "
            "vocabulary"
        )
    max_len = len(prompt) + params.max_tokens
    if max_len > info.max_model_len:  # within the model's context and the KV cache
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({info.max_model_len})"
        )
    if not info.enable_chunked_prefill and max_len > info.max_num_batched_tokens:
        raise ValueError(
            f"without chunked prefill, prompt + max_tokens ({max_len}) must fit in one step's "
            f"token budget (max_num_batched_tokens={info.max_num_batched_tokens})"
        )
