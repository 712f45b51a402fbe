"""Phase 1 benchmark: per-token time of the naive loop grows with the sequence length.

Generates 1,000 greedy tokens from an 8-token prompt with the default TinyTransformer and times
every step, in process CPU time and in wall time. One untimed warm-up run, then REPEATS timed
runs; step i's time is its median over the runs, and the table reports the median of each window
of 100 steps. The headline ratio is the last window (length 908-1008) over the reference window
(length 108-208), in CPU time: the first window is left out because its first steps include the
prefill and the allocator's first growth (a first-window ratio swung between 3x and 39x from run
to run), and wall time on a shared machine also counts other jobs' time slices, which inflate
long steps more than short ones. Use --threads 1 on a loaded machine.
Writes phase1_naive.json (and phase1_naive.png with --plot) into --out.
Run: python -m benchmarks.phase1_naive [--plot] [--quick] [--out DIR] [--threads 2]
"""

import argparse

import torch

from benchmarks.harness import (
    benchmark_parser,
    median_per_step,
    parse_args,
    step_times,
    window_medians,
    write_result,
)
from phase1_naive import ModelConfig, TinyTransformer, iter_tokens

PROMPT_LEN = 8
NEW_TOKENS, QUICK_NEW_TOKENS = 1000, 300
REPEATS, QUICK_REPEATS = 3, 1
WINDOW = 100  # steps per reported window
REFERENCE_WINDOW = 1  # the second window: away from the prefill and first allocations


def per_token_windows(cpu: list[float], wall: list[float]) -> list[dict]:
    cpu_medians, wall_medians = window_medians(cpu, WINDOW), window_medians(wall, WINDOW)
    return [
        {
            "seq_len_from": PROMPT_LEN + WINDOW * i,
            "seq_len_to": PROMPT_LEN + min(WINDOW * (i + 1), len(cpu)),
            "median_cpu_ms_per_token": round(1000 * c, 3),
            "median_wall_ms_per_token": round(1000 * w, 3),
        }
        for i, (c, w) in enumerate(zip(cpu_medians, wall_medians, strict=True))
    ]


def growth(times: list[float]) -> float:
    medians = window_medians(times, WINDOW)
    return medians[-1] / medians[REFERENCE_WINDOW]


def plot(path, runs: list[list[float]], median: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = [PROMPT_LEN + i for i in range(len(median))]
    for run in runs:
        ax.plot(lengths, [1000 * t for t in run], lw=0.4, color="lightgrey")
    ax.plot(lengths, [1000 * t for t in median], lw=0.8, label=f"median of {len(runs)} runs")
    ax.set(xlabel="sequence length", ylabel="CPU ms per token", title="phase 1: naive loop")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--plot", action="store_true", help="also write a PNG")
    return parser


def main():
    args = parse_args(build_parser())
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    repeats = QUICK_REPEATS if args.quick else REPEATS
    torch.manual_seed(0)
    config = ModelConfig(max_position_embeddings=PROMPT_LEN + new_tokens)
    model = TinyTransformer(config).eval()
    prompt = list(range(1, PROMPT_LEN + 1))
    step_times(iter_tokens(model, prompt, new_tokens))  # warm-up: allocator and kernels
    wall_runs, cpu_runs = zip(
        *(step_times(iter_tokens(model, prompt, new_tokens)) for _ in range(repeats)), strict=True
    )
    median, wall_median = median_per_step(list(cpu_runs)), median_per_step(list(wall_runs))
    rows = per_token_windows(median, wall_median)
    for r in rows:
        cpu_ms, wall_ms = r["median_cpu_ms_per_token"], r["median_wall_ms_per_token"]
        print(f"len {r['seq_len_from']}-{r['seq_len_to']}: {cpu_ms:.3f} CPU ms, {wall_ms:.3f} wall")
    ratio, per_run = growth(median), [round(growth(run), 2) for run in cpu_runs]
    wall_ratio = growth(wall_median)
    print(f"last window / reference window: {ratio:.1f}x CPU (each run: {per_run}), "
          f"{wall_ratio:.1f}x wall")  # fmt: skip
    path = write_result(
        "phase1_naive",
        {
            "quick": args.quick,
            "workload": {
                "model": config.__dict__,
                "prompt_len": PROMPT_LEN,
                "new_tokens": new_tokens,
                "repeats": repeats,
                "window": WINDOW,
                "timing": "one warm-up run; per-step median over the timed runs; window medians",
                "clock": "process CPU time (headline) and wall time",
            },
            "per_token_ms": rows,
            "growth_last_over_reference": ratio,
            "wall_growth_last_over_reference": wall_ratio,
            "reference_window": rows[REFERENCE_WINDOW],
            "growth_each_run": per_run,
        },
        args.out,
    )
    print(f"wrote {path}")
    if args.plot:
        plot(args.out / "phase1_naive.png", list(cpu_runs), median)


if __name__ == "__main__":
    main()
