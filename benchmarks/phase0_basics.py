"""Phase 0 benchmark: how big TinyTransformer is and what one forward pass costs.

Counts the parameters of the default TinyTransformer and times `forward` on one sequence of
several lengths (best of a few repeats, CPU or GPU). For scale it also counts the parameters of
the same class built with Qwen3-0.6B's shapes on the `meta` device (no memory is allocated).
Writes benchmarks/results/phase0_basics.json.
Run: python -m benchmarks.phase0_basics [--threads 2]
"""

import argparse

import torch

from benchmarks.harness import Timer, add_thread_arg, set_threads, write_result
from phase0_basics import ModelConfig, TinyTransformer

SEQ_LENS = (16, 128, 1024)
REPEATS = 5
# Qwen3-0.6B's shapes (SPEC.md, reference workload W). TinyTransformer has an untied lm_head and
# no q/k-norm, so its count is close to, not equal to, the real model's 596M.
QWEN3_0_6B_SHAPES = ModelConfig(
    vocab_size=151936,
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    max_position_embeddings=40960,
)
BF16_BYTES = 2


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.inference_mode()
def forward_ms(model: TinyTransformer, seq_len: int) -> float:
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    model(input_ids)  # warm-up
    best = float("inf")
    for _ in range(REPEATS):
        with Timer() as t:
            model(input_ids)
        best = min(best, t.seconds)
    return 1000 * best


def main():
    set_threads(add_thread_arg(argparse.ArgumentParser()).parse_args().threads)
    torch.manual_seed(0)
    config = ModelConfig()
    model = TinyTransformer(config).eval()
    tiny_params = num_params(model)
    with torch.device("meta"):
        big_params = num_params(TinyTransformer(QWEN3_0_6B_SHAPES))

    print(f"TinyTransformer (default config): {tiny_params:,} parameters")
    rows = []
    for seq_len in SEQ_LENS:
        ms = forward_ms(model, seq_len)
        rows.append({"seq_len": seq_len, "forward_ms": round(ms, 3)})
        print(f"  forward, 1 x {seq_len:4d} tokens: {ms:7.2f} ms")
    print(
        f"Same class at Qwen3-0.6B shapes: {big_params:,} parameters "
        f"= {big_params * BF16_BYTES / 1e9:.2f} GB in bf16"
    )
    path = write_result(
        "phase0_basics",
        {
            "workload": {"model": config.__dict__, "repeats": REPEATS, "timing": "best of"},
            "tiny_params": tiny_params,
            "forward": rows,
            "qwen3_0_6b_shapes_params": big_params,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
