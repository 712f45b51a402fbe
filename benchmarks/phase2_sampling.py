"""Phase 2 benchmark: greedy decoding repeats itself; sampling does not, and costs little.

Repetition: the seeded TinyTransformer continues a few seeded random prompts under several
`SamplingParams`; for each we report the fraction of 4-grams that already occurred earlier in the
same output (0 = never repeats, near 1 = stuck in a loop) and the fraction of distinct tokens.
Overhead: the time `Sampler` takes to choose one token from a logits vector, greedy vs each
filter, at TinyTransformer's vocabulary and at Qwen3's (151,936), next to one forward step.
Phase 2's promise that the filters matter more on a trained model is measured on a real
checkpoint by benchmarks/phase6_sampling.py.
Writes phase2_sampling.json into --out.
Run: python -m benchmarks.phase2_sampling [--quick] [--out DIR] [--threads 2]
"""

import argparse
import random
import time

import torch

from benchmarks.harness import Timer, benchmark_parser, parse_args, write_result
from phase2_sampling import ModelConfig, Sampler, SamplingParams, TinyTransformer, generate

SEED = 0
NUM_PROMPTS = 4
PROMPT_LEN = 8
NEW_TOKENS, QUICK_NEW_TOKENS = 128, 16
NGRAM = 4
QWEN3_VOCAB = 151936
SAMPLER_CALLS = 20  # per timing; best of TIMING_REPEATS
TIMING_REPEATS = 3
CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.7, top_k 40": dict(temperature=0.7, top_k=40),
    "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "temperature 1.0, min_p 0.1": dict(temperature=1.0, min_p=0.1),
}


def repeated_ngram_fraction(ids: list[int], n: int = NGRAM) -> float:
    """Share of the n-grams in `ids` that already appeared earlier in `ids`."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        repeats += gram in seen
        seen.add(gram)
        total += 1
    return repeats / total


def repetition(model: TinyTransformer, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    rows = []
    for name, kwargs in CONFIGS.items():
        outs = [
            generate(model, p, SamplingParams(max_tokens=new_tokens, seed=SEED + i, **kwargs))
            for i, p in enumerate(prompts)
        ]
        rows.append(
            {
                "config": name,
                "repeated_4gram_fraction": round(
                    sum(map(repeated_ngram_fraction, outs)) / len(outs), 3
                ),
                "distinct_token_fraction": round(
                    sum(len(set(o)) / len(o) for o in outs) / len(outs), 3
                ),
            }
        )
    return rows


def sampler_us(params: SamplingParams, vocab_size: int) -> float:
    """Microseconds per token for Sampler on random logits of this vocabulary size."""
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(SEED))
    sampler = Sampler(params)
    best = float("inf")
    for _ in range(TIMING_REPEATS):
        start = time.perf_counter()
        for _ in range(SAMPLER_CALLS):
            sampler(logits)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / SAMPLER_CALLS


@torch.inference_mode()
def forward_step_us(model: TinyTransformer, seq_len: int) -> float:
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    model(input_ids)  # warm-up
    best = float("inf")
    for _ in range(TIMING_REPEATS):
        with Timer() as t:
            model(input_ids)
        best = min(best, t.seconds)
    return 1e6 * best


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__)


def main():
    args = parse_args(build_parser())
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    torch.manual_seed(SEED)
    config = ModelConfig()
    model = TinyTransformer(config).eval()
    rng = random.Random(SEED)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(PROMPT_LEN)] for _ in CONFIGS]
    prompts = prompts[:NUM_PROMPTS]

    rep_rows = repetition(model, prompts, new_tokens)
    print(f"repetition over {NUM_PROMPTS} prompts x {new_tokens} new tokens:")
    for r in rep_rows:
        print(
            f"  {r['config']:30s} repeated 4-grams {r['repeated_4gram_fraction']:.3f}, "
            f"distinct tokens {r['distinct_token_fraction']:.3f}"
        )

    cost_rows = []
    for name, kwargs in CONFIGS.items():
        params = SamplingParams(max_tokens=1, seed=SEED, **kwargs)
        row = {"config": name}
        for vocab in (config.vocab_size, QWEN3_VOCAB):
            row[f"us_per_token_vocab_{vocab}"] = round(sampler_us(params, vocab), 1)
        cost_rows.append(row)
    step_len = PROMPT_LEN + new_tokens // 2
    step_us = forward_step_us(model, step_len)
    print(f"sampler cost per token (one forward step at length {step_len}: {step_us:.0f} us):")
    for r in cost_rows:
        small, big = list(r.values())[1:]
        print(f"  {r['config']:30s} {small:8.1f} us (vocab {config.vocab_size}), "
              f"{big:8.1f} us (vocab {QWEN3_VOCAB})")  # fmt: skip

    path = write_result(
        "phase2_sampling",
        {
            "quick": args.quick,
            "workload": {
                "model": config.__dict__,
                "seed": SEED,
                "num_prompts": NUM_PROMPTS,
                "prompt_len": PROMPT_LEN,
                "new_tokens": new_tokens,
                "timing": f"best of {TIMING_REPEATS} x {SAMPLER_CALLS} calls",
            },
            "repetition": rep_rows,
            "sampler_cost": cost_rows,
            "forward_step_us": {"seq_len": step_len, "us": round(step_us, 1)},
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
