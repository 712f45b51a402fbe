"""The batch-1 GEMV configs tried inside the engine, not alone (GPU).

benchmarks/phase7_gemv.py tuned each layer's GEMV alone: many calls of one layer back to back in
a CUDA graph. In a decode step a GEMV follows a different kernel (QKV after down, gate_up after
o_proj, ...), and with programmatic dependent launch how much of its weight it loads while that
kernel runs depends on how many of its programs fit beside it: a config that wins alone may not
win in the chain. Here each candidate replaces one layer's tuned 1-row config
(`gemv.TUNED_H200`) in the single-stream engine of benchmarks/phase7_optim.py (512-token prompt,
256 new tokens, greedy), which reports ms per token and the decode step's profile: the GEMVs'
share of the span (`chain_us`) and the whole step's. The default config runs first and last.

Writes phase7_gemv_engine.json into --out.
Run (CUDA machine): python -m benchmarks.phase7_gemv_engine [--out DIR]
"""

import tempfile
from pathlib import Path
from unittest import mock

import torch

from benchmarks.harness import benchmark_parser, parse_args, write_result
from benchmarks.phase6_qwen3_gpu import save_checkpoint
from benchmarks.phase7_optim import single_stream
from phase7_optim.kernels import gemv

T = gemv._tile
CANDIDATES = {  # (N, K): 1-row configs to try besides the tuned one
    (1024, 3072): [T(8, 1024, 3, 4), T(16, 512, 6, 4), T(8, 256, 12, 4)],  # down
    (4096, 1024): [T(8, 1024, 1, 4), T(32, 1024, 1, 8)],  # qkv (one slice: the norm folds in)
    (1024, 2048): [T(8, 1024, 2, 4)],  # o_proj
    (6144, 1024): [T(16, 1024, 1, 4)],  # gate_up
}


def row(checkpoint: Path, label: str) -> dict:
    single = single_stream(checkpoint, enforce_eager=False, profile=True)
    step = single["decode_step_b1"]
    gemvs = step["per_kind"].get("_gemv_tile_kernel", {})
    result = {
        "label": label,
        "ms_per_token": single["ms_per_token"],
        "step_chain_us": step["chain_us_per_step"],
        "gemv_chain_us": gemvs.get("chain_us", 0.0),
        "first_kernels": step["first_kernels"],
    }
    print(f"{label:48} {result['ms_per_token']:.3f} ms/token, step {result['step_chain_us']:.0f}"
          f" µs, GEMVs {result['gemv_chain_us']:.0f} µs", flush=True)  # fmt: skip
    torch.cuda.empty_cache()
    return result


def build_parser():
    return benchmark_parser(__doc__, threads=False)  # --quick changes nothing: nine engines


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from tests.assets import qwen3_tokenizer_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(Path(tmp), qwen3_tokenizer_dir())
        rows.append(row(checkpoint, "tuned"))
        for shape, configs in CANDIDATES.items():
            tuned = gemv.TUNED_H200[shape]
            for config in configs:
                swapped = {**gemv.TUNED_H200, shape: (config, *tuned[1:])}
                with mock.patch.object(gemv, "TUNED_H200", swapped):
                    rows.append(row(checkpoint, f"{shape}: {config}"))
        rows.append(row(checkpoint, "tuned, again"))
    result = {"tuned_1_row": {str(k): str(v[0]) for k, v in gemv.TUNED_H200.items()}, "rows": rows}
    print(f"wrote {write_result('phase7_gemv_engine', result, args.out)}")


if __name__ == "__main__":
    main()
