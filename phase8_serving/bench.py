"""`mini-vllm bench throughput|latency|serve`: measure an engine the way vLLM's `bench` does.

- `throughput`: offline, one `LLM.generate` over a seeded random dataset; output tokens (and
  total tokens) per second of wall time, prefill included.
- `latency`: one batch of fixed-length requests, generated `--num-iters` times; seconds per batch.
- `serve`: a client for any OpenAI-compatible server (`/v1/completions`, streaming). Requests
  arrive as a Poisson process at `--request-rate` (or all at once), with at most
  `--max-concurrency` in flight; several rates in one run give a latency-vs-load curve.

The serving metrics use vLLM's definitions, so numbers compare with `vllm bench serve`:
TTFT is the time from sending a request to the first chunk with a choice in it (its text may be
empty: a token can complete no character, or be a special token); ITL the gaps between later such
chunks; TPOT = (E2E - TTFT) / (output tokens - 1), per request with at least
two output tokens; E2E the whole request; goodput the requests per second that meet every SLO
given with `--goodput`. Output tokens are the server's own count (`usage`, requested through
`stream_options.include_usage`).
"""

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

PERCENTILES = (50, 90, 99)
# vLLM's random dataset draws token ids from the whole vocabulary minus the special tokens;
# workload W (nano-vllm's bench) uses ids below 10,000, which every tokenizer here has.
RANDOM_TOKEN_ID_LIMIT = 10_000

# Workload W, nano-vllm's bench.py workload: 256 requests, prompts of 100-1,024 random ids below
# 10,001, max_tokens 100-1,024, ignore_eos, temperature 0.6. 142,827 prompt + 133,966 output tokens.
W_NUM_REQUESTS = 256
W_PROMPT_LEN = (100, 1024)
W_OUTPUT_LEN = (100, 1024)
W_ID_RANGE = 10001  # randint(0, 10000): ids 0..10000
W_TEMPERATURE = 0.6


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def seeded_workload(
    seed: int,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
) -> list[BenchRequest]:
    """Random prompts (ids below `vocab_size`) and output lengths, both uniform in their inclusive
    ranges, the same for the same arguments wherever they are drawn (benchmarks/harness.py draws
    the repository's benchmarks' the same way: a test holds the two to the same W).

    Drawn like nano-vllm's bench.py (all prompts first, then all output lengths), so that
    workload W is `workload_w()`.
    """
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, vocab_size - 1) for _ in range(rng.randint(*prompt_len))]
        for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return [BenchRequest(p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def workload_w() -> list[BenchRequest]:
    return seeded_workload(0, W_NUM_REQUESTS, W_PROMPT_LEN, W_OUTPUT_LEN, W_ID_RANGE)


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_id_limit: int = RANDOM_TOKEN_ID_LIMIT,
) -> list[BenchRequest]:
    """vLLM's random dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)].

    With input_len = output_len = 562 and range_ratio 0.82 the lengths span 101..1,022, the
    shape of workload W.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if token_id_limit < 1:
        raise ValueError(f"--random-token-id-limit must be >= 1, got {token_id_limit}")

    def span(mean: int) -> tuple[int, int]:
        return max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio))

    return seeded_workload(seed, num_prompts, span(input_len), span(output_len), token_id_limit)


def environment() -> dict:
    """Date, commit, machine and versions: what every benchmark's JSON records beside its numbers
    (benchmarks/harness.py stamps the repository's benchmarks the same way)."""
    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return env


def git_commit() -> str:
    """The commit that ran. `MINI_VLLM_COMMIT` wins when set: a copied working tree (the GPU
    box's) may carry a stale .git that would name an older commit."""
    if os.environ.get("MINI_VLLM_COMMIT"):
        return os.environ["MINI_VLLM_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def write_json(payload: dict, out: str | None, name: str) -> Path:
    """Write to `--out` (a .json file or a directory), by default a scratch directory."""
    path = Path(out) if out else Path(tempfile.gettempdir()) / "mini-vllm-bench"
    if path.suffix != ".json":
        path = path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


# --- serve: the HTTP client ---------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk with a choice
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one_request(client, url: str, body: dict, headers: dict) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if error := chunk.get("error"):  # the server failed the request mid-stream
                    message = error.get("message") if isinstance(error, dict) else error
                    result.error = f"server error: {message}"
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # vLLM's rule: text or not, a token came
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as exc:  # a failed request is a measurement, not a crash of the client
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    if not result.ok:
        result.error = "no choice in the stream"
    return result


async def _run_at_rate(args, requests: list[BenchRequest], rate: float) -> dict:
    import httpx

    url = args.base_url.rstrip("/") + "/v1/completions"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")  # not a default: --help shows those
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed)

    async def send(request: BenchRequest, client) -> RequestResult:
        body = {
            "model": args.model,
            "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with limit:
            return await _one_request(client, url, body, headers)

    timeout = httpx.Timeout(None)
    connections = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=connections) as client:
        tasks = []
        start = time.perf_counter()
        for request in requests:
            tasks.append(asyncio.create_task(send(request, client)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate, args)


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ordered = sorted(v * 1000 for v in values)
    stats = {"mean": statistics.fmean(ordered)}
    for p in PERCENTILES:
        stats[f"p{p}"] = ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]
    return stats


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`--goodput ttft:500 tpot:50 e2el:20000` (milliseconds), vLLM's syntax."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value) / 1000
    return slos


def summarize(results: list[RequestResult], duration: float, rate: float, args) -> dict:
    done = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    slos = parse_slos(args.goodput)

    def meets(r: RequestResult) -> bool:
        tpot_r = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        measured = {"ttft": r.ttft, "tpot": tpot_r, "e2el": r.e2e}
        return all(measured[name] <= limit for name, limit in slos.items())

    output_tokens = sum(r.output_tokens for r in done)
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": args.max_concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "total_output_tokens": output_tokens,
        "goodput": sum(meets(r) for r in done) / duration if slos else None,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl]),
        "e2el_ms": _stats_ms([r.e2e for r in done]),
    }


def offered_load(runs: list[dict]) -> tuple[list[float], list[str]]:
    """Each run's x position and tick label: the rate it was offered, never the rate it achieved
    (on a noisy run the achieved rate can fall as the offered one rises, and latency would seem
    to fall with load). All at once (`inf`) sits one step right of the highest finite rate."""
    finite = [run["request_rate"] for run in runs if run["request_rate"] != "inf"]
    step = max(finite) / len(finite) if finite else 1.0
    beyond = max(finite, default=0.0) + step
    x, labels = [], []
    for rate in (run["request_rate"] for run in runs):
        x.append(beyond if rate == "inf" else rate)
        labels.append("all at once" if rate == "inf" else f"{rate:g}")
    return x, labels


def plot_serve(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, labels = offered_load(runs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for p in ("p50", "p99"):
            ax.plot(x, [run[metric][p] for run in runs], marker="o", label=p)
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered requests / s (Poisson arrivals)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.suptitle("latency against load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_serve(args) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury results
    runs = []
    for i, rate in enumerate(args.request_rate):
        # A fresh dataset per rate (seed + i): the server's prefix cache must not hand a later
        # rate the prompts an earlier one already computed.
        requests = random_dataset(
            args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed + i, args.random_token_id_limit,
        )  # fmt: skip
        run = asyncio.run(_run_at_rate(args, requests, rate))
        run["seed"] = args.seed + i
        run["prompt_tokens"] = sum(len(r.prompt_ids) for r in requests)
        run["requested_output_tokens"] = sum(r.max_tokens for r in requests)
        print(_format_run(run))
        runs.append(run)
    payload = {
        "benchmark": "serve",
        "environment": environment(),
        "base_url": args.base_url,
        "model": args.model,
        "dataset": {
            "num_prompts": args.num_prompts,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "seed": f"{args.seed} + the rate's index (a fresh dataset per rate)",
        },
        "goodput_slos_ms": {k: v * 1000 for k, v in parse_slos(args.goodput).items()},
        "runs": runs,
    }
    path = write_json(payload, args.out, "serve")
    if len(runs) > 1:
        plot_serve(runs, path.with_suffix(".png"))
    return payload


def _format_run(run: dict) -> str:
    return (
        f"rate {run['request_rate']}: {run['completed']} ok, {run['failed']} failed, "
        f"{run['request_throughput']:.2f} req/s, {run['output_throughput']:.0f} output tok/s, "
        f"TTFT p50 {run['ttft_ms']['p50']:.0f} ms, TPOT p50 {run['tpot_ms']['p50']:.1f} ms, "
        f"ITL p99 {run['itl_ms']['p99']:.1f} ms"
        if run["completed"]
        else f"rate {run['request_rate']}: every request failed: {run['errors']}"
    )


# --- offline: throughput and latency ------------------------------------------------------------


def run_throughput(args, make_llm) -> dict:
    from .sampling_params import SamplingParams

    fill_device_defaults(args, THROUGHPUT_DEFAULTS)
    requests = random_dataset(
        args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, args.seed,
        args.random_token_id_limit,
    )  # fmt: skip
    llm = make_llm(args)
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=r.max_tokens, ignore_eos=True)
        for r in requests
    ]
    llm.generate([r.prompt_ids[:8] for r in requests[:2]], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    result = {
        "benchmark": "throughput",
        "environment": environment(),
        "num_prompts": args.num_prompts,
        "seconds": seconds,
        "requests_per_s": len(requests) / seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (output_tokens + prompt_tokens) / seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }
    print(
        f"{result['requests_per_s']:.2f} requests/s, {result['output_tok_s']:.0f} output tok/s, "
        f"{result['total_tok_s']:.0f} total tok/s"
    )
    write_json(result, args.out, "throughput")
    return result


def run_latency(args, make_llm) -> dict:
    from .sampling_params import SamplingParams

    fill_device_defaults(args, LATENCY_DEFAULTS)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randint(0, args.random_token_id_limit - 1) for _ in range(args.input_len)]
        for _ in range(args.batch_size)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = make_llm(args)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    seconds = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    result = {
        "benchmark": "latency",
        "environment": environment(),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "avg_latency_s": statistics.fmean(seconds),
        "latencies_s": seconds,
        "ms_per_output_token": statistics.median(seconds) / args.output_len * 1000,
    }
    print(
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out: "
        f"{result['avg_latency_s']:.3f} s per batch, "
        f"{result['ms_per_output_token']:.2f} ms per decode step"
    )
    write_json(result, args.out, "latency")
    return result


# `bench throughput|latency` sizes per device: workload W's shape (and vLLM's latency defaults)
# on a GPU; on a CPU, sizes that finish in seconds with the default model, where W takes hours.
THROUGHPUT_DEFAULTS = {
    "cuda": {"num_prompts": 256, "input_len": 562, "output_len": 562},
    "cpu": {"num_prompts": 8, "input_len": 128, "output_len": 32},
}
LATENCY_DEFAULTS = {
    "cuda": {"input_len": 512, "output_len": 256, "num_iters": 5},
    "cpu": {"input_len": 128, "output_len": 32, "num_iters": 3},
}


def add_device_default_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    for name in defaults["cuda"]:
        sizes = f"default: {defaults['cuda'][name]} on CUDA, {defaults['cpu'][name]} on CPU"
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=sizes)


def fill_device_defaults(args: argparse.Namespace, defaults: dict) -> None:
    """Sets the sizes left unset to those of the device the engine will run on, and says so."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    chosen = defaults["cuda" if device.startswith("cuda") else "cpu"]
    for name, value in chosen.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    sizes = " ".join(f"--{name.replace('_', '-')} {getattr(args, name)}" for name in chosen)
    print(f"bench {args.bench} on {device}: {sizes}")


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {value}")
    return rate


def add_bench_parser(subparsers, add_engine_args) -> None:
    """Add `bench throughput|latency|serve`; `add_engine_args` adds the engine's own flags."""
    bench = subparsers.add_parser("bench", help="benchmark an engine or a running server")
    kinds = bench.add_subparsers(dest="bench", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--seed", type=int, default=0, help="the random dataset's seed")
    common.add_argument("--temperature", type=float, default=0.6, help="workload W's")
    common.add_argument("--out", help="JSON file or directory (default: a scratch directory)")
    common.add_argument(
        "--random-token-id-limit", type=int, default=RANDOM_TOKEN_ID_LIMIT,
        help="prompt token ids are drawn below this (keep it within the model's vocabulary)",
    )  # fmt: skip

    throughput = kinds.add_parser("throughput", parents=[common], help="offline tok/s")
    add_engine_args(throughput)
    add_device_default_args(throughput, THROUGHPUT_DEFAULTS)
    throughput.add_argument(
        "--random-range-ratio", type=float, default=0.82, help="lengths vary by this fraction"
    )

    latency = kinds.add_parser("latency", parents=[common], help="seconds per batch")
    add_engine_args(latency)
    latency.add_argument("--batch-size", type=int, default=1, help="requests per batch")
    add_device_default_args(latency, LATENCY_DEFAULTS)
    latency.add_argument("--num-iters-warmup", type=int, default=1, help="untimed batches first")

    serve = kinds.add_parser("serve", parents=[common], help="an OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    serve.add_argument("--model", required=True, help="the served model name")
    serve.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, if set")
    serve.add_argument("--num-prompts", type=int, default=256, help="requests per rate")
    serve.add_argument("--random-input-len", type=int, default=562, help="mean prompt tokens")
    serve.add_argument("--random-output-len", type=int, default=562, help="mean max_tokens")
    serve.add_argument(
        "--random-range-ratio", type=float, default=0.82, help="lengths vary by this fraction"
    )
    serve.add_argument(
        "--request-rate", type=_rate, nargs="+", default=[math.inf],
        help="requests per second (Poisson arrivals); several values run one after another",
    )  # fmt: skip
    serve.add_argument(
        "--max-concurrency", type=int, default=None, help="default: no limit on requests in flight"
    )
    serve.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    serve.add_argument("--goodput", nargs="*", metavar="SLO", help="e.g. ttft:500 tpot:50")


def run_bench(args, make_llm) -> dict:
    if args.bench == "serve":
        return run_serve(args)
    if args.bench == "throughput":
        return run_throughput(args, make_llm)
    return run_latency(args, make_llm)
