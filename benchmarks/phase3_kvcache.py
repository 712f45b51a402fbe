"""Phase 3 benchmark: the KV cache flattens per-token time; static batching wastes slots.

1. Per-token time vs sequence length, phase 1 (naive, the same-run baseline) and phase 3 (cached),
   same weights, 8-token prompt, 1,000 greedy tokens, measured exactly as benchmarks/phase1_naive.py
   does: a warm-up run, then REPEATS timed runs, per-step median over the runs, median per window
   of 100 steps, in process CPU time (wall time recorded beside it); ratios use the reference
   window (length 108-208), not the noisy first one.
2. Static batching on a mixed workload (32 requests, prompts 16-256 tokens, outputs 8-256 tokens):
   throughput of one-at-a-time vs one static batch, and the fraction of computed token slots that
   were padding or rows already finished. Throughput in wall time and in process CPU time (what a
   shared machine's other jobs do not inflate).
Writes phase3_kvcache.json (and phase3_kvcache.png with --plot) into --out.
Run: python -m benchmarks.phase3_kvcache [--plot] [--quick] [--out DIR] [--threads 2]
"""

import argparse
import time

import torch

import phase1_naive
import phase3_kvcache
from benchmarks.harness import (
    Timer,
    benchmark_parser,
    median_per_step,
    parse_args,
    seeded_workload,
    step_times,
    window_medians,
    write_result,
)
from benchmarks.phase1_naive import (
    PROMPT_LEN,
    QUICK_NEW_TOKENS,
    QUICK_REPEATS,
    REFERENCE_WINDOW,
    REPEATS,
    WINDOW,
    growth,
    per_token_windows,
)

NEW_TOKENS = 1000
NUM_REQUESTS, QUICK_NUM_REQUESTS = 32, 8


def per_token_curves(state: dict, config_kwargs: dict, new_tokens: int, repeats: int) -> dict:
    """{phase: ([per-step median CPU seconds], [wall seconds])}, naive loop and cached one."""
    prompt = list(range(1, PROMPT_LEN + 1))
    naive = phase1_naive.TinyTransformer(phase1_naive.ModelConfig(**config_kwargs)).eval()
    naive.load_state_dict(state)
    cached = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**config_kwargs)).eval()
    cached.load_state_dict(state)
    greedy = phase3_kvcache.SamplingParams(temperature=0.0, max_tokens=new_tokens)
    curves = {}
    for name, run in [
        ("phase1_naive", lambda: phase1_naive.iter_tokens(naive, prompt, new_tokens)),
        ("phase3_kvcache", lambda: phase3_kvcache.iter_tokens(cached, prompt, greedy)),
    ]:
        step_times(run())  # warm-up
        wall_runs, cpu_runs = zip(*(step_times(run()) for _ in range(repeats)), strict=True)
        curves[name] = (median_per_step(list(cpu_runs)), median_per_step(list(wall_runs)))
    return curves


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result) of fn()."""
    cpu_start = time.process_time()
    with Timer() as t:
        result = fn()
    return t.seconds, time.process_time() - cpu_start, result


def static_batching(model, num_requests: int) -> dict:
    workload = seeded_workload(1, num_requests, (16, 256), (8, 256), model.config.vocab_size)
    prompts = [r.prompt_ids for r in workload]
    params = [
        phase3_kvcache.SamplingParams(temperature=0.0, max_tokens=r.max_tokens) for r in workload
    ]
    useful = sum(r.max_tokens for r in workload)
    phase3_kvcache.generate_batch(model, prompts[:2], params[:2])  # warm-up
    one_wall, one_cpu, _ = timed(
        lambda: [
            phase3_kvcache.generate(model, p, sp) for p, sp in zip(prompts, params, strict=True)
        ]
    )
    batch_wall, batch_cpu, out = timed(
        lambda: phase3_kvcache.generate_batch(model, prompts, params)
    )
    return {
        "workload": f"seeded_workload(1, {num_requests}, (16, 256), (8, 256)), greedy, no EOS",
        "output_tokens": useful,
        "one_at_a_time_tok_s": useful / one_wall,
        "static_batch_tok_s": useful / batch_wall,
        "one_at_a_time_tok_per_cpu_s": useful / one_cpu,
        "static_batch_tok_per_cpu_s": useful / batch_cpu,
        "wasted_slot_fraction": out.wasted_fraction,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--plot", action="store_true", help="also write a PNG")
    return parser


def main():
    args = parse_args(build_parser())
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    repeats = QUICK_REPEATS if args.quick else REPEATS
    # The static-batching workload reaches 256 + 256 positions, within PROMPT_LEN + NEW_TOKENS.
    config_kwargs = {"max_position_embeddings": PROMPT_LEN + NEW_TOKENS}
    torch.manual_seed(0)
    state = phase1_naive.TinyTransformer(phase1_naive.ModelConfig(**config_kwargs)).state_dict()
    curves = per_token_curves(state, config_kwargs, new_tokens, repeats)
    per_token = {name: per_token_windows(cpu, wall) for name, (cpu, wall) in curves.items()}
    cpu_curves = {name: cpu for name, (cpu, _) in curves.items()}
    for name, rows in per_token.items():
        ref = rows[REFERENCE_WINDOW]["median_cpu_ms_per_token"]
        last = rows[-1]["median_cpu_ms_per_token"]
        print(f"{name}: {ref:.3f} ms/token at length ~{rows[REFERENCE_WINDOW]['seq_len_from']}, "
              f"{last:.3f} at ~{rows[-1]['seq_len_from']}")  # fmt: skip
    naive_last = window_medians(cpu_curves["phase1_naive"], WINDOW)[-1]
    cached_last = window_medians(cpu_curves["phase3_kvcache"], WINDOW)[-1]
    print(f"phase 1 growth {growth(cpu_curves['phase1_naive']):.1f}x (CPU time); "
          f"phase 3 {naive_last / cached_last:.1f}x faster in the last window")  # fmt: skip
    model = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**config_kwargs)).eval()
    model.load_state_dict(state)
    batching = static_batching(model, QUICK_NUM_REQUESTS if args.quick else NUM_REQUESTS)
    print(
        f"static batching: {batching['static_batch_tok_s']:.0f} tok/s vs "
        f"{batching['one_at_a_time_tok_s']:.0f} one at a time (wall); "
        f"{batching['static_batch_tok_per_cpu_s']:.0f} vs "
        f"{batching['one_at_a_time_tok_per_cpu_s']:.0f} per CPU second; "
        f"{100 * batching['wasted_slot_fraction']:.0f}% of slots wasted"
    )
    path = write_result(
        "phase3_kvcache",
        {
            "quick": args.quick,
            "workload": {
                "prompt_len": PROMPT_LEN,
                "new_tokens": new_tokens,
                "repeats": repeats,
                "window": WINDOW,
                "timing": "one warm-up run; per-step median over the timed runs; window medians",
                "clock": "process CPU time (headline) and wall time",
                **config_kwargs,
            },
            "baseline": "phase1_naive, same weights, same run",
            "per_token_ms": per_token,
            "phase1_growth_last_over_reference": growth(cpu_curves["phase1_naive"]),
            "phase3_growth_last_over_reference": growth(cpu_curves["phase3_kvcache"]),
            "speedup_last_window": naive_last / cached_last,
            "static_batching": batching,
        },
        args.out,
    )
    print(f"wrote {path}")
    if args.plot:
        plot(args.out / "phase3_kvcache.png", cpu_curves)


def plot(path, curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, times in curves.items():
        ax.plot([PROMPT_LEN + i for i in range(len(times))], [1000 * t for t in times],
                lw=0.6, label=name)  # fmt: skip
    ax.set(xlabel="sequence length", ylabel="CPU ms per token (median of runs)",
           title="naive vs KV cache")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
