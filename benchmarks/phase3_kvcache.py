"""Phase 3 benchmark: the KV cache flattens per-token time; static batching wastes slots.

1. Per-token time vs sequence length, phase 1 (naive) and phase 3 (cached) in the same run, same
   weights, 8-token prompt, 1000 greedy tokens.
2. Static batching on a mixed workload (32 requests, prompts 16-256 tokens, outputs 8-256 tokens):
   throughput of one-at-a-time vs one static batch, and the fraction of computed token slots that
   were padding or rows already finished.
Run: python -m benchmarks.phase3_kvcache [--plot] [--threads 2]
"""

import argparse
import time

import torch

import phase1_naive
import phase3_kvcache
from benchmarks.harness import (
    RESULTS_DIR,
    Timer,
    add_thread_arg,
    seeded_workload,
    set_threads,
    write_result,
)

PROMPT_LEN = 8
NEW_TOKENS = 1000
BUCKET = 100


def step_times(tokens) -> list[float]:
    times, start = [], time.perf_counter()
    for _ in tokens:
        now = time.perf_counter()
        times.append(now - start)
        start = now
    return times


def per_token_curves(state: dict, config_kwargs: dict) -> dict:
    prompt = list(range(1, PROMPT_LEN + 1))
    naive = phase1_naive.TinyTransformer(phase1_naive.ModelConfig(**config_kwargs)).eval()
    naive.load_state_dict(state)
    cached = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**config_kwargs)).eval()
    cached.load_state_dict(state)
    greedy = phase3_kvcache.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    curves = {}
    for name, run in [
        ("phase1_naive", lambda: phase1_naive.iter_tokens(naive, prompt, NEW_TOKENS)),
        ("phase3_kvcache", lambda: phase3_kvcache.iter_tokens(cached, prompt, greedy)),
    ]:
        step_times(run())  # warm-up
        curves[name] = step_times(run())
    return curves


def bucketed(times: list[float]) -> list[dict]:
    return [
        {
            "seq_len_from": PROMPT_LEN + lo,
            "ms_per_token": 1000 * sum(times[lo : lo + BUCKET]) / len(times[lo : lo + BUCKET]),
        }
        for lo in range(0, len(times), BUCKET)
    ]


def static_batching(model) -> dict:
    workload = seeded_workload(1, 32, (16, 256), (8, 256), model.config.vocab_size)
    prompts = [r.prompt_ids for r in workload]
    params = [
        phase3_kvcache.SamplingParams(temperature=0.0, max_tokens=r.max_tokens) for r in workload
    ]
    useful = sum(r.max_tokens for r in workload)
    with Timer() as one_by_one:
        for p, sp in zip(prompts, params, strict=True):
            phase3_kvcache.generate(model, p, sp)
    with Timer() as batched:
        out = phase3_kvcache.generate_batch(model, prompts, params)
    return {
        "workload": "seeded_workload(1, 32, (16, 256), (8, 256)), greedy, no EOS",
        "output_tokens": useful,
        "one_at_a_time_tok_s": useful / one_by_one.seconds,
        "static_batch_tok_s": useful / batched.seconds,
        "wasted_slot_fraction": out.wasted_fraction,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", action="store_true", help="also write a PNG")
    args = add_thread_arg(parser).parse_args()
    set_threads(args.threads)
    config_kwargs = {"max_position_embeddings": PROMPT_LEN + NEW_TOKENS}
    torch.manual_seed(0)
    state = phase1_naive.TinyTransformer(phase1_naive.ModelConfig(**config_kwargs)).state_dict()
    curves = per_token_curves(state, config_kwargs)
    per_token = {name: bucketed(t) for name, t in curves.items()}
    for name, rows in per_token.items():
        first, last = rows[0]["ms_per_token"], rows[-1]["ms_per_token"]
        print(f"{name}: {first:.3f} ms/token at the start, {last:.3f} at the end")
    model = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**config_kwargs)).eval()
    model.load_state_dict(state)
    batching = static_batching(model)
    print(
        f"static batching: {batching['static_batch_tok_s']:.0f} tok/s vs "
        f"{batching['one_at_a_time_tok_s']:.0f} one at a time; "
        f"{100 * batching['wasted_slot_fraction']:.0f}% of slots wasted"
    )
    write_result(
        "phase3_kvcache",
        {
            "workload": {"prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, **config_kwargs},
            "baseline": "phase1_naive, same weights, same run",
            "per_token_ms": per_token,
            "static_batching": batching,
        },
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, times in curves.items():
            ax.plot([PROMPT_LEN + i for i in range(len(times))], [1000 * t for t in times],
                    lw=0.6, label=name)  # fmt: skip
        ax.set(xlabel="sequence length", ylabel="ms per token", title="naive vs KV cache")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / "phase3_kvcache.png", dpi=120)


if __name__ == "__main__":
    main()
