"""Phase 1 benchmark: per-token time of the naive loop grows with the sequence length.

Generates 1000 tokens greedily from an 8-token prompt with TinyTransformer and records how long each
step took. Writes benchmarks/results/phase1_naive.json and a PNG of time per token vs length.
Run: python -m benchmarks.phase1_naive [--plot] [--threads 2]
"""

import argparse
import time

import torch

from benchmarks.harness import RESULTS_DIR, add_thread_arg, set_threads, write_result
from phase1_naive import ModelConfig, TinyTransformer, iter_tokens

PROMPT_LEN = 8
NEW_TOKENS = 1000
BUCKET = 100  # report the mean step time over windows of this many tokens


def measure(model: TinyTransformer) -> list[float]:
    prompt = list(range(1, PROMPT_LEN + 1))
    step_times = []
    start = time.perf_counter()
    for _ in iter_tokens(model, prompt, NEW_TOKENS):
        now = time.perf_counter()
        step_times.append(now - start)
        start = now
    return step_times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", action="store_true", help="also write a PNG")
    args = add_thread_arg(parser).parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(max_position_embeddings=PROMPT_LEN + NEW_TOKENS)
    model = TinyTransformer(config).eval()
    measure(model)  # warm-up: allocator and kernels
    step_times = measure(model)
    rows = []
    for lo in range(0, NEW_TOKENS, BUCKET):
        window = step_times[lo : lo + BUCKET]
        rows.append(
            {
                "seq_len_from": PROMPT_LEN + lo,
                "seq_len_to": PROMPT_LEN + lo + len(window),
                "ms_per_token": 1000 * sum(window) / len(window),
            }
        )
    for r in rows:
        print(f"len {r['seq_len_from']:5d}-{r['seq_len_to']:5d}: {r['ms_per_token']:.3f} ms/token")
    growth = rows[-1]["ms_per_token"] / rows[0]["ms_per_token"]
    print(f"last window / first window: {growth:.1f}x")
    write_result(
        "phase1_naive",
        {
            "workload": {
                "model": config.__dict__,
                "prompt_len": PROMPT_LEN,
                "new_tokens": NEW_TOKENS,
                "bucket": BUCKET,
            },
            "per_token_ms": rows,
            "growth_last_over_first": growth,
        },
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        lengths = [PROMPT_LEN + i for i in range(len(step_times))]
        ax.plot(lengths, [1000 * t for t in step_times], lw=0.6)
        ax.set(xlabel="sequence length", ylabel="ms per token", title="phase 1: naive loop")
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / "phase1_naive.png", dpi=120)


if __name__ == "__main__":
    main()
