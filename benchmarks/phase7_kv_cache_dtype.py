"""Phase 7's fp8 KV cache (`kv_cache_dtype="fp8"`) against one in the model's dtype: what it costs
in quality, what it buys in speed.

1. Quality, on real weights (the embedded SmolLM2-135M-Instruct, in float32 on CPU or bf16 on a
   GPU; skipped where its package is not installed). The model's keys and values are not normed,
   so they test e4m3's range harder than Qwen3's normed keys:
   - teacher-forced over a fixed text (benchmarks/README.md, its first TEXT_TOKENS tokens): at
     every position the next-token distribution with an fp8 cache against the model-dtype one:
     top-1 agreement, mean and max KL(reference || fp8), the reference token's log-probability
     change;
   - greedy chat completions of CHAT_PROMPTS (MAX_TOKENS each) through `LLM`: how many come out
     identical, and the mean length of the common prefix;
   - what fp8 cannot hold: the share of the reference cache's keys and values past +-448 (they
     saturate) and below 2^-6 in magnitude (subnormals, 2^-9 steps).
2. Speed (CUDA only): workload W (benchmarks/phase7_optim.py's engine) with each cache dtype,
   alternating auto, fp8, auto, fp8 on one GPU, so drift between instances cancels; single stream
   (512-token prompt, 256 new tokens) with each; and one decode step at 256 rows profiled
   (torch.profiler): decode attention's GPU µs, the kernel whose bytes fp8 halves.

`--decode-sweep-only` (CUDA): the decode kernel alone at W's context mix, batch 16-256, each cache
dtype under the tuned tile, the tuned tile with every key tile masked (`whole_tiles=False`, the
loop before 2026-12-06) and 26 other tiles (phase7_kv_cache_dtype_decode_sweep.json); with
`--whole-tiles-only` the first two alone (phase7_kv_cache_dtype_decode_whole_tiles.json).
Writes phase7_kv_cache_dtype_DEVICE.json (cpu or cuda) into --out.
Run: python -m benchmarks.phase7_kv_cache_dtype [--quick] [--out DIR]   (--quick: quality only,
one chat prompt)
"""

import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

import phase7_optim
from benchmarks.harness import Timer, benchmark_parser, parse_args, workload_w, write_result
from phase7_optim.attention import ForwardBatch
from phase7_optim.kv_cache import KVCache
from phase7_optim.loader import load_model
from phase7_optim.tokenizer import Tokenizer

TEXT_TOKENS = 1024
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish and German.",
]
MAX_TOKENS = 64
W_PASSES = 2  # per cache dtype, alternating
PROFILE_ROWS = 256
FP8 = torch.float8_e4m3fn


def teacher_forced(model, ids: list[int], cache_dtype: torch.dtype, device) -> tuple:
    """Log-probabilities at every position of `ids` (one prefill, block size 16), and the cache."""
    c, n, block = model.config, len(ids), 16
    blocks = -(-n // block)
    cache = KVCache(c.num_layers, blocks, block, c.num_kv_heads, c.head_dim, cache_dtype, device)
    i32 = dict(dtype=torch.int32, device=device)
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, n], **i32), seq_lens=torch.tensor([n], **i32),
        slot_mapping=torch.arange(n, **i32), block_tables=torch.arange(blocks, **i32)[None],
        logits_indices=torch.arange(n, **i32), max_query_len=n, max_seq_len=n, block_size=block,
    )  # fmt: skip
    with torch.inference_mode():
        logits = model(
            torch.tensor(ids, device=device), torch.arange(n, device=device), batch, cache
        )
    return logits.float().log_softmax(-1), cache


def range_shares(cache: KVCache) -> dict:
    """The share of the (model-dtype) cache's values fp8 saturates, and holds as subnormals."""
    values = torch.cat([t.flatten().float() for t in cache.k + cache.v])
    magnitude = values.abs()
    return {
        "values": values.numel(),
        "past_448": float((magnitude > 448).float().mean()),
        "below_2^-6": float(((magnitude < 2**-6) & (magnitude > 0)).float().mean()),
        "max_abs": float(magnitude.max()),
        "median_abs": float(magnitude.median()),
    }


def divergence(reference: torch.Tensor, other: torch.Tensor, ids: list[int]) -> dict:
    """Per-position log-probabilities (T, V) of two runs over `ids`, compared."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    targets = torch.tensor(ids[1:], device=reference.device)[:, None]
    change = (other[:-1].gather(1, targets) - reference[:-1].gather(1, targets)).abs()
    return {
        "top1_agreement": float((reference.argmax(-1) == other.argmax(-1)).float().mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "target_logprob_change_mean": float(change.mean()),
        "target_logprob_change_max": float(change.max()),
    }


def quality(quick: bool) -> dict | None:
    from phase7_optim.default_model import default_model_dir

    try:
        model_dir = default_model_dir()
    except (ImportError, FileNotFoundError, RuntimeError) as error:
        print(f"quality skipped: {error}")
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = load_model(model_dir, dtype, torch.device(device))
    text = (Path(__file__).parent / "README.md").read_text()
    ids = Tokenizer.from_dir(model_dir).encode(text)[:TEXT_TOKENS]
    reference, ref_cache = teacher_forced(loaded.model, ids, dtype, device)
    result = {"model": f"SmolLM2-135M-Instruct ({dtype}, {device})", "text_tokens": len(ids)}
    # a bf16 cache under a float32 model: what 16 bits already cost, for scale
    for name, cache_dtype in (("bfloat16_cache", torch.bfloat16), ("fp8_cache", FP8)):
        if cache_dtype != dtype:
            result[name] = divergence(reference, teacher_forced(loaded.model, ids, cache_dtype,
                                                                device)[0], ids)  # fmt: skip
    result["range"] = range_shares(ref_cache)
    del loaded
    prompts = CHAT_PROMPTS[:1] if quick else CHAT_PROMPTS
    completions = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = phase7_optim.LLM(model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        params = phase7_optim.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        completions[kv_cache_dtype] = [o.outputs[0].token_ids for o in outs]
        del llm
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(completions["auto"], completions["fp8"], strict=True)
    ]
    result["chat"] = {
        "prompts": len(prompts),
        "max_tokens": MAX_TOKENS,
        "identical": sum(x == y for x, y in zip(*completions.values(), strict=True)),
        "mean_common_prefix_tokens": statistics.fmean(prefixes),
    }
    print(
        f"fp8 cache: top-1 {result['fp8_cache']['top1_agreement']:.4f}, KL mean "
        f"{result['fp8_cache']['kl_mean']:.2e}; chat identical "
        f"{result['chat']['identical']}/{len(prompts)}"
    )
    return result


def speed() -> dict:
    from benchmarks.phase6_qwen3_gpu import save_checkpoint
    from benchmarks.phase7_optim import make_llm, profile_decode_step, single_stream, throughput
    from tests.assets import qwen3_tokenizer_dir

    w = workload_w()
    runs: dict[str, list[float]] = {"auto": [], "fp8": []}
    single, attention = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(Path(tmp), qwen3_tokenizer_dir())
        for _ in range(W_PASSES):
            for kv_cache_dtype in runs:
                llm = make_llm(checkpoint, w, kv_cache_dtype=kv_cache_dtype)
                runs[kv_cache_dtype].append(throughput(llm, w)["tok_s"])
                print(f"W {kv_cache_dtype}: {runs[kv_cache_dtype][-1]:.0f} tok/s", flush=True)
                del llm
                torch.cuda.empty_cache()
        for kv_cache_dtype in runs:
            single[kv_cache_dtype] = single_stream(
                checkpoint, enforce_eager=False, kv_cache_dtype=kv_cache_dtype
            )["ms_per_token"]
            llm = make_llm(checkpoint, w, kv_cache_dtype=kv_cache_dtype)
            step = profile_decode_step(llm, PROFILE_ROWS)
            attention[kv_cache_dtype] = {
                "step_kernel_us": step["kernel_gpu_us_per_step"],
                "decode_attention_us": sum(
                    v["gpu_us"] for k, v in step["per_kind"].items() if "paged_decode" in k
                ),
            }
            del llm
            torch.cuda.empty_cache()
    median = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "w_tok_s": runs,
        "w_median_tok_s": median,
        "w_fp8_over_auto": median["fp8"] / median["auto"],
        "single_stream_ms_per_token": single,
        f"decode_step_{PROFILE_ROWS}_rows": attention,
        "workload": "workload W (256 requests), benchmarks/phase7_optim.py's engine settings; "
        "single stream: 512-token prompt, 256 new tokens, greedy",
        "model": "random Qwen3-0.6B shapes, bf16",
    }


SWEEP_BATCHES = (16, 64, 128, 256)


def decode_sweep(whole_tiles_only: bool = False) -> list[dict]:
    """The decode kernel alone at W's context mix (benchmarks/phase7_kernels.py's
    `bench_decode_w_mix`), each cache dtype under the tuned config and its neighbours: the tuned
    tile was chosen for bf16, and an fp8 tile of the same shape moves half the bytes.
    `whole_tiles_only`: the tuned config with and without `whole_tiles`, nothing else."""
    from dataclasses import replace

    from benchmarks.phase7_kernels import PagedCache, bench_decode_w_mix, try_bench
    from phase7_optim.kernels.paged_decode import TUNED_DECODE_CONFIG

    configs = [TUNED_DECODE_CONFIG, replace(TUNED_DECODE_CONFIG, whole_tiles=False)]
    configs += [] if whole_tiles_only else [
        replace(TUNED_DECODE_CONFIG, block_n=n, num_warps=w, num_stages=s)
        for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)
        if (n, w, s) != (64, 4, 2)
    ]  # fmt: skip
    bf16 = PagedCache()
    fp8 = SimpleNamespace(k=bf16.k.to(FP8), v=bf16.v.to(FP8))  # the same keys, in fp8
    rows = []
    for batch in SWEEP_BATCHES:
        for name, cache, element_bytes in (("auto", bf16, 2), ("fp8", fp8, 1)):
            for config in configs:
                r = try_bench(lambda c=config, kv=cache, b=batch: bench_decode_w_mix(kv, b, c))
                if "us" in r:  # the KV bytes read, in this cache's element size
                    r["GBps"] = r["GBps"] * element_bytes / 2
                knobs = (config.block_n, config.num_warps, config.num_stages)
                rows.append({
                    "batch": batch, "kv_cache_dtype": name, "config": knobs,
                    "whole_tiles": config.whole_tiles, **r,
                })  # fmt: skip
            best = min((r for r in rows[-len(configs) :] if "us" in r), key=lambda r: r["us"])
            tuned, masked = (rows[-len(configs) + i].get("us", float("nan")) for i in (0, 1))
            print(f"decode b{batch} {name}: tuned {tuned:.1f} us (every tile masked {masked:.1f}),"
                  f" best {best['config']} {best['us']:.1f} us {best['GBps']:.0f} GB/s",
                  flush=True)  # fmt: skip
    return rows


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--decode-sweep-only",
        action="store_true",
        help="only the decode kernel, each cache dtype over tile configs (CUDA)",
    )
    parser.add_argument(
        "--whole-tiles-only",
        action="store_true",
        help="with --decode-sweep-only: the tuned tile with and without whole_tiles, no others",
    )
    return parser


def main():
    args = parse_args(build_parser())
    if args.decode_sweep_only:
        rows = decode_sweep(args.whole_tiles_only)
        name = "decode_whole_tiles" if args.whole_tiles_only else "decode_sweep"
        path = write_result(f"phase7_kv_cache_dtype_{name}", {"rows": rows}, args.out)
        print(f"wrote {path}")
        return
    result = {"quality": quality(args.quick), "quick": args.quick}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not args.quick:
        with Timer() as t:
            result["speed"] = speed()
        result["speed"]["seconds"] = t.seconds
        s = result["speed"]
        print(f"W fp8 / auto: {s['w_fp8_over_auto']:.3f}; single {s['single_stream_ms_per_token']}")
    if result["quality"] is None and "speed" not in result:
        raise SystemExit("nothing measured: no default model installed and no CUDA GPU")
    path = write_result(f"phase7_kv_cache_dtype_{device}", result, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
