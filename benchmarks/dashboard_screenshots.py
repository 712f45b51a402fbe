"""Dashboard screenshots: phase 4's contiguous regions against phase 5's paged blocks, replayed
from step traces, and the live page of a running server (headless Chromium, tests/chromium.py).

1. Replay. Phase 4 and phase 5 run the utilization workload of benchmarks/phase5_paged.py (its
   headline distribution: 32 requests, prompts of 16-256 tokens, max_tokens=256 declared, each
   stopping after a seeded 8-128 tokens; the same 4,096 token slots; prefix caching off), each
   with a StepTrace. The requests stop by being aborted, so the steps do not depend on the
   weights: a tiny model gives the benchmark's schedule in seconds. Written to --out:
   phase5_trace_contiguous.json and phase5_trace_paged.json (open them with
   `mini-vllm replay`), and `mini-vllm replay`'s page on each at step --step:
   dashboard_replay_phase4.png and dashboard_replay_phase5.png.
2. Live. `mini-vllm serve`'s app on --model (default: the embedded SmolLM2) in this process, in
   front of a spawned engine core, --requests chat requests sharing one system prompt, the page
   screenshotted once requests run: dashboard_live.png.
Run: python -m benchmarks.dashboard_screenshots [--out DIR] [--step N] [--model M]
     [--only replay|live]
"""

import argparse
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

import phase4_scheduler as p4
import phase5_paged as p5
from benchmarks.harness import benchmark_parser, parse_args, seeded_workload
from benchmarks.phase5_paged import (
    BLOCK_SIZE,
    DECLARED_MAX_TOKENS,
    HEADLINE,
    KV_SLOTS,
    MAX_NUM_SEQS,
    NUM_REQUESTS,
    STOP_DISTRIBUTIONS,
    drive,
)
from tests.chromium import Chromium, find_chromium

TINY = dict(vocab_size=2048, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=16, intermediate_size=64, max_position_embeddings=1024)  # fmt: skip
SYSTEM_PROMPT = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "What is a prime number?",
             "Name three planets.", "What does a CPU do?", "How do bees make honey?",
             "What is photosynthesis?", "Who wrote Hamlet?", "What is 12 times 12?",
             "Why do cats purr?", "What is an atom?", "How far is the Moon?"]  # fmt: skip


def record_traces(out: Path) -> dict[str, Path]:
    work = seeded_workload(5, NUM_REQUESTS, (16, 256), (DECLARED_MAX_TOKENS,) * 2, 2048)
    rng = random.Random(6)
    stop_after = [STOP_DISTRIBUTIONS[HEADLINE](rng) for _ in work]
    common = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 512}
    configs = {
        "contiguous": (p4, p4.EngineConfig(num_kv_slots=KV_SLOTS, **common)),
        "paged": (p5, p5.EngineConfig(num_kv_blocks=KV_SLOTS // BLOCK_SIZE, block_size=BLOCK_SIZE,
                                      enable_prefix_caching=False, **common)),
    }  # fmt: skip
    paths = {}
    for name, (mod, config) in configs.items():
        torch.manual_seed(0)
        trace = mod.StepTrace()
        engine = mod.LLMEngine(mod.TinyTransformer(mod.ModelConfig(**TINY)).eval(),
                               config=config, trace=trace)  # fmt: skip
        prompts = [r.prompt_ids for r in work]
        drive(engine, mod, prompts, [r.max_tokens for r in work], stop_after)
        paths[name] = out / f"phase5_trace_{name}.json"
        trace.to_chrome(paths[name], {"workload": f"benchmarks/phase5_paged.py, {HEADLINE}"})
        print(f"{name}: {len(trace.steps)} steps -> {paths[name]}")
    return paths


def serve_in_thread(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    host, port = sock.getsockname()
    return f"http://{host}:{port}", server, thread


def replay_screenshots(browser: Chromium, paths: dict[str, Path], step: int, out: Path) -> None:
    from phase8_serving.replay import build_replay_app

    for name, phase in (("contiguous", "phase4"), ("paged", "phase5")):
        url, server, thread = serve_in_thread(build_replay_app(paths[name]))
        try:
            with browser.open(f"{url}/dashboard?step={step}") as page:
                page.wait_for("document.getElementById('slider-label').textContent")
                time.sleep(0.5)
                page.screenshot(out / f"dashboard_replay_{phase}.png")
        finally:
            server.should_exit = True
            thread.join()


def live_screenshot(browser: Chromium, model: str | None, num_requests: int, out: Path) -> None:
    from phase8_serving.api_server import build_app
    from phase8_serving.async_engine import AsyncLLM
    from phase8_serving.config import EngineConfig, ServerConfig
    from phase8_serving.default_model import MODEL_NAME, default_model_dir
    from phase8_serving.engine_core import EngineCoreSpec
    from phase8_serving.loader import resolve_model_dir

    model_dir = resolve_model_dir(default_model_dir() if model is None else model)
    config = EngineConfig(max_num_seqs=8, num_kv_blocks=96, block_size=16)
    name = model or MODEL_NAME
    async_llm = AsyncLLM.spawn(EngineCoreSpec(str(model_dir), config=config), name)
    url, server, thread = serve_in_thread(build_app(async_llm, ServerConfig(name, 1024)))

    def ask(question: str) -> None:
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}]  # fmt: skip
        body = {"messages": messages, "max_tokens": 96, "temperature": 0.7, "seed": 0}
        httpx.post(url + "/v1/chat/completions", json=body, timeout=600)

    try:
        with browser.open(f"{url}/dashboard") as page:
            page.wait_for("document.getElementById('status').textContent === 'live'")
            threads = [threading.Thread(target=ask, args=(QUESTIONS[i % len(QUESTIONS)],))
                       for i in range(num_requests)]  # fmt: skip
            for t in threads:
                t.start()
                time.sleep(0.5)  # staggered: later requests find the system prompt cached
            page.wait_for("Number(document.getElementById('num-waiting').dataset.value) === 0 &&"
                          "Number(document.getElementById('step').dataset.value) > 40",
                          timeout=300)  # fmt: skip
            page.screenshot(out / "dashboard_live.png")
            for t in threads:
                t.join()
    finally:
        server.should_exit = True
        thread.join()
        async_llm.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--step", type=int, default=60, help="the replayed step to show")
    parser.add_argument("--model", default=None, help="the live server's model")
    parser.add_argument("--requests", type=int, default=12, help="live requests")
    parser.add_argument("--only", choices=["replay", "live"], default=None)
    return parser


def main() -> None:
    args = parse_args(build_parser())
    executable = find_chromium()
    if executable is None:
        raise SystemExit("no chromium: apt-get install chromium (or .ci/setup --dev as root)")
    with Chromium(executable, width=1280, height=900) as browser:
        if args.only != "live":
            replay_screenshots(browser, record_traces(args.out), args.step, args.out)
        if args.only != "replay":
            live_screenshot(browser, args.model, args.requests, args.out)


if __name__ == "__main__":
    main()
