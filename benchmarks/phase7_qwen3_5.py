"""Qwen3.5-0.8B shapes on the H200: workload W and single stream through phase 7, against the
byte floor of every step.

A hybrid model's decode step reads the weights once (the tied 248,320-row LM head is a third of
them), reads every sequence's KV cache in its six attention layers, and reads and writes every
sequence's DeltaNet state in its eighteen others: 18 layers x (16 heads x 128 x 128 fp32 + the
conv state) = 19.5 MB a sequence, twice (read, then write). At 256 sequences that is 10 GB a
step, more than the weights and the KV together, so the floor (bytes / copy bandwidth, plus the
prefill's FLOPs at the matmul rate) is:

    floor = steps x weight bytes + sum over output tokens of (2 x state bytes + context x KV
            bytes a token) + 2 x params x prompt tokens / FLOP rate

Weights are random (`load_format="dummy"`: throughput does not depend on their values), the
tokenizer is the real Qwen3 one (W sends token ids). Published reference: nano-vllm's unmerged
Qwen3.5 branch, 5,338 tok/s on W on an H20 (4.0 TB/s). Goals: W >= 20,000 output tok/s, single
stream <= 1.2 ms/token.

The single stream also records what one decode step launches (torch.profiler: kernels per step
and GPU µs per kind, as benchmarks/phase7_optim.py does for Qwen3).

Run (CUDA machine): python -m benchmarks.phase7_qwen3_5 [--quick] [--single-only] [--out DIR]
Writes phase7_qwen3_5.json into the --out directory; with --single-only,
phase7_qwen3_5_single.json.
"""

import json
import statistics
import tempfile
from pathlib import Path

import torch

import phase7_optim
from benchmarks.harness import (
    QWEN3_5_0_8B,
    Timer,
    benchmark_parser,
    parse_args,
    workload_w,
    write_result,
)
from benchmarks.phase7_optim import profile_decode_step

COPY_BANDWIDTH = 4.252e12  # bytes/s, measured on the lent H200 (2026-11-29)
MATMUL_FLOPS = 772e12  # bf16, same day
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE = 256, 16384, 16
TEMPERATURE = 0.6
SINGLE_PROMPT, SINGLE_NEW = 512, 256
W_GOAL, SINGLE_GOAL = 20_000, 1.2


def save_config(directory: Path, tokenizer_dir: Path) -> Path:
    (directory / "config.json").write_text(json.dumps(QWEN3_5_0_8B))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    return directory


def make_llm(checkpoint: Path, **kwargs) -> phase7_optim.LLM:
    return phase7_optim.LLM(checkpoint, dtype="bfloat16", load_format="dummy", **kwargs)


def state_bytes_per_sequence(llm) -> int:
    c = llm.engine.model.config
    return c.num_deltanet_layers * c.state_shape.bytes_per_slot(torch.bfloat16)


def kv_bytes_per_token(llm) -> int:
    c = llm.engine.model.config
    return c.num_attention_layers * 2 * c.num_kv_heads * c.head_dim * 2


def weight_bytes(llm) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


def run_w(checkpoint: Path, workload) -> dict:
    blocks = sum(-(-(len(r.prompt_ids) + r.max_tokens) // BLOCK_SIZE) for r in workload)
    llm = make_llm(checkpoint, max_num_seqs=MAX_NUM_SEQS,
                   max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                   num_kv_blocks=blocks + MAX_NUM_SEQS, block_size=BLOCK_SIZE)  # fmt: skip
    prompts = [r.prompt_ids for r in workload]
    params = [
        phase7_optim.SamplingParams(temperature=TEMPERATURE, max_tokens=r.max_tokens,
                                    ignore_eos=True)
        for r in workload
    ]  # fmt: skip
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up: prefill kernels compile
    engine, steps = llm.engine, [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    engine.step = step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    floor = w_floor(llm, workload, steps[0])
    result = {
        "seconds": t.seconds, "output_tokens": tokens, "tok_s": tokens / t.seconds,
        "steps": steps[0], "floor_seconds": floor, "floor_tok_s": tokens / floor,
        "fraction_of_floor": floor / t.seconds,
        "state_pool_gib": engine.runner.state_pool.memory_bytes / 2**30,
    }  # fmt: skip
    again = time_once(llm, prompts, params)
    result["tok_s_second_run"] = again
    llm.shutdown()
    return result


def time_once(llm, prompts, params) -> float:
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / t.seconds


def w_floor(llm, workload, steps: int) -> float:
    state, kv = state_bytes_per_sequence(llm), kv_bytes_per_token(llm)
    params = sum(p.numel() for p in llm.engine.model.parameters())
    decode_bytes = steps * weight_bytes(llm)
    for r in workload:
        n, p = r.max_tokens, len(r.prompt_ids)
        decode_bytes += n * 2 * state + kv * (n * p + n * (n - 1) // 2)
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    return decode_bytes / COPY_BANDWIDTH + 2 * params * prompt_tokens / MATMUL_FLOPS


def single_stream(checkpoint: Path, enforce_eager: bool, profile: bool = False) -> dict:
    llm = make_llm(checkpoint, max_num_seqs=1, max_num_batched_tokens=1024, num_kv_blocks=64,
                   enforce_eager=enforce_eager)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 10000, (SINGLE_PROMPT,), generator=gen).tolist()

    def timed(max_tokens: int) -> float:
        params = phase7_optim.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                             ignore_eos=True)  # fmt: skip
        with Timer() as t:
            llm.generate([prompt], params, use_tqdm=False)
        return t.seconds

    timed(8)  # warm-up
    ttft = statistics.median(timed(1) for _ in range(5))
    total = statistics.median(timed(SINGLE_NEW) for _ in range(3))
    ms = (total - ttft) / (SINGLE_NEW - 1) * 1e3
    context = SINGLE_PROMPT + SINGLE_NEW // 2
    step_bytes = (
        weight_bytes(llm) + 2 * state_bytes_per_sequence(llm) + context * kv_bytes_per_token(llm)
    )
    floor_ms = step_bytes / COPY_BANDWIDTH * 1e3
    result = {"ttft_ms": ttft * 1e3, "ms_per_token": ms, "floor_ms_per_token": floor_ms,
              "fraction_of_floor": floor_ms / ms, "step_bytes": step_bytes}  # fmt: skip
    if profile:
        result["decode_step_b1"] = profile_decode_step(llm, 1)
    llm.shutdown()
    return result


def build_parser():
    parser = benchmark_parser(__doc__, threads=False)  # timed on a GPU
    parser.add_argument("--single-only", action="store_true", help="the single stream only")
    return parser


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from tests.assets import qwen3_tokenizer_dir

    workload = workload_w()[: 64 if args.quick else None]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_config(Path(tmp), qwen3_tokenizer_dir())
        result = {
            "model": "Qwen3.5-0.8B shapes (dummy weights, bf16)",
            "workload": "W",
            "quick": args.quick,
            "goals": {"w_tok_s": W_GOAL, "single_ms": SINGLE_GOAL},
        }
        result["single_stream"] = single_stream(checkpoint, enforce_eager=False, profile=True)
        if args.single_only:
            print(json.dumps(result, indent=1))
            return write_result("phase7_qwen3_5_single", result, args.out)
        result["single_stream_eager"] = single_stream(checkpoint, enforce_eager=True)
        print(json.dumps(result, indent=1), flush=True)
        result["w"] = run_w(checkpoint, workload)
    print(json.dumps(result, indent=1))
    write_result("phase7_qwen3_5", result, args.out)


if __name__ == "__main__":
    main()
