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
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Histogram buckets in seconds: vLLM's, from sub-millisecond GPU steps to minute-long CPU replies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


class EngineMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
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
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Gap between consecutive tokens.", labels,
            registry=reg, buckets=ITL_BUCKETS,
        ).labels(model_name)  # fmt: skip
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the last token.", labels,
            registry=reg, buckets=E2E_BUCKETS,
        ).labels(model_name)  # fmt: skip
        reg.register(_StatsCollector(model_name, stats))

    def observe_finished(self, timing: RequestTiming, now: float, num_output_tokens: int) -> None:
        """A request ended normally (not aborted, not failed)."""
        self.e2e_request_latency.observe(now - timing.arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
