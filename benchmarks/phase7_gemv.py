"""The small-batch GEMV's tuning sweep (GPU): which kernel, tile, split and launch per shape.

Workload: Qwen3-0.6B's four layer linears (qkv 1024->4096, o_proj 2048->1024, gate_up
1024->6144, down 3072->1024; bf16, 2-12 MB of weight each) at 1, 2, 4 and 8 rows. Each call reads
its own copy of the weight (4x the L2 in all), many calls back to back in one CUDA graph, as a
decode step runs them; bandwidth = weight bytes / time per call, against a device-to-device copy
measured in the same run (bytes read + written / time).
- stage 1 (`candidates`): the one-tile-per-program kernel (kernels/gemv.py, `tile=True`) over
  every (BLOCK_N, SPLIT_K) whose grid (96-1,056 programs) and slice of W (8-64 KB) make sense,
  with tl.dot on rows padded to 16 or multiply-and-sum on the CUDA cores, 4 or 8 warps;
- stage 2: the best five of stage 1 again with programmatic dependent launch (each call's W
  loads overlap the previous call's tail), the K-loop kernel of before (its heuristic config),
  cuBLAS, and the down projection with SiLU-and-mul folded into its input against the
  separate silu_and_mul kernel plus the GEMV.
Every kernel variant is compiled first by a pool of processes (Triton's disk cache), so the
sweep itself times warm kernels. Timing: triton.testing.do_bench, median, L2 flushed.

Writes phase7_gemv.json into --out.
Run: python -m benchmarks.phase7_gemv [--out DIR] [--quick]
"""

import multiprocessing
import os
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase7_optim.kernels.fused import silu_and_mul
from phase7_optim.kernels.gemv import GemvConfig, counters_for, gemv, gemv_config_for

DEVICE, DTYPE, ELEMENT_BYTES = "cuda", torch.bfloat16, 2
LAYERS = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
          "down_proj": (1024, 3072)}  # fmt: skip
BATCHES = [1, 2, 4, 8]
L2_BYTES = 60 * 2**20  # the H200's, as torch reports it
PROGRAMS = (96, 1056)  # grids from ~0.7 to 8 programs per SM
SLICE_BYTES = (8 * 1024, 64 * 1024)
TOP = 5  # stage 1's best, timed again with PDL


def candidates(n: int, k: int) -> list[GemvConfig]:
    configs = []
    for block_n in (8, 16, 32, 64):
        for split_k in range(1, k // 64 + 1):
            block_k = k // split_k
            programs = triton.cdiv(n, block_n) * split_k
            slice_bytes = block_n * block_k * ELEMENT_BYTES
            if k % split_k or block_k != triton.next_power_of_2(block_k):
                continue
            if not (PROGRAMS[0] <= programs <= PROGRAMS[1]) or not (
                SLICE_BYTES[0] <= slice_bytes <= SLICE_BYTES[1]
            ):
                continue
            warps = (4,) if slice_bytes <= 16384 else (4, 8) if slice_bytes <= 32768 else (8,)
            for dot in (False, True) if block_n >= 16 else (False,):
                for w in warps:
                    configs.append(GemvConfig(block_n, block_k, split_k, w, 1, True, dot))
    return configs


def median_ms(fn) -> float:
    return do_bench(fn, warmup=5, rep=25, return_mode="median")


def graph_ms_per_call(calls) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay) / len(calls)


class Layer:
    """A layer's weight copies (together 4x the L2) and its inputs at `m` rows."""

    def __init__(self, n: int, k: int, m: int):
        self.n, self.k, self.m = n, k, m
        self.bytes = n * k * ELEMENT_BYTES
        copies = max(2, triton.cdiv(4 * L2_BYTES, self.bytes))
        self.weights = [
            torch.randn(n, k, device=DEVICE, dtype=DTYPE) * k**-0.5 for _ in range(copies)
        ]
        self.x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
        self.gate_up = torch.randn(m, 2 * k, device=DEVICE, dtype=DTYPE)
        self.counters = counters_for(n, self.x.device)

    def time(self, call) -> dict:
        try:
            us = graph_ms_per_call([lambda w=w: call(w) for w in self.weights]) * 1e3
        except Exception as err:  # a config the GPU rejects (shared memory, registers)
            return {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        return {"us": us, "GBps": self.bytes / (us * 1e-6) / 1e9}

    def gemv(self, config: GemvConfig | None) -> dict:
        return self.time(lambda w: gemv(self.x, w, self.counters, config))


def compile_chunk(jobs) -> int:
    """A pool worker: runs each (n, k, m, config, silu_mul) once, filling Triton's disk cache."""
    for n, k, m, config, silu_mul in jobs:
        x = torch.randn(m, 2 * k if silu_mul else k, device=DEVICE, dtype=DTYPE)
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE)
        try:
            gemv(x, w, counters_for(n, x.device), config, silu_mul=silu_mul)
        except Exception:  # timed (and reported) in the main process
            pass
    torch.cuda.synchronize()
    return len(jobs)


def precompile(jobs: list, processes: int) -> None:
    chunks = [jobs[i::processes] for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(compile_chunk, [c for c in chunks if c])


def all_jobs(batches) -> list:
    jobs = []
    for n, k in LAYERS.values():
        for m in batches:
            configs = candidates(n, k)
            jobs += [(n, k, m, c, False) for c in configs]
            jobs += [(n, k, m, replace(c, pdl=True), False) for c in configs]
            jobs += [(n, k, m, replace(gemv_config_for(m, n, k, 132), pdl=p), False)
                     for p in (False, True)]  # fmt: skip
            if (n, k) == LAYERS["down_proj"]:
                jobs += [(n, k, m, replace(c, pdl=True), True) for c in configs]
    return jobs


def sweep_cell(name: str, n: int, k: int, m: int, copy_gbps: float) -> dict:
    layer = Layer(n, k, m)
    pct = lambda r: {**r, "pct_of_copy": 100 * r["GBps"] / copy_gbps} if "GBps" in r else r  # noqa: E731
    row = {"layer": name, "N": n, "K": k, "rows": m}
    row["cublas"] = pct(layer.time(lambda w: F.linear(layer.x, w)))
    loop = gemv_config_for(m, n, k, torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    row["loop_kernel"] = {**asdict(loop), **pct(layer.gemv(loop))}
    row["loop_kernel_pdl"] = pct(layer.gemv(replace(loop, pdl=True)))
    stage1 = [{**asdict(c), **pct(layer.gemv(c))} for c in candidates(n, k)]
    timed = sorted((r for r in stage1 if "us" in r), key=lambda r: r["us"])
    stage2 = []
    for r in timed[:TOP]:
        config = GemvConfig(**{f: r[f] for f in GemvConfig.__dataclass_fields__})
        stage2.append({**asdict(config), "pdl": True, **pct(layer.gemv(replace(config, pdl=True)))})
        if name == "down_proj":  # SiLU-and-mul in the load vs its own kernel before the GEMV
            c = replace(config, pdl=True)
            fused = layer.time(lambda w, c=c: gemv(layer.gate_up, w, layer.counters, c, True))
            apart = layer.time(
                lambda w, c=c: gemv(silu_and_mul(layer.gate_up), w, layer.counters, c)
            )
            stage2[-1]["silu_mul_fused_us"] = fused.get("us")
            stage2[-1]["silu_mul_separate_us"] = apart.get("us")
    row["stage1"], row["stage2"] = stage1, stage2
    best = min((r for r in stage1 + stage2 if "us" in r), key=lambda r: r["us"])
    row["best"] = best
    print(f"{name} m={m}: cuBLAS {row['cublas'].get('us', 0):.2f} us, loop "
          f"{row['loop_kernel'].get('us', 0):.2f} (pdl {row['loop_kernel_pdl'].get('us', 0):.2f}),"
          f" best {best['us']:.2f} us {best['pct_of_copy']:.0f}% {best}", flush=True)  # fmt: skip
    return row


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.float16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def build_parser():
    parser = benchmark_parser(__doc__, threads=False)
    parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    return parser


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("phase7_gemv needs a CUDA GPU; nothing to measure here")
    batches = [1] if args.quick else BATCHES
    precompile(all_jobs(batches), args.processes)
    torch.manual_seed(0)
    results = {"triton": triton.__version__, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(), "quick": args.quick,
               "timing": "do_bench median, warmup 5 ms, rep 25 ms, L2 flushed; per call in a "
                         "CUDA graph of calls on separate weight copies"}  # fmt: skip
    results["copy_bandwidth_GBps"] = copy_bandwidth_gbps()
    results["sweep"] = []
    for name, (n, k) in LAYERS.items():
        for m in batches:
            results["sweep"].append(sweep_cell(name, n, k, m, results["copy_bandwidth_GBps"]))
            write_result("phase7_gemv", results, args.out)


if __name__ == "__main__":
    main()
