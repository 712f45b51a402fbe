"""One harness for every phase's benchmark: command line, seeded workloads, timing, JSON results.

A number without its machine, versions, commit and baseline is not a result. Every benchmark
writes through `write_result`, which stamps all of that next to the measurements. The conventions
(workload W, threads, steady windows, same-run baselines) are written down in
benchmarks/README.md.

Every script takes the same options: its `build_parser()` starts from `benchmark_parser`, and
tests/test_benchmarks_cli.py holds every script to it.
- `--out DIR`: the directory the JSON (and PNG) go into, named after the script. The default is
  a scratch directory under the system temp dir, so trying a benchmark never touches the
  repository; `--out benchmarks/results` updates the committed results, and only then.
- `--quick`: a smaller run of the same measurement (seconds instead of minutes) to check that a
  script works; its JSON says `"quick": true` and its numbers are not the ones the READMEs quote.
- `--threads N`: torch intra-op threads (CPU benchmarks).
"""

import argparse
import enum
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

# Workload W, nano-vllm's bench.py workload: 256 requests, prompts of 100-1,024 random ids below
# 10,001, max_tokens 100-1,024, ignore_eos, temperature 0.6. 142,827 prompt + 133,966 output tokens.
# Defined here, not imported from phase 8 (whose `mini-vllm bench` draws the same requests from
# its own copy: tests/test_benchmarks_cli.py checks the two agree), so that the benchmarks of
# phases 0-7 run where phase 8's server dependencies are not installed.
W_NUM_REQUESTS = 256
W_PROMPT_LEN = (100, 1024)
W_OUTPUT_LEN = (100, 1024)
W_ID_RANGE = 10001  # randint(0, 10000): ids 0..10000
W_TEMPERATURE = 0.6


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
    """Random prompts (ids below `vocab_size`) and output lengths, both uniform in their inclusive
    ranges, drawn like nano-vllm's bench.py (all prompts first, then all output lengths), so that
    workload W is `workload_w()`."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, vocab_size - 1) for _ in range(rng.randint(*prompt_len))]
        for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return [Request(p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def workload_w() -> list[Request]:
    return seeded_workload(0, W_NUM_REQUESTS, W_PROMPT_LEN, W_OUTPUT_LEN, W_ID_RANGE)


# Qwen3-0.6B's shapes, workload W's model (benchmarks/README.md), as its config.json says them:
# every benchmark at these shapes builds its model (random weights: values do not matter) from this.
QWEN3_0_6B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    rms_norm_eps=1e-6,
)

# Qwen3.5-0.8B's text model (config.json of Qwen/Qwen3.5-0.8B, text_config).
QWEN3_5_0_8B = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    eos_token_id=248044,
)

RESULTS_DIR = Path(__file__).parent / "results"  # the committed results: written only on request
SCRATCH_DIR = Path(tempfile.gettempdir()) / "mini-vllm-benchmarks"
# Every CPU benchmark runs with the same torch thread count, recorded as `torch_threads` in its
# JSON. 2 = the development machine's cores, what a learner gets; on the quiet machine 2 threads
# were as fast as or faster than 1 for TinyTransformer (phase 0 forward at 400 tokens 14 vs 25 ms,
# phase 4 continuous batching 375 vs 329 tok/s). Under heavy load from other jobs 1 thread can be
# steadier: pass --threads 1, and say so next to the number.
DEFAULT_THREADS = 2


def add_thread_arg(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads (default 2)"
    )
    return parser


def set_threads(n: int = DEFAULT_THREADS) -> None:
    torch.set_num_threads(n)


def benchmark_parser(doc: str | None, threads: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark shares; `doc` (the script's docstring) is its --help text."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=SCRATCH_DIR,
        help=f"directory for the JSON/PNG results (default: {SCRATCH_DIR}; "
        "pass benchmarks/results to update the committed ones)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run to check the script works; not the numbers the READMEs quote",
    )
    if threads:
        add_thread_arg(parser)
    return parser


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses, sets the torch thread count (if the parser has --threads), creates --out."""
    args = parser.parse_args()
    if args.out.suffix == ".json":
        parser.error(f"--out takes a directory (the script names its files), got {args.out}")
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def step_times(tokens: Iterable) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) between consecutive items of a token iterator; the
    first step includes its prefill.

    CPU time (`time.process_time`, all of this process's threads) is what a step costs; wall time
    also counts the time slices other jobs take on a shared machine. With 1 thread and an idle
    machine the two agree.
    """
    wall, cpu = [], []
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    for _ in tokens:
        wall_now, cpu_now = time.perf_counter(), time.process_time()
        wall.append(wall_now - wall_start)
        cpu.append(cpu_now - cpu_start)
        wall_start, cpu_start = wall_now, cpu_now
    return wall, cpu


def median_per_step(runs: list[list[float]]) -> list[float]:
    """Step i's median over several runs of the same loop: one slow step (another process, the
    allocator) in one run does not move it."""
    return [statistics.median(step) for step in zip(*runs, strict=True)]


def window_medians(times: list[float], window: int) -> list[float]:
    """Median of each consecutive `window` steps (the last window may be shorter)."""
    return [statistics.median(times[lo : lo + window]) for lo in range(0, len(times), window)]


def environment() -> dict:
    """Date, commit, machine and versions: what every benchmark's JSON records beside its
    numbers."""
    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
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


def write_result(name: str, payload: dict, out: Path | None = None) -> Path:
    """Writes `{name}.json` into the directory `out`; by default into the scratch directory,
    never into the repository."""
    path = (out or SCRATCH_DIR) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **environment(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value):
    """What json cannot write itself: an engine config's enums (by value) and paths."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"a benchmark result holds a {type(value).__name__}, which JSON cannot hold")


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
