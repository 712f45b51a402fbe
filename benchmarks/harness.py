"""One harness for every phase's benchmark: seeded workloads and self-describing JSON results.

A number without its machine, versions, commit and baseline is not a result. Every benchmark
writes through `write_result`, which stamps all of that next to the measurements.
"""

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"
# Every CPU benchmark runs with the same torch thread count, recorded as `torch_threads` in its
# JSON. 2 = the development machine's cores, what a learner gets; on the quiet machine 2 threads
# were as fast as or faster than 1 for TinyTransformer (phase 0 forward at 400 tokens 14 vs 25 ms,
# phase 4 continuous batching 375 vs 329 tok/s). Under heavy load from other jobs 1 thread can be
# steadier: pass --threads 1, and say so next to the number.
DEFAULT_THREADS = 2


def add_thread_arg(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads"
    )
    return parser


def set_threads(n: int = DEFAULT_THREADS) -> None:
    torch.set_num_threads(n)


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int


def seeded_workload(
    seed: int,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
) -> list[Request]:
    """Random prompts and output lengths, the same for every phase given the same arguments.

    Drawn like nano-vllm's bench.py (all prompts first, then all output lengths) so that the
    reference workload W of SPEC.md is `seeded_workload(0, 256, (100, 1024), (100, 1024), 10001)`.
    """
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, vocab_size - 1) for _ in range(rng.randint(*prompt_len))]
        for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return [Request(p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # A copy without .git (e.g. the GPU box's working tree) can be told its commit.
        return os.environ.get("MINI_VLLM_COMMIT", "unknown")


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_result(name: str, payload: dict, out: Path | None = None) -> Path:
    path = out or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **environment(), **payload}, indent=2) + "\n")
    return path


class Timer:
    """Wall time of a block, synchronizing the GPU so queued kernels are counted."""

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
