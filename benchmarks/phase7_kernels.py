"""Phase 7 kernel microbenchmarks (GPU): prefill TFLOP/s vs SDPA, decode bandwidth vs copy.

Workload (Qwen3-0.6B attention: 16 query heads, 8 KV heads, head_dim 128, bf16, seed 0):
- prefill: causal, 16k new tokens per step as 16k/N sequences of N tokens, N = 1k … 16k, no
  cached prefix. Ours reads K/V from a paged cache (block size 16 and 256, blocks in random
  physical order); the baseline is torch SDPA's flash backend on contiguous `[B, H, N, D]` tensors
  with K/V expanded to 16 heads (GQA handled outside the timed region, which only helps it).
  FLOPs counted as 4 * B * H * N^2 * D / 2 (two matmuls, causal half) for both.
- decode: one query per sequence, batch 1 … 256, contexts 512 … 32k (batch * context <= 2M
  tokens), block size 16 and 256; timed eagerly (Python launches included, as an engine without
  CUDA graphs sees it) and replayed from a CUDA graph (the kernels' GPU time). Bandwidth =
  bytes of K/V read (+ q and out) / time, against a device-to-device copy of 2 GiB measured in
  the same run (bytes read + written / time).
- decode at workload W's mix (`decode_w_mix`): contexts drawn uniformly from 100-2,000 tokens,
  batch 1-256, block size 16, block tables as wide as the engine's graphs capture them (Qwen3's
  40,960 positions), several layers' worth of separate caches per CUDA graph so small batches
  read from HBM and not from L2: the tuned decode launch against the baseline, and a sweep.
- the kernel levers (`levers`): the small-batch GEMV against cuBLAS (F.linear) on Qwen3-0.6B's
  linear layers at batch 1-16, bandwidth = weight bytes / time, each call on its own copy of the
  weight (4x the L2 in all) inside one CUDA graph; and the fused kernels against the unfused ones
  they replace (add + RMSNorm; q/k norm + RoPE twice + KV store), µs per layer.
Timing: triton.testing.do_bench, median, L2 flushed between repetitions.

Writes phase7_kernels.json into --out.
Run: python -m benchmarks.phase7_kernels [--out DIR] [--commit SHA] [--levers-only]
"""

import argparse
import os
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase7_optim.kernels import (
    flash_attn_varlen_paged,
    paged_decode_attention,
    varlen_paged_attention_ref,
)
from phase7_optim.kernels.flash_prefill import PrefillConfig, default_prefill_config
from phase7_optim.kernels.fused import (
    fused_add_rms_norm,
    qk_norm_rope,
    qk_norm_rope_store,
    rms_norm,
)
from phase7_optim.kernels.gemv import GemvConfig, choose_split_k, counters_for, gemv
from phase7_optim.kernels.kv_store import store_kvcache
from phase7_optim.kernels.paged_decode import (
    BASELINE_DECODE_CONFIG,
    TUNED_DECODE_CONFIG,
    DecodeConfig,
)

DEVICE = "cuda"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16
ELEMENT_BYTES = 2
PREFILL_TOKENS = 16384
PREFILL_LENS = [1024, 2048, 4096, 8192, 16384]
DECODE_BATCHES = [1, 8, 64, 256]
DECODE_CONTEXTS = [512, 2048, 8192, 32768]
MAX_CACHED_TOKENS = 2 * 1024 * 1024  # 4 GiB of K + 4 GiB of V
BLOCK_SIZES = [16, 256]
PREFILL_SWEEP = [
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 4, 3),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(128, 32, 4, 4),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 128, 4, 3),
    PrefillConfig(128, 64, 8, 4),
]
DECODE_SWEEP = [
    DecodeConfig(64, 4, 3),
    DecodeConfig(32, 4, 3),
    DecodeConfig(128, 4, 3),
    DecodeConfig(64, 4, 2),
    DecodeConfig(64, 4, 4),
    DecodeConfig(64, 8, 3),
    DecodeConfig(128, 8, 3),
    DecodeConfig(32, 2, 4),
]
SPLIT_SWEEP = [1, 2, 4, 8, 16, 32, 64]


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.float16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


class PagedCache:
    """One big K and V cache, viewed with each block size; blocks handed out in random order."""

    def __init__(self):
        shape = (MAX_CACHED_TOKENS, NUM_KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(shape, device=DEVICE, dtype=DTYPE)

    def block_tables(self, num_seqs: int, seq_len: int, block_size: int):
        blocks_per_seq = triton.cdiv(seq_len, block_size)
        perm = torch.randperm(MAX_CACHED_TOKENS // block_size, device=DEVICE)
        tables = perm[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).int()
        k = self.k.view(-1, block_size, NUM_KV_HEADS, HEAD_DIM)
        v = self.v.view(-1, block_size, NUM_KV_HEADS, HEAD_DIM)
        return k, v, tables


def prefill_inputs(cache: PagedCache, seq_len: int, block_size: int):
    num_seqs = PREFILL_TOKENS // seq_len
    k, v, tables = cache.block_tables(num_seqs, seq_len, block_size)
    q = torch.randn(num_seqs * seq_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    query_start_loc = (torch.arange(num_seqs + 1, device=DEVICE) * seq_len).int()
    seq_lens = torch.full((num_seqs,), seq_len, device=DEVICE, dtype=torch.int32)
    return q, k, v, query_start_loc, seq_lens, tables


def bench_prefill_ours(cache, seq_len, block_size, config) -> float:
    q, k, v, qsl, seq_lens, tables = prefill_inputs(cache, seq_len, block_size)
    scale = HEAD_DIM**-0.5
    return median_ms(
        lambda: flash_attn_varlen_paged(q, k, v, qsl, seq_lens, tables, seq_len, scale, config)
    )


def bench_prefill_sdpa(seq_len) -> float:
    shape = (PREFILL_TOKENS // seq_len, NUM_HEADS, seq_len, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))


def prefill_tflops(seq_len, ms) -> float:
    num_seqs = PREFILL_TOKENS // seq_len
    flops = 4 * num_seqs * NUM_HEADS * seq_len * seq_len * HEAD_DIM / 2
    return flops / (ms * 1e-3) / 1e12


def prefill_max_error(cache) -> float:
    """The benchmarked kernel computes the right thing on this workload (1k, block size 16)."""
    q, k, v, qsl, seq_lens, tables = prefill_inputs(cache, 1024, 16)
    args = (q, k, v, qsl, seq_lens, tables)
    out = flash_attn_varlen_paged(*args, 1024, HEAD_DIM**-0.5)
    ref = varlen_paged_attention_ref(*args, HEAD_DIM**-0.5)
    return (out.float() - ref.float()).abs().max().item()


def graph_ms(fn) -> float:
    """Median time of `fn` replayed from a CUDA graph: GPU time without Python's launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def bench_decode(cache, batch, context, block_size, num_splits=None, config=None, graph=False):
    k, v, tables = cache.block_tables(batch, context, block_size)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    ms = (graph_ms if graph else median_ms)(
        lambda: paged_decode_attention(q, k, v, seq_lens, tables, scale, num_splits, config)
    )
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * ELEMENT_BYTES
    q_out_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * ELEMENT_BYTES
    return {"ms": ms, "GBps": (kv_bytes + q_out_bytes) / (ms * 1e-3) / 1e9}


def try_bench(fn):
    try:
        return fn()
    except Exception as err:  # a config the GPU rejects (shared memory, registers)
        return {"error": f"{type(err).__name__}: {str(err)[:200]}"}


def run_prefill(cache, results, save):
    device = torch.device(DEVICE)
    results["prefill_max_abs_error_vs_reference"] = prefill_max_error(cache)
    sweep = results.setdefault("prefill_config_sweep_4k", [])
    for block_size in BLOCK_SIZES:
        for config in PREFILL_SWEEP:
            ms = try_bench(lambda c=config, b=block_size: bench_prefill_ours(cache, 4096, b, c))
            row = {"block_size": block_size, "config": vars(config)}
            row.update(
                {"ms": ms, "TFLOPs": prefill_tflops(4096, ms)} if isinstance(ms, float) else ms
            )
            sweep.append(row)
            save()
    timed = [r for r in sweep if "TFLOPs" in r]
    best = PrefillConfig(**max(timed, key=lambda r: r["TFLOPs"])["config"])
    default = default_prefill_config(HEAD_DIM, device)
    results["prefill_best_sweep_config"] = vars(best)
    rows = results.setdefault("prefill", [])
    for seq_len in PREFILL_LENS:
        sdpa_ms = bench_prefill_sdpa(seq_len)
        row = {"seq_len": seq_len, "num_seqs": PREFILL_TOKENS // seq_len, "sdpa_flash_ms": sdpa_ms}
        row["sdpa_flash_TFLOPs"] = prefill_tflops(seq_len, sdpa_ms)
        for block_size in BLOCK_SIZES:
            for name, config in {"default": default, "best": best}.items():
                if name == "best" and best == default:
                    continue
                ms = bench_prefill_ours(cache, seq_len, block_size, config)
                row[f"ours_{name}_bs{block_size}_TFLOPs"] = prefill_tflops(seq_len, ms)
                row[f"ours_{name}_bs{block_size}_vs_sdpa"] = sdpa_ms / ms
        rows.append(row)
        print(row, flush=True)
        save()


def run_decode(cache, results, copy_gbps, save):
    sweep = results.setdefault("decode_config_sweep", [])
    for batch in (64, 256):
        for config in DECODE_SWEEP:
            r = try_bench(lambda c=config, b=batch: bench_decode(cache, b, 2048, 16, None, c))
            sweep.append({"batch": batch, "context": 2048, "config": vars(config), **r})
    save()
    splits = results.setdefault("decode_split_sweep", [])
    for batch, context in ((1, 32768), (8, 8192), (64, 2048), (256, 2048)):
        for num_splits in [None, *SPLIT_SWEEP]:
            row = {"batch": batch, "context": context, "num_splits": num_splits}
            for mode in ("eager", "graph"):
                r = bench_decode(cache, batch, context, 16, num_splits, graph=mode == "graph")
                row.update({f"{mode}_ms": r["ms"], f"{mode}_GBps": r["GBps"]})
            splits.append(row)
    save()
    rows = results.setdefault("decode", [])
    for block_size in BLOCK_SIZES:
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                if batch * context > MAX_CACHED_TOKENS:
                    continue
                row = {"block_size": block_size, "batch": batch, "context": context}
                for mode in ("eager", "graph"):
                    r = bench_decode(cache, batch, context, block_size, graph=mode == "graph")
                    row[f"{mode}_ms"] = r["ms"]
                    row[f"{mode}_GBps"] = r["GBps"]
                    row[f"{mode}_pct_of_copy"] = 100 * r["GBps"] / copy_gbps
                rows.append(row)
                print(rows[-1], flush=True)
        save()


def summarize(results):
    copy = results["copy_bandwidth_GBps"]
    prefill = {
        r["seq_len"]: {k: round(v, 3) for k, v in r.items() if k.endswith("_vs_sdpa")}
        for r in results["prefill"]
    }
    decode = [
        (
            r["block_size"],
            r["batch"],
            round(r["eager_pct_of_copy"], 1),
            round(r["graph_pct_of_copy"], 1),
        )
        for r in results["decode"]
        if r["batch"] >= 64 and r["context"] == 2048
    ]
    return {
        "targets": "prefill >= 0.70 x SDPA flash; decode >= 70% of copy at batch >= 64, ctx 2k",
        "prefill_ours_over_sdpa_by_seq_len": prefill,
        "decode_pct_of_copy_at_2k_(block_size,batch,eager,graph)": decode,
        "copy_bandwidth_GBps": copy,
    }


# ---- decode attention at W's mix ---------------------------------------------------------------

W_MIX_BATCHES = [1, 8, 32, 64, 128, 256]
W_MIX_CONTEXTS = (100, 2000)  # W's prompts are 100-1,024 tokens, its outputs 100-1,024
ENGINE_MAX_CONTEXT = 40960  # Qwen3's max_position_embeddings: the graphs' block-table width
W_MIX_BLOCK_SIZE = 16  # the engine's default, and benchmarks/phase7_optim.py's
W_MIX_LAYERS = 8  # separate caches per graph (layers), so batch 1 is not served from L2
W_MIX_SWEEP = [
    DecodeConfig(block_n, num_warps, num_stages)
    for block_n, num_warps, num_stages in (
        (32, 2, 3), (32, 4, 3), (64, 2, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3),
        (128, 8, 3),
    )
]  # fmt: skip
W_MIX_SPLITS = [1, 2, 4, 8]


def graph_ms_per_call(calls) -> float:
    """Median GPU time of one of `calls` (each on its own memory), all replayed in one graph."""
    return graph_ms(lambda: [call() for call in calls]) / len(calls)


def bench_decode_w_mix(cache, batch, config, num_splits=None) -> dict:
    rng = random.Random(batch)
    contexts = [rng.randint(*W_MIX_CONTEXTS) for _ in range(batch)]
    bs, width = W_MIX_BLOCK_SIZE, ENGINE_MAX_CONTEXT // W_MIX_BLOCK_SIZE
    k, v = (c.view(-1, bs, NUM_KV_HEADS, HEAD_DIM) for c in (cache.k, cache.v))
    per_seq = [triton.cdiv(n, bs) for n in contexts]
    layers = max(1, min(W_MIX_LAYERS, k.shape[0] // sum(per_seq)))
    perm = torch.randperm(k.shape[0], device=DEVICE).int()
    tables, used = [], 0
    for _ in range(layers):
        table = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
        for row, n in enumerate(per_seq):
            table[row, :n] = perm[used : used + n]
            used += n
        tables.append(table)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    seq_lens = torch.tensor(contexts, device=DEVICE, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    # as the engine's model runner hands it over (host-sorted, longest context first)
    order = torch.argsort(seq_lens, descending=True).int() if config.longest_first else None
    ms = graph_ms_per_call(
        [lambda t=t: paged_decode_attention(q, k, v, seq_lens, t, scale, num_splits, config,
                                            order=order)
         for t in tables]
    )  # fmt: skip
    kv_bytes = 2 * sum(contexts) * NUM_KV_HEADS * HEAD_DIM * ELEMENT_BYTES
    return {"us": ms * 1e3, "GBps": kv_bytes / (ms * 1e-3) / 1e9, "layers": layers}


def run_decode_w_mix(cache, results, copy_gbps, save, sweep: bool = True) -> None:
    rows = results.setdefault("decode_w_mix", [])
    for batch in W_MIX_BATCHES:
        row = {"batch": batch}
        for name, config in (("baseline", BASELINE_DECODE_CONFIG), ("tuned", TUNED_DECODE_CONFIG)):
            r = bench_decode_w_mix(cache, batch, config)
            row.update({f"{name}_us": r["us"], f"{name}_pct_of_copy": 100 * r["GBps"] / copy_gbps})
        row["sweep"] = [
            {**vars(c), **try_bench(lambda c=c, b=batch: bench_decode_w_mix(cache, b, c))}
            for c in (W_MIX_SWEEP if sweep else [])
        ]
        row["splits"] = [
            {"num_splits": n, **bench_decode_w_mix(cache, batch, TUNED_DECODE_CONFIG, n)}
            for n in (W_MIX_SPLITS if sweep else [])
        ]
        for r in row["sweep"] + row["splits"]:
            if "GBps" in r:
                r["pct_of_copy"] = 100 * r["GBps"] / copy_gbps
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("sweep", "splits")}, flush=True)
        save()


# ---- the GEMV and the fused kernels ------------------------------------------------------------

QWEN3_LINEARS = {  # name: (out_features N, in_features K), Qwen3-0.6B at one rank
    "qkv_proj": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up_proj": (6144, 1024),
    "down_proj": (1024, 3072),
    "lm_head": (151936, 1024),
}
GEMV_BATCHES = [1, 4, 8, 16]
L2_BYTES = 60 * 2**20  # the H200's, as torch reports it
GEMV_SWEEP = [  # (block_n, block_k, num_warps, num_stages); the split from 1, 2, 4 programs/SM
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 4),
    (64, 256, 8, 3), (16, 512, 4, 3), (32, 256, 8, 4),
]  # fmt: skip


def bench_linear(n, k, batch, config=None, cublas=False) -> dict:
    weight_bytes = n * k * ELEMENT_BYTES
    copies = max(2, triton.cdiv(4 * L2_BYTES, weight_bytes))
    weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) for _ in range(copies)]
    x = torch.randn(batch, k, device=DEVICE, dtype=DTYPE)
    counters = counters_for(n, x.device)
    if cublas:
        calls = [lambda w=w: F.linear(x, w) for w in weights]
    else:
        calls = [lambda w=w: gemv(x, w, counters, config) for w in weights]
    ms = graph_ms_per_call(calls)
    return {"us": ms * 1e3, "GBps": weight_bytes / (ms * 1e-3) / 1e9}


def run_gemv(results, copy_gbps, save, sweeps: bool = True) -> None:
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    rows = results.setdefault("gemv", [])
    for name, (n, k) in QWEN3_LINEARS.items():
        x = torch.randn(3, k, device=DEVICE, dtype=DTYPE)
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE)
        error = (gemv(x, w, counters_for(n, x.device)).float() - x.float() @ w.float().T).abs()
        row = {"layer": name, "N": n, "K": k, "max_abs_error_vs_fp32": error.max().item()}
        for batch in GEMV_BATCHES:
            for kind, kwargs in (("cublas", {"cublas": True}), ("gemv", {})):
                r = bench_linear(n, k, batch, **kwargs)
                row[f"{kind}_b{batch}_us"] = r["us"]
                row[f"{kind}_b{batch}_pct_of_copy"] = 100 * r["GBps"] / copy_gbps
        sweep = row.setdefault("sweep_b1", [])
        for block_n, block_k, warps, stages in GEMV_SWEEP if sweeps else []:
            for per_sm in (1, 2, 4):
                split = choose_split_k(n, k, block_n, block_k, per_sm * num_sms)
                config = GemvConfig(block_n, block_k, split, warps, stages)
                r = try_bench(lambda c=config, n=n, k=k: bench_linear(n, k, 1, c))
                sweep.append({**vars(config), **r})
                if "GBps" in r:
                    sweep[-1]["pct_of_copy"] = 100 * r["GBps"] / copy_gbps
        timed = [r for r in sweep if "GBps" in r]
        if timed:
            row["best_b1"] = max(timed, key=lambda r: r["GBps"])
        rows.append(row)
        print({key: v for key, v in row.items() if key != "sweep_b1"}, flush=True)
        save()


def run_fused(results, save) -> None:
    """µs per layer, unfused kernels vs the fused one, at decode batch 1 and 256."""
    rows = results.setdefault("fused", [])
    for batch in (1, 256):
        rows.append({"batch": batch, **bench_fused(batch)})
        print(rows[-1], flush=True)
    save()


def bench_fused(batch: int) -> dict:
    hidden, eps, block_size = 1024, 1e-6, 16
    x, r = (torch.randn(batch, hidden, device=DEVICE, dtype=DTYPE) for _ in range(2))
    w = torch.ones(hidden, device=DEVICE, dtype=DTYPE)
    head_w = torch.ones(HEAD_DIM, device=DEVICE, dtype=DTYPE)
    widths = [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM]
    qkv = torch.randn(batch, sum(widths), device=DEVICE, dtype=DTYPE)
    q, k, v = (t.view(batch, -1, HEAD_DIM) for t in qkv.split(widths, -1))
    cos = torch.rand(ENGINE_MAX_CONTEXT, HEAD_DIM // 2, device=DEVICE)
    sin = torch.rand_like(cos)
    positions = torch.randint(0, 2000, (batch,), device=DEVICE)
    k_cache = torch.zeros(1024, block_size, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(1024 * block_size, device=DEVICE)[:batch].int()

    def rope_store_unfused():
        q_rot = qk_norm_rope(q, head_w, cos, sin, positions, eps)
        k_rot = qk_norm_rope(k, head_w, cos, sin, positions, eps)
        store_kvcache(k_rot, v, k_cache, v_cache, slots)
        return q_rot

    calls = {
        "add_rms_norm_unfused": lambda: rms_norm(x + r, w, eps),
        "add_rms_norm_fused": lambda: fused_add_rms_norm(x, r, w, eps),
        "rope_store_unfused": rope_store_unfused,
        "rope_store_fused": lambda: qk_norm_rope_store(
            q, k, v, head_w, head_w, cos, sin, positions, eps, k_cache, v_cache, slots
        ),
    }
    return {f"{name}_us": graph_ms_per_call([fn] * 28) * 1e3 for name, fn in calls.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, threads=False)
    parser.add_argument("--commit", default=os.environ.get("MINI_VLLM_COMMIT"))
    parser.add_argument(
        "--no-sweeps", action="store_true", help="defaults and baselines only, no config sweeps"
    )
    parser.add_argument(
        "--levers-only",
        action="store_true",
        help="only decode at W's mix, the GEMV and the fused kernels (a few minutes)",
    )
    return parser


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("phase7_kernels needs a CUDA GPU; nothing to measure here")
    torch.manual_seed(0)
    results = {
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "workload": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": str(DTYPE),
            "prefill_tokens_per_step": PREFILL_TOKENS,
            "prefill_seq_lens": PREFILL_LENS,
            "decode_batches": DECODE_BATCHES,
            "decode_contexts": DECODE_CONTEXTS,
            "block_sizes": BLOCK_SIZES,
            "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms, L2 flushed",
        },
    }
    if args.commit:
        results["commit"] = args.commit

    def save():
        write_result("phase7_kernels", results, args.out)

    results["copy_bandwidth_GBps"] = copy_bandwidth_gbps()
    print("copy GB/s", results["copy_bandwidth_GBps"], flush=True)
    cache = PagedCache()
    if args.quick:  # one decode and one prefill shape: checks the script, not the numbers
        results["quick"] = True
        results["decode_ms_batch8_ctx2048_bs16"] = bench_decode(cache, 8, 2048, 16)
        results["prefill_tflops_1024"] = prefill_tflops(
            1024, bench_prefill_ours(cache, 1024, 16, PREFILL_SWEEP[0])
        )
        save()
        return
    sweeps = not args.no_sweeps
    run_decode_w_mix(cache, results, results["copy_bandwidth_GBps"], save, sweeps)
    run_gemv(results, results["copy_bandwidth_GBps"], save, sweeps)
    run_fused(results, save)
    if args.levers_only:
        return
    run_decode(cache, results, results["copy_bandwidth_GBps"], save)
    run_prefill(cache, results, save)
    results["summary"] = summarize(results)
    save()
    print(results["summary"])


if __name__ == "__main__":
    main()
