"""Phase 0 benchmark: how big TinyTransformer is and what one forward pass costs.

Counts the parameters of the default TinyTransformer and times `forward` on one sequence of
several lengths (best of a few repeats, CPU or GPU). For scale it also counts the parameters of
the same class built with Qwen3-0.6B's shapes on the `meta` device (no memory is allocated),
and what that count becomes for the real Qwen3-0.6B: TinyTransformer has its own `lm_head`
(vocab x hidden = 155.6M parameters), Qwen3-0.6B ties it to the embedding and adds a q/k RMSNorm
(2 x head_dim weights per layer): 751.6M - 155.6M + 7,168 = 596.0M.
Writes phase0_basics.json into --out.
Run: python -m benchmarks.phase0_basics [--quick] [--out DIR] [--threads 2]
"""

import argparse
import time

import torch

from benchmarks.harness import QWEN3_0_6B, Timer, benchmark_parser, parse_args, write_result
from phase0_basics import ModelConfig, TinyTransformer

SEQ_LENS, QUICK_SEQ_LENS = (16, 128, 1024), (16, 128)
REPEATS, QUICK_REPEATS = 5, 2
# Qwen3-0.6B's shapes (workload W's model, benchmarks/README.md).
QWEN3_0_6B_SHAPES = ModelConfig(
    vocab_size=QWEN3_0_6B["vocab_size"],
    hidden_size=QWEN3_0_6B["hidden_size"],
    num_layers=QWEN3_0_6B["num_hidden_layers"],
    num_heads=QWEN3_0_6B["num_attention_heads"],
    num_kv_heads=QWEN3_0_6B["num_key_value_heads"],
    head_dim=QWEN3_0_6B["head_dim"],
    intermediate_size=QWEN3_0_6B["intermediate_size"],
    max_position_embeddings=QWEN3_0_6B["max_position_embeddings"],
)
BF16_BYTES = 2


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.inference_mode()
def forward_ms(model: TinyTransformer, seq_len: int, repeats: int) -> tuple[float, float]:
    """(best wall ms, best process CPU ms) of one forward pass over `seq_len` tokens."""
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    model(input_ids)  # warm-up
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        cpu_start = time.process_time()
        with Timer() as t:
            model(input_ids)
        best_wall = min(best_wall, t.seconds)
        best_cpu = min(best_cpu, time.process_time() - cpu_start)
    return 1000 * best_wall, 1000 * best_cpu


def qwen3_0_6b_params(untied_params: int, config: ModelConfig) -> int:
    """The real Qwen3-0.6B's count: no separate lm_head (tied), plus q/k RMSNorm weights."""
    lm_head = config.vocab_size * config.hidden_size
    qk_norm = config.num_layers * 2 * config.head_dim
    return untied_params - lm_head + qk_norm


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__)


def main():
    args = parse_args(build_parser())
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    repeats = QUICK_REPEATS if args.quick else REPEATS
    torch.manual_seed(0)
    config = ModelConfig()
    model = TinyTransformer(config).eval()
    tiny_params = num_params(model)
    with torch.device("meta"):
        big_params = num_params(TinyTransformer(QWEN3_0_6B_SHAPES))

    print(f"TinyTransformer (default config): {tiny_params:,} parameters")
    rows = []
    for seq_len in seq_lens:
        wall_ms, cpu_ms = forward_ms(model, seq_len, repeats)
        rows.append(
            {
                "seq_len": seq_len,
                "forward_ms": round(wall_ms, 3),
                "forward_cpu_ms": round(cpu_ms, 3),
            }
        )
        print(f"  forward, 1 x {seq_len:4d} tokens: {wall_ms:7.2f} ms wall, {cpu_ms:7.2f} ms CPU")
    real_params = qwen3_0_6b_params(big_params, QWEN3_0_6B_SHAPES)
    print(
        f"Same class at Qwen3-0.6B shapes: {big_params:,} parameters "
        f"= {big_params * BF16_BYTES / 1e9:.2f} GB in bf16 (untied lm_head); the real Qwen3-0.6B "
        f"(tied, q/k norm): {real_params:,}"
    )
    path = write_result(
        "phase0_basics",
        {
            "quick": args.quick,
            "workload": {"model": config.__dict__, "repeats": repeats, "timing": "best of"},
            "tiny_params": tiny_params,
            "forward": rows,
            "qwen3_0_6b_shapes_params": big_params,
            "qwen3_0_6b_shapes_note": "TinyTransformer: untied lm_head, no q/k norm",
            "qwen3_0_6b_real_params": real_params,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
