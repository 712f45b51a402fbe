"""Phase 6 on the GPU: the engine with its readable torch attention, on Qwen3-0.6B shapes.

The number phase 7 has to beat. A random Qwen3-0.6B-shaped checkpoint (workload W's model,
benchmarks/README.md: throughput does not depend on the weights' values) is saved with
transformers in bf16, with the real Qwen3 tokenizer files beside it, then both sides run the
same seeded slice of workload W in one run:
- phase 6: `LLM(checkpoint).generate`, temperature 0.6, ignore_eos;
- transformers: one left-padded static `generate` over the same prompts (sampling, temperature
  0.6), run to the longest max_tokens; only each request's own max_tokens count as output.
Throughput = requested output tokens / wall time, prefill included.
--quick: 8 requests, outputs capped at 32 tokens.
Writes phase6_qwen3_gpu.json into --out.
Run (on a CUDA machine): python -m benchmarks.phase6_qwen3_gpu [--requests 64] [--quick] [--out DIR]
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

import phase6_qwen3
from benchmarks.harness import (
    QWEN3_0_6B,
    W_TEMPERATURE,
    Request,
    Timer,
    benchmark_parser,
    parse_args,
    workload_w,
    write_result,
)

TEMPERATURE = W_TEMPERATURE
MAX_OUTPUT = 256  # W's outputs go to 1,024; capped so the static baseline ends in minutes
QUICK_REQUESTS, QUICK_MAX_OUTPUT = 8, 32


def save_checkpoint(directory: Path, tokenizer_dir: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shapes = {k: v for k, v in QWEN3_0_6B.items() if k != "model_type"}  # the class says it
    model = Qwen3ForCausalLM(Qwen3Config(**shapes)).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def run_phase6(checkpoint: Path, workload) -> dict:
    llm = phase6_qwen3.LLM(
        checkpoint, max_num_seqs=len(workload), max_num_batched_tokens=512, num_kv_blocks=8192
    )
    prompts = [r.prompt_ids for r in workload]
    params = [
        phase6_qwen3.SamplingParams(temperature=TEMPERATURE, max_tokens=r.max_tokens,
                                    ignore_eos=True, seed=i)
        for i, r in enumerate(workload)
    ]  # fmt: skip
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: allocator, kernels
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": t.seconds, "output_tokens": tokens, "tok_s": tokens / t.seconds}


@torch.inference_mode()
def run_transformers(checkpoint: Path, workload) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    longest = max(len(r.prompt_ids) for r in workload)
    ids = torch.zeros(len(workload), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(workload):
        ids[row, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, longest - len(r.prompt_ids) :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, pad_token_id=0)
    model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs)  # warm-up
    max_new = max(r.max_tokens for r in workload)
    with Timer() as t:
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       **kwargs)  # fmt: skip
    tokens = sum(r.max_tokens for r in workload)  # only what each request asked for
    return {"seconds": t.seconds, "output_tokens": tokens, "tok_s": tokens / t.seconds}


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, threads=False)
    parser.add_argument("--requests", type=int, default=64, help="first N requests of W")
    return parser


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from tests.assets import qwen3_tokenizer_dir

    num_requests = QUICK_REQUESTS if args.quick else args.requests
    cap = QUICK_MAX_OUTPUT if args.quick else MAX_OUTPUT
    workload = [Request(r.prompt_ids, min(r.max_tokens, cap)) for r in workload_w()[:num_requests]]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(Path(tmp), qwen3_tokenizer_dir())
        ours = run_phase6(checkpoint, workload)
        torch.cuda.empty_cache()
        baseline = run_transformers(checkpoint, workload)
    print(f"phase 6:      {ours['tok_s']:8.0f} output tok/s ({ours['seconds']:.1f} s)")
    print(f"transformers: {baseline['tok_s']:8.0f} output tok/s ({baseline['seconds']:.1f} s)")
    path = write_result(
        "phase6_qwen3_gpu",
        {
            "quick": args.quick,
            "workload": {
                "description": f"first {num_requests} requests of workload W "
                f"(benchmarks/README.md), max_tokens capped at {cap}, temperature {TEMPERATURE}, "
                "ignore_eos",
                "prompt_tokens": sum(len(r.prompt_ids) for r in workload),
                "output_tokens": sum(r.max_tokens for r in workload),
                "model": "random Qwen3-0.6B shapes, bf16",
            },
            "phase6": ours,
            "baseline_transformers_static_generate": baseline,
            "speedup": ours["tok_s"] / baseline["tok_s"],
            "transformers": __import__("transformers").__version__,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
