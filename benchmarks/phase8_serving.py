"""Phase 8 on the H200: workload W offline and through the server, in one run.

On a Qwen3-0.6B-shaped checkpoint with random weights (`--load-format dummy`: config.json and the
real Qwen3 tokenizer files, no weights) and workload W (256 token-id prompts, 142,827 prompt and
133,966 output tokens, temperature 0.6, ignore_eos), prefix caching off everywhere (W's random
prompts share nothing, and W is served several times by one server):
1. offline: phase 8's `LLM.generate` with the tuned flags (256 sequences, 16,384 batched tokens,
   40,000 blocks): output tok/s, prefill included (the baseline);
2. `mini-vllm serve` with the same flags, in its own processes: W all at once, streaming, then
   not streaming, then Poisson arrivals at 16 req/s (TTFT, TPOT, ITL p50/p99);
   then the dashboard's cost: the same server streams W at saturation twice with no page open
   and twice with one page reading /dashboard/events, alternately (`dashboard_overhead`: both
   lists, their means and the relative difference; goal: within 1%);
3. `mini-vllm serve` with no engine flags (the defaults), W all at once, streaming;
4. the front-end ceiling: the same server over a stub model runner that returns a token per
   sequence per step without any model (a CPU engine core with the tuned scheduler): what the front
   end and the client can carry. It must stream >= 3x the offline rate, or the numbers above say
   more about the front end (or the client) than about the engine.
The JSON carries `served_over_offline` (streaming saturation / offline; goal >= 0.85) and
`defaults_over_tuned` (goal >= 0.90), and for every served run the client's CPU share (process
time / wall time: near 1.0 would mean the client, not the server, was the bound) and the
server's, per process (`server_cpu_share`: the API server and the engine core; Linux only).

The client is an independent asyncio HTTP client in this process (aiohttp where installed, else
httpx), one connection per request, reading SSE lines without parsing every chunk's JSON.

Run (CUDA machine, ~6 min): python -m benchmarks.phase8_serving [--out DIR]
`--quick`: a tiny model on the CPU, 8 requests (checks that the script works).
`--ceiling-only`: 4. alone, W-sized (it needs no GPU: to profile the front end on any machine);
writes phase8_serving_ceiling.json. `--dashboard-only PAIRS`: the dashboard's cost alone, with
more alternating runs than the full run's 2 + 2 (the tuned server; phase8_serving_dashboard.json).
`--admission-only LOADS`: admission alone, on any machine: W's prompts with `max_tokens` 1
through the stub server LOADS times, the server's CPU per request (phase8_serving_admission.json).
`--data-parallel-only SIZES` (e.g. 1,2; one GPU per engine core): the tuned server at each
`--data-parallel-size`, W streamed twice (the first load warms a fresh server), and `dp_speedup`,
each size's second load over the first size's (phase8_serving_dp.json; goal at 2: >= 1.8).
`--offline-only`: W twice through phase 7's `LLM`, then twice through phase 8's, same checkpoint
and flags: what phase 8's offline path (the output processor, the fair-share scheduler) costs
(`phase8_over_phase7`, best pass over best pass; phase8_serving_offline.json).
`--qwen3-5-only`: the hybrid model, Qwen3.5-0.8B shapes (dummy weights), tuned flags: W offline,
then streamed at saturation through one server twice; `served_over_offline` from the second
load (the first, a fresh server's, is recorded beside it; goal >= 0.95;
phase8_serving_qwen3_5.json; with --quick a tiny Qwen3.5 on the CPU).
"""

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import phase8_serving
from benchmarks.harness import (
    QWEN3_0_6B,
    QWEN3_5_0_8B,
    W_TEMPERATURE,
    Request,
    benchmark_parser,
    parse_args,
    seeded_workload,
    workload_w,
    write_result,
)
from phase8_serving import LLM
from phase8_serving.engine_core import EngineCoreSpec, build_llm
from phase8_serving.model_runner import SampledTokens

TINY = {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}  # fmt: skip
TINY_QWEN3_5 = {**QWEN3_5_0_8B, "vocab_size": QWEN3_0_6B["vocab_size"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16}  # fmt: skip
TUNED = {"max_num_seqs": 256, "max_num_batched_tokens": 16384, "num_kv_blocks": 40000,
         "enable_prefix_caching": False, "load_format": "dummy"}  # fmt: skip
QUICK_TUNED = {**TUNED, "max_num_seqs": 8, "max_num_batched_tokens": 512, "num_kv_blocks": 256}
POISSON_RATE = 16.0
CEILING_FACTOR = 3.0
DASHBOARD_RUNS = 2  # runs with the page open, and as many with it closed
STARTUP_S = 900
NAME = "qwen3"


def write_checkpoint(directory: Path, config: dict, tokenizer_dir: Path) -> Path:
    """config.json and the tokenizer: all `--load-format dummy` reads."""
    from transformers import Qwen3Config

    if config["model_type"] == "qwen3_5_text":  # the engine reads config.json as written
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
    else:
        Qwen3Config(**config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def run_offline(checkpoint: Path, workload: list[Request], device: str, flags: dict,
                phase=phase8_serving, passes: int = 1) -> dict:  # fmt: skip
    """W through `phase`'s offline `LLM.generate` (after a warm-up), `passes` times; the first
    pass's numbers, and every pass's tok/s in `passes_output_tok_s`."""
    llm = phase.LLM(checkpoint, device=device, **flags)
    params = [phase.SamplingParams(temperature=W_TEMPERATURE, max_tokens=r.max_tokens,
                                   ignore_eos=True) for r in workload]  # fmt: skip
    prompts = [r.prompt_ids for r in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    runs = []
    for _ in range(passes):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        runs.append((seconds, sum(len(o.outputs[0].token_ids) for o in outs)))
    llm.shutdown()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server's engine core needs this memory
    (seconds, tokens), *_ = runs
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "passes_output_tok_s": [n / t for t, n in runs]}  # fmt: skip


def run_offline_ab(model: Path, device: str, flags: dict, workload) -> dict:
    """Phase 7's `LLM` (the engine's own stop and detokenize code) against phase 8's (`LLMEngine`
    + the output processor, fair-share scheduler), same checkpoint and flags, W twice on each."""
    import phase7_optim

    rows = {}
    for name, phase in (("phase7", phase7_optim), ("phase8", phase8_serving)):
        print(f"{name} offline ...")
        rows[name] = run_offline(model, workload, device, flags, phase, passes=2)
        print(f"  {', '.join(f'{x:,.0f}' for x in rows[name]['passes_output_tok_s'])} output tok/s")
    best = {name: max(row["passes_output_tok_s"]) for name, row in rows.items()}
    return {"offline": rows, "phase8_over_phase7": best["phase8"] / best["phase7"]}


# -- the front-end ceiling: an engine core whose runner is a stub ---------------------------------


def build_stub_llm(spec: EngineCoreSpec) -> LLM:
    """The real scheduler and block manager, and a runner that makes up a token per sequence."""
    llm = build_llm(spec)
    runner = llm.engine.runner

    def launch(scheduled, previous=None):
        # those that catch up sample (placeholders count: the engine may schedule on them)
        sampling = [
            seq
            for seq, n in scheduled
            if seq.num_computed_tokens + n >= seq.num_tokens + seq.num_output_placeholders
        ]
        ids = torch.tensor([1000 + seq.num_tokens % 1000 for seq in sampling])
        return SampledTokens([seq.seq_id for seq in sampling], ids, ids, None)

    runner.launch = launch
    return llm


def serve_stub(checkpoint: str, port: int, flags: dict) -> None:
    """The stub server's process: a front end as `mini-vllm serve` builds it, over the stub."""
    import uvicorn

    from phase8_serving.api_server import build_app
    from phase8_serving.async_engine import AsyncLLM
    from phase8_serving.config import EngineConfig, ServerConfig

    spec = EngineCoreSpec(checkpoint, "float32", "cpu", EngineConfig(**flags),
                          make_llm=build_stub_llm)  # fmt: skip
    llm = AsyncLLM.spawn(spec, NAME)
    try:
        app = build_app(llm, ServerConfig(NAME, TINY["max_position_embeddings"]))
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        llm.shutdown()


# -- a server in its own processes, and the client -------------------------------------------------


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def start_server(command: list[str]) -> tuple[subprocess.Popen, str]:
    """Runs `command` (its "PORT" replaced by a free port) until its /health answers 200."""
    import httpx

    port = free_port()
    process = subprocess.Popen([str(port) if part == "PORT" else part for part in command])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {command}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise TimeoutError(f"the server did not start: {command}")
        time.sleep(0.5)


def server_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes (Linux /proc; {} elsewhere): the API server
    (`root`) and its engine core(s), the spawned children other than multiprocessing's helper."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # a process that ended meanwhile
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        if b"resource_tracker" not in cmdline:
            cpu[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    seconds: dict[str, float] = {}
    for pid, used in cpu.items():
        ancestor = pid
        while ancestor not in (root, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root:
            role = "api_server" if pid == root else "engine_core"
            seconds[role] = seconds.get(role, 0.0) + used
    return seconds


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def _one(session, url: str, body: dict) -> dict:
    """One request; SSE lines are scanned, and only the usage chunk is parsed."""
    start = time.perf_counter()
    stamps, usage = [], None
    async for line in session.lines(url, body):
        if not body["stream"]:  # one JSON body
            usage = json.loads(line)["usage"] if line else usage
        elif '"usage":{' in line:
            usage = json.loads(line[len("data: ") :])["usage"]
        elif line.startswith("data: {") and '"text":""' not in line:
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"no usage in the response to {url}")
    ttft = (stamps[0] if stamps else end) - start
    itl = [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]
    return {"e2e": end - start, "ttft": ttft, "itl": itl,
            "output_tokens": usage["completion_tokens"]}  # fmt: skip


class Session:
    """aiohttp where installed (the lighter client), else httpx; yields response lines."""

    def __init__(self):
        try:
            import aiohttp

            self.kind = "aiohttp"
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(None)
            )
        except ImportError:
            import httpx

            self.kind = "httpx"
            self.session = httpx.AsyncClient(timeout=None, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None))  # fmt: skip

    async def lines(self, url: str, body: dict | None):
        """POSTs `body` (GETs `url` if None) and yields the response's lines."""
        method = "GET" if body is None else "POST"
        if self.kind == "aiohttp":
            async with self.session.request(method, url, json=body) as response:
                response.raise_for_status()
                async for raw in response.content:
                    yield raw.decode().rstrip("\n")
        else:
            async with self.session.stream(method, url, json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    yield line

    async def close(self):
        await (self.session.close() if self.kind == "aiohttp" else self.session.aclose())


async def _watch_dashboard(session: Session, url: str, frames: list[float],
                           first: asyncio.Future) -> None:  # fmt: skip
    """A dashboard page's stream, read until cancelled: the time of every frame."""
    async for line in session.lines(url + "/dashboard/events", None):
        if line.startswith("data: "):
            frames.append(time.perf_counter())
            if not first.done():
                first.set_result(None)


async def _load(url: str, workload: list[Request], stream: bool, rate: float,
                watch: bool = False) -> dict:  # fmt: skip
    """Sends `workload` (at `rate` req/s, or all at once); `watch`: with a dashboard page open
    all along (its first frame arrives before the first request leaves)."""
    session = Session()
    frames: list[float] = []
    watcher = None
    if watch:
        first = asyncio.get_running_loop().create_future()
        watcher = asyncio.create_task(_watch_dashboard(session, url, frames, first))
        await asyncio.wait_for(first, timeout=60)
    rng = random.Random(0)
    tasks = []
    cpu, start = time.process_time(), time.perf_counter()
    for r in workload:
        body = {"model": NAME, "prompt": r.prompt_ids, "max_tokens": r.max_tokens,
                "temperature": W_TEMPERATURE, "ignore_eos": True, "stream": stream}  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        tasks.append(asyncio.create_task(_one(session, url + "/v1/completions", body)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    await session.close()
    result = summarize(results, wall, cpu, stream, rate, session.kind)
    if watch:  # proof the page was fed while W ran
        result["dashboard_frames"] = sum(start <= t <= start + wall for t in frames)
    return result


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    ordered = sorted(values)
    pick = lambda p: ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]  # noqa: E731
    return {"p50": pick(50) * 1000, "p99": pick(99) * 1000}


def summarize(results, wall: float, cpu: float, stream: bool, rate: float, client: str) -> dict:
    tokens = sum(r["output_tokens"] for r in results)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
            for r in results if r["output_tokens"] > 1]  # fmt: skip
    return {
        "stream": stream, "request_rate": "inf" if math.isinf(rate) else rate,
        "client": client, "seconds": wall, "output_tokens": tokens,
        "output_tok_s": tokens / wall, "client_cpu_share": cpu / wall,
        "ttft_ms": percentiles([r["ttft"] for r in results]) if stream else None,
        "tpot_ms": percentiles(tpot) if stream else None,
        "itl_ms": percentiles([g for r in results for g in r["itl"]]) if stream else None,
        "e2e_ms": percentiles([r["e2e"] for r in results]),
    }  # fmt: skip


def serve_runs(command: list[str], workload, runs: list[tuple[bool, float]],
               watch: list[bool] | None = None) -> list[dict]:  # fmt: skip
    """Starts the server once and sends `workload` once per (stream, rate) of `runs`; `watch`:
    per run, whether a dashboard page is open meanwhile (default: never)."""
    process, url = start_server(command)
    try:
        out = []
        for (stream, rate), watched in zip(runs, watch or [False] * len(runs), strict=True):
            before = server_cpu_seconds(process.pid)
            result = asyncio.run(_load(url, workload, stream, rate, watched))
            after = server_cpu_seconds(process.pid)
            # the server's own CPU shares: near 1.0 for one of them says which process bounds it
            result["server_cpu_share"] = {
                role: (after[role] - before.get(role, 0.0)) / result["seconds"] for role in after
            }
            shares = ", ".join(f"{k} {v:.0%}" for k, v in result["server_cpu_share"].items())
            print(f"  stream={stream} rate={rate} dashboard={'open' if watched else 'closed'}: "
                  f"{result['output_tok_s']:,.0f} output tok/s, "
                  f"client CPU {result['client_cpu_share']:.0%}, server CPU {shares}")  # fmt: skip
            out.append(result)
        return out
    finally:
        stop_server(process)


DASHBOARD_WATCH = [False, True] * DASHBOARD_RUNS  # interleaved: drift lands on both sides


def dashboard_overhead(results: list[dict], watch: list[bool] = DASHBOARD_WATCH) -> dict:
    """W streamed at saturation by one server, alternately with no dashboard page open and with
    one watching /dashboard/events (`results`: one per `watch` entry, in order)."""
    pairs = list(zip(results, watch, strict=True))
    closed = [r["output_tok_s"] for r, watched in pairs if not watched]
    opened = [r["output_tok_s"] for r, watched in pairs if watched]
    mean_closed, mean_open = sum(closed) / len(closed), sum(opened) / len(opened)
    return {
        "closed_output_tok_s": closed, "open_output_tok_s": opened,
        "closed_mean": mean_closed, "open_mean": mean_open,
        "relative_difference": (mean_open - mean_closed) / mean_closed,  # goal: > -0.01
        "dashboard_frames": [r["dashboard_frames"] for r, watched in pairs if watched],
    }  # fmt: skip


def serve_command(checkpoint: Path, device: str, flags: dict) -> list[str]:
    command = [sys.executable, "-m", "phase8_serving", "serve", str(checkpoint),
               "--served-model-name", NAME, "--load-format", "dummy", "--device", device,
               "--port", "PORT"]  # fmt: skip
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else flag.replace("--", "--no-", 1))
        elif name != "load_format":
            command += [flag, str(value)]
    return command


def parallel_sizes(text: str) -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes are integers >= 1, comma-separated, got {text!r}")
    return sizes


def run_data_parallel(model: Path, device: str, flags: dict, workload, sizes) -> dict:
    """The tuned server at each data-parallel size: W streamed twice at saturation, the second
    load timed (a fresh server's first is its slowest); the speed-up of each over the first."""
    rows = {}
    for size in sizes:
        print(f"served, tuned flags, --data-parallel-size {size} ...")
        command = serve_command(model, device, {**flags, "data_parallel_size": size})
        warm_up, timed = serve_runs(command, workload, [(True, math.inf)] * 2)
        rows[size] = {"warm_up_output_tok_s": warm_up["output_tok_s"], "stream_saturation": timed}
    base = rows[sizes[0]]["stream_saturation"]["output_tok_s"]
    speedup = {size: row["stream_saturation"]["output_tok_s"] / base for size, row in rows.items()}
    print("  speed-up over size", sizes[0], {s: round(x, 2) for s, x in speedup.items()})
    return {"data_parallel": rows, "dp_speedup": speedup}


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, threads=False)
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="Qwen3's tokenizer files (default: tests/assets' copy)")  # fmt: skip
    parser.add_argument("--ceiling-only", action="store_true",
                        help="only the front-end ceiling (4.), which needs no GPU: W (or, with "
                        "--quick, 8 requests) through the stub server")  # fmt: skip
    parser.add_argument("--dashboard-only", type=int, metavar="PAIRS", default=0,
                        help="only the dashboard's cost: the tuned server, W streamed PAIRS times "
                        "with no page open and PAIRS times with one, alternately")  # fmt: skip
    parser.add_argument("--admission-only", type=int, metavar="LOADS", default=0,
                        help="only admission: W's prompts with max_tokens 1 through the stub "
                        "server LOADS times; the server's CPU per request")  # fmt: skip
    parser.add_argument("--data-parallel-only", type=parallel_sizes, metavar="SIZES",
                        default=None, help="only data parallelism: the tuned server at each "
                        "--data-parallel-size in SIZES (e.g. 1,2), W streamed twice")  # fmt: skip
    parser.add_argument("--offline-only", action="store_true",
                        help="only offline: W twice through phase 7's LLM, then phase 8's, "
                        "same flags")  # fmt: skip
    parser.add_argument("--qwen3-5-only", action="store_true",
                        help="only Qwen3.5-0.8B shapes: W offline, then streamed through the "
                        "tuned server twice")  # fmt: skip
    parser.add_argument("--serve-stub", nargs=2, metavar=("CHECKPOINT", "PORT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    return parser


def workload_info(workload: list[Request], quick: bool, device: str, flags: dict) -> dict:
    return {
        "name": "W" if not quick else "quick",
        "num_requests": len(workload),
        "prompt_tokens": sum(len(r.prompt_ids) for r in workload),
        "max_output_tokens": sum(r.max_tokens for r in workload),
        "temperature": W_TEMPERATURE,
        "ignore_eos": True,
        "model": "Qwen3-0.6B shapes, dummy weights" if not quick else "tiny",
        "device": device,
        "tuned_flags": flags,
    }


def run_ceiling(stub: Path, workload: list[Request], quick: bool) -> dict:
    print("front-end ceiling (stub runner) ...")
    command = [sys.executable, "-m", "benchmarks.phase8_serving", "--serve-stub", str(stub),
               "PORT"] + (["--quick"] if quick else [])  # fmt: skip
    (ceiling,) = serve_runs(command, workload, [(True, math.inf)])
    return ceiling


def run_admission(stub: Path, workload: list[Request], quick: bool, loads: int) -> dict:
    """What admitting the workload costs the server: its prompts with max_tokens 1 through the
    stub server, `loads` times (one server); the CPU milliseconds per request of each process."""
    print("admission (stub runner, max_tokens 1) ...")
    one_token = [dataclasses.replace(r, max_tokens=1) for r in workload]
    command = [sys.executable, "-m", "benchmarks.phase8_serving", "--serve-stub", str(stub),
               "PORT"] + (["--quick"] if quick else [])  # fmt: skip
    results = serve_runs(command, one_token, [(True, math.inf)] * loads)
    per_request = {
        role: [r["server_cpu_share"][role] * r["seconds"] / len(one_token) * 1000 for r in results]
        for role in results[0]["server_cpu_share"]
    }
    for role, ms in per_request.items():
        print(f"  {role}: {', '.join(f'{m:.2f}' for m in ms)} CPU ms per request")
    return {"loads": results, "server_cpu_ms_per_request": per_request}


def run_engine_and_server(model: Path, device: str, flags: dict, workload) -> dict:
    """1.-3. of the docstring, and the dashboard's cost: the parts that run the model."""
    print("offline ...")
    offline = run_offline(model, workload, device, flags)
    print(f"  {offline['output_tok_s']:,.0f} output tok/s")
    print("served, tuned flags (then closed / open dashboard pages) ...")
    runs = [(True, math.inf), (False, math.inf), (True, POISSON_RATE)]
    runs += [(True, math.inf)] * len(DASHBOARD_WATCH)  # one server start for all: minutes of GPU
    watch = [False] * 3 + DASHBOARD_WATCH
    served = serve_runs(serve_command(model, device, flags), workload, runs, watch)
    overhead = dashboard_overhead(served[3:])
    print(f"  dashboard open vs closed: {overhead['relative_difference']:+.2%}")
    print("served, defaults ...")
    defaults = serve_runs(serve_command(model, device, {}), workload, [(True, math.inf)])
    saturation = served[0]["output_tok_s"]
    return {
        "baseline": {"offline": offline},
        "served_tuned": {
            "stream_saturation": served[0],
            "no_stream_saturation": served[1],
            f"stream_poisson_{POISSON_RATE:g}": served[2],
        },
        "served_defaults": {"stream_saturation": defaults[0]},
        "dashboard_overhead": overhead,
        "served_over_offline": saturation / offline["output_tok_s"],
        "defaults_over_tuned": defaults[0]["output_tok_s"] / saturation,
    }


def run_qwen3_5(model: Path, device: str, flags: dict, workload) -> dict:
    """The hybrid model: W offline, then streamed at saturation through one tuned server twice;
    the second load is the one compared (a fresh server's first compiles and allocates)."""
    print("Qwen3.5 offline ...")
    offline = run_offline(model, workload, device, flags)
    print(f"  {offline['output_tok_s']:,.0f} output tok/s")
    print("Qwen3.5 served, tuned flags, twice ...")
    first, timed = serve_runs(serve_command(model, device, flags), workload, [(True, math.inf)] * 2)
    return {
        "baseline": {"offline": offline},
        "served_tuned": {"first_load": first, "stream_saturation": timed},
        "served_over_offline": timed["output_tok_s"] / offline["output_tok_s"],
        "first_load_over_offline": first["output_tok_s"] / offline["output_tok_s"],
        "goal_served_over_offline": 0.95,
    }


def run_dashboard_only(args, device: str, flags: dict, workload) -> dict:
    watch = [False, True] * args.dashboard_only
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "model", TINY if args.quick else QWEN3_0_6B,
                                 args.tokenizer_dir)  # fmt: skip
        runs = [(True, math.inf)] * (1 + len(watch))
        # A fresh server's first W is slower (first compilations and allocations): a warm-up,
        # as the full run's dashboard runs come after three other loads of the same server.
        warm_up, *served = serve_runs(serve_command(model, device, flags), workload, runs,
                                      [False, *watch])  # fmt: skip
    overhead = dashboard_overhead(served, watch)
    print(f"dashboard open vs closed: {overhead['relative_difference']:+.2%}")
    return {"dashboard_overhead": overhead, "warm_up_output_tok_s": warm_up["output_tok_s"]}


def main() -> None:
    args = parse_args(build_parser())
    quick = args.quick
    flags = QUICK_TUNED if quick else TUNED
    if args.serve_stub:
        serve_stub(args.serve_stub[0], int(args.serve_stub[1]), flags)
        return
    device = "cpu" if quick or not torch.cuda.is_available() else "cuda"
    if args.tokenizer_dir is None:
        from tests import assets

        args.tokenizer_dir = assets.qwen3_tokenizer_dir()
    workload = seeded_workload(0, 8, (16, 64), (8, 32), 10001) if quick else workload_w()
    payload = {"quick": quick, "workload": workload_info(workload, quick, device, flags)}
    if args.dashboard_only:
        payload |= run_dashboard_only(args, device, flags, workload)
        write_result("phase8_serving_dashboard" + "_quick" * quick, payload, args.out)
        return
    if args.data_parallel_only:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_checkpoint(Path(tmp) / "model", TINY if quick else QWEN3_0_6B,
                                     args.tokenizer_dir)  # fmt: skip
            payload |= run_data_parallel(model, device, flags, workload, args.data_parallel_only)
        write_result("phase8_serving_dp" + "_quick" * quick, payload, args.out)
        return
    if args.offline_only:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_checkpoint(Path(tmp) / "model", TINY if quick else QWEN3_0_6B,
                                     args.tokenizer_dir)  # fmt: skip
            payload |= run_offline_ab(model, device, flags, workload)
        path = write_result("phase8_serving_offline" + "_quick" * quick, payload, args.out)
        print(f"phase 8 / phase 7 offline {payload['phase8_over_phase7']:.3f}; wrote {path}")
        return
    if args.qwen3_5_only:
        payload["workload"]["model"] = "Qwen3.5-0.8B shapes, dummy weights" if not quick else "tiny"
        with tempfile.TemporaryDirectory() as tmp:
            model = write_checkpoint(Path(tmp) / "model", TINY_QWEN3_5 if quick else QWEN3_5_0_8B,
                                     args.tokenizer_dir)  # fmt: skip
            payload |= run_qwen3_5(model, device, flags, workload)
        path = write_result("phase8_serving_qwen3_5" + "_quick" * quick, payload, args.out)
        print(f"Qwen3.5 served/offline {payload['served_over_offline']:.2f}; wrote {path}")
        return
    if args.admission_only:
        with tempfile.TemporaryDirectory() as tmp:
            stub = write_checkpoint(Path(tmp) / "stub", TINY, args.tokenizer_dir)
            payload["admission"] = run_admission(stub, workload, quick, args.admission_only)
        write_result("phase8_serving_admission" + "_quick" * quick, payload, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        stub = write_checkpoint(Path(tmp) / "stub", TINY, args.tokenizer_dir)
        if not args.ceiling_only:
            model = write_checkpoint(Path(tmp) / "model", TINY if quick else QWEN3_0_6B,
                                     args.tokenizer_dir)  # fmt: skip
            payload |= run_engine_and_server(model, device, flags, workload)
        payload["front_end_ceiling"] = run_ceiling(stub, workload, quick)
    ceiling = payload["front_end_ceiling"]["output_tok_s"]
    name = "phase8_serving" + "_ceiling" * args.ceiling_only + "_quick" * quick
    if args.ceiling_only:  # the ceiling alone, on whatever machine this is
        path = write_result(name, payload, args.out)
        print(f"front-end ceiling {ceiling:,.0f} output tok/s; wrote {path}")
        return
    offline = payload["baseline"]["offline"]["output_tok_s"]
    payload |= {"ceiling_over_offline": ceiling / offline, "ceiling_goal": CEILING_FACTOR}
    path = write_result(name, payload, args.out)
    print(f"served/offline {payload['served_over_offline']:.2f}, defaults/tuned "
          f"{payload['defaults_over_tuned']:.2f}, ceiling/offline "
          f"{payload['ceiling_over_offline']:.1f}x, dashboard open/closed "
          f"{payload['dashboard_overhead']['relative_difference']:+.2%}; wrote {path}")  # fmt: skip


if __name__ == "__main__":
    main()
