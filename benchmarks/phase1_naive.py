"""Phase 1 benchmark: per-token time of the naive loop grows with the sequence length.

Generates 1,000 greedy tokens from an 8-token prompt with the default TinyTransformer and times
every step. One untimed warm-up run, then REPEATS timed runs; step i's time is its median over the
runs, and the table reports the median of each window of 100 steps. The headline ratio is the last
window (length 908-1008) over the reference window (length 108-208): the first window is left out
because its first steps include the prefill and the allocator's first growth, which made a
first-window ratio swing between 3x and 39x from run to run.
Writes phase1_naive.json (and phase1_naive.png with --plot) into --out.
Run: python -m benchmarks.phase1_naive [--plot] [--quick] [--out DIR] [--threads 2]
"""

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


def per_token_windows(times: list[float]) -> list[dict]:
    medians = window_medians(times, WINDOW)
    return [
        {
            "seq_len_from": PROMPT_LEN + WINDOW * i,
            "seq_len_to": PROMPT_LEN + min(WINDOW * (i + 1), len(times)),
            "median_ms_per_token": round(1000 * m, 3),
        }
        for i, m in enumerate(medians)
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
    ax.set(xlabel="sequence length", ylabel="ms per token", title="phase 1: naive loop")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--plot", action="store_true", help="also write a PNG")
    args = parse_args(parser)
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    repeats = QUICK_REPEATS if args.quick else REPEATS
    torch.manual_seed(0)
    config = ModelConfig(max_position_embeddings=PROMPT_LEN + new_tokens)
    model = TinyTransformer(config).eval()
    prompt = list(range(1, PROMPT_LEN + 1))
    step_times(iter_tokens(model, prompt, new_tokens))  # warm-up: allocator and kernels
    runs = [step_times(iter_tokens(model, prompt, new_tokens)) for _ in range(repeats)]
    median = median_per_step(runs)
    rows = per_token_windows(median)
    for r in rows:
        print(f"len {r['seq_len_from']:5d}-{r['seq_len_to']:5d}: {r['median_ms_per_token']:.3f} ms")
    ratio, per_run = growth(median), [round(growth(run), 2) for run in runs]
    print(f"last window / reference window: {ratio:.1f}x (each run: {per_run})")
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
            },
            "per_token_ms": rows,
            "growth_last_over_reference": ratio,
            "reference_window": rows[REFERENCE_WINDOW],
            "growth_each_run": per_run,
        },
        args.out,
    )
    print(f"wrote {path}")
    if args.plot:
        plot(args.out / "phase1_naive.png", runs, median)


if __name__ == "__main__":
    main()
