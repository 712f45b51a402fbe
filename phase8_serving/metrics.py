"""Metrics: what the server exposes at GET /metrics, in Prometheus text, under vLLM's names.

Problem: a server runs unattended; its operators need to see load (running and waiting requests,
KV cache usage), efficiency (prefix-cache hits, preemptions) and latency as users feel it (time to
first token, inter-token latency, end-to-end latency), without attaching a debugger.
Idea: `prometheus_client` metrics in a registry owned by one server (no process-global state).
Latencies and token counts are observed by the front end's output processor as outputs arrive from
the engine core; the rest is read from the latest `EngineStats` each core sent with its step,
summed over the cores, when Prometheus scrapes. Names are vLLM's
(`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...), so dashboards built for
vLLM read this server unchanged.

Request-level families (vLLM's `vllm:request_*`) come from the finished output alone: its token
counts, its finish reason and its `RequestTiming` (arrival, first scheduled, first token,
finished), turned into intervals by `finished_request_stats`; so whichever process makes the
outputs can record them. `vllm:iteration_tokens_total` counts, per engine step, vLLM's way: the
whole prompt of each request whose first token came in that step, plus one per new token. Over a
request's life that sums to its usage (prompt + completion tokens).
"""

import bisect
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Histogram buckets in seconds: vLLM's, from sub-millisecond GPU steps to minute-long CPU replies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS  # queue, prefill, decode and inference times
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")  # the finished_reason label's values
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True)
class FinishedRequestStats:
    """What the request-level metrics observe for one finished request (seconds, tokens)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float  # arrival -> first scheduled (WAITING)
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    inference_time: float  # first scheduled -> last token (RUNNING, preemptions included)


def finished_request_stats(
    timing: "RequestTiming", finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int
) -> FinishedRequestStats:
    """A finished request's intervals, as vLLM defines them, from the engine core's timestamps
    (one clock: intervals inside the core never mix in the front end's)."""
    return FinishedRequestStats(
        finish_reason=finish_reason,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        queue_time=timing.scheduled - timing.core_arrival,
        prefill_time=timing.first_token - timing.scheduled,
        decode_time=timing.finished - timing.first_token,
        inference_time=timing.finished - timing.scheduled,
    )


def cache_config_info(
    block_size: int, num_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool
) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (vLLM's names for our cache settings);
    `num_blocks` is the device pool as sized at start-up (kv_cache_config.py)."""
    return {
        "block_size": str(block_size),
        "num_gpu_blocks": str(num_blocks),  # the device pool, whatever the device
        "num_cpu_blocks": str(num_cpu_blocks),
        "enable_prefix_caching": str(enable_prefix_caching),
    }


@dataclass(frozen=True)
class EngineStats:
    """An engine's state after a step, sent whole by its engine core process."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced by some request
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_preemptions: int = 0


@dataclass
class RequestTiming:
    """One request's moments. `arrival` and `last_token` are the front end's clock (what users
    feel); the others the engine core's, sent with its outputs (intervals within the core)."""

    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # when the front end received the latest token
    core_arrival: float | None = None  # the core received the request
    scheduled: float | None = None  # a step first ran it
    first_token: float | None = None  # the step that produced its first token ended
    finished: float | None = None  # the step that finished it ended


class _StatsCollector(Collector):
    """Gauges and engine-side counters, read from the latest stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        values = (
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
             s.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be admitted.",
             s.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
             s.kv_cache_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up.",
             s.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found cached.",
             s.prefix_cache_hits),
            (CounterMetricFamily, "vllm:num_preemptions", "Preemptions since start.",
             s.num_preemptions),
        )  # fmt: skip
        for family, name, documentation, value in values:
            metric = family(name, documentation, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric


class CountedHistogram(Collector):
    """A Prometheus histogram that takes an observation with a count: `observe(value, count)`.

    The front end observes a whole engine step's inter-token gaps at once, and most of them are
    equal (every request that also had a token in the step before has the same gap), so one
    observation per distinct gap replaces one per token; prometheus_client's `Histogram` takes
    two locks per observation, a sixth of the front end's time per token. Fed on the event loop
    only, as /metrics is read, so it needs no lock.
    """

    def __init__(self, name: str, documentation: str, model_name: str, buckets: Sequence[float]):
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.upper_bounds = (*buckets, math.inf)
        self.counts = [0] * len(self.upper_bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += count  # le: value <= bound
        self.sum += value * count

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative = itertools.accumulate(self.counts)
        buckets = [
            (floatToGoString(b), n) for b, n in zip(self.upper_bounds, cumulative, strict=True)
        ]
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        max_model_len: int,  # the largest token count a request can have (histogram buckets)
        cache_info: Mapping[str, str],  # cache_config_info's labels
    ):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens admitted.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", labels,
            registry=reg, buckets=TTFT_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.inter_token_latency = CountedHistogram(
            "vllm:inter_token_latency_seconds", "Gap between consecutive tokens.", model_name,
            ITL_BUCKETS,
        )  # fmt: skip
        reg.register(self.inter_token_latency)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the last token.", labels,
            registry=reg, buckets=E2E_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self._add_request_families(model_name, max_model_len)
        info = Gauge("vllm:cache_config_info", "Information of the KV cache configuration.",
                     list(cache_info), registry=reg)  # fmt: skip
        info.labels(**cache_info).set(1)
        reg.register(_StatsCollector(model_name, stats))

    def _add_request_families(self, model_name: str, max_model_len: int) -> None:
        reg, labels = self.registry, ["model_name"]
        token_buckets = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, labels, registry=reg, buckets=buckets).labels(
                model_name
            )

        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of finished requests.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens of finished requests.",
            token_buckets,
        )  # fmt: skip
        self.request_times = {
            kind: histogram(f"vllm:request_{kind}_time_seconds", documentation,
                            REQUEST_LATENCY_BUCKETS)
            for kind, documentation in (
                ("queue", "Arrival to first scheduled (WAITING)."),
                ("prefill", "First scheduled to first token (PREFILL)."),
                ("decode", "First token to last token (DECODE)."),
                ("inference", "First scheduled to last token (RUNNING)."),
            )
        }  # fmt: skip
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=reg)  # fmt: skip
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step (prompts counted when their "
            "first token comes, as vLLM counts them).", ITERATION_TOKENS_BUCKETS,
        )  # fmt: skip

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        times = self.request_times
        times["queue"].observe(stats.queue_time)
        times["prefill"].observe(stats.prefill_time)
        times["decode"].observe(stats.decode_time)
        times["inference"].observe(stats.inference_time)
        self.request_success[stats.finish_reason].inc()

    def observe_step(self, num_new_tokens: int, num_iteration_tokens: int,
                     inter_token_latencies: Mapping[float, int]) -> None:  # fmt: skip
        """One engine step: its new tokens, its tokens counted vLLM's way (see the module
        docstring), and its gaps between a request's tokens (gap -> how many requests had it).
        Once per step, not per request: a request's share would cost more than its token."""
        self.generation_tokens.inc(num_new_tokens)
        self.iteration_tokens.observe(num_iteration_tokens)
        for gap, count in inter_token_latencies.items():
            self.inter_token_latency.observe(gap, count)

    def observe_finished(self, timing: "RequestTiming", now: float, finish_reason: str,
                         num_prompt_tokens: int, num_output_tokens: int) -> None:  # fmt: skip
        """A request ended normally (not aborted, not failed)."""
        self.e2e_request_latency.observe(now - timing.arrival)
        self.record_finished(
            finished_request_stats(timing, finish_reason, num_prompt_tokens, num_output_tokens)
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
