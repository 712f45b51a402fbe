"""Why batching pays, measured: one linear layer on the roofline, at batch 1 ... 1024.

A linear layer y = x @ W.T with x (B, K) and W (N, K) does 2*B*K*N FLOPs and moves at least
(K*N + B*K + B*N) elements: the weight once, the input and the output. Its arithmetic intensity
(FLOP per byte) grows with B, because every weight byte is reused by B tokens:

    intensity = 2*B*K*N / (bytes_per_element * (K*N + B*K + B*N))  ~  2*B / bytes_per_element

for B much smaller than K and N. A decode step (B = the number of running sequences) is therefore
memory-bound: the time to read the weights, whatever B is. The roofline model (Williams et al.,
2009) bounds achievable FLOP/s by min(peak FLOP/s, bandwidth * intensity); the two meet at the
ridge point, intensity = peak / bandwidth. Below the ridge, more sequences per step are free FLOPs.

This benchmark measures both roofs on the machine it runs on:
- copy bandwidth: `dst.copy_(src)` over a buffer much larger than the last-level cache, counted as
  read + write bytes;
- matmul peak: the best FLOP/s of a large square matmul, per dtype;
then times one linear layer per shape, dtype and batch, and reports intensity, achieved FLOP/s
and the fraction of the roofline reached. Shapes: a 4096 x 4096 layer, and Qwen3-0.6B's (hidden
1024, 16 query heads and 8 KV heads of head_dim 128, intermediate 3072, vocabulary 151936), with
q/k/v and gate/up fused as vLLM runs them.

Weights are cold: each measurement rotates over enough copies of W that together they exceed the
caches (ROTATION_BYTES), as a model's layers do in a real step. On CUDA one rotation is captured
in a CUDA graph (no launch overhead in the numbers) and timed with CUDA events; on CPU with
perf_counter. Every time is the median of several rotations.

Run: python -m benchmarks.roofline [--device cpu|cuda] [--quick] [--out DIR] [--threads 2]
Writes roofline_<device>.json (with machine, versions and commit) and .png (the plot) into DIR.
"""

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import (
    QWEN3_0_6B,
    benchmark_parser,
    parse_args,
    write_result,
)

# Qwen3-0.6B's linear layers, from its shapes
HIDDEN, INTERMEDIATE = QWEN3_0_6B["hidden_size"], QWEN3_0_6B["intermediate_size"]
Q_DIM = QWEN3_0_6B["num_attention_heads"] * QWEN3_0_6B["head_dim"]
KV_DIM = QWEN3_0_6B["num_key_value_heads"] * QWEN3_0_6B["head_dim"]
# (in_features K, out_features N) of each linear layer
SHAPES = {
    "square_4096": (4096, 4096),
    "qwen3_0.6b_qkv_proj": (HIDDEN, Q_DIM + 2 * KV_DIM),
    "qwen3_0.6b_o_proj": (Q_DIM, HIDDEN),
    "qwen3_0.6b_gate_up_proj": (HIDDEN, 2 * INTERMEDIATE),
    "qwen3_0.6b_down_proj": (INTERMEDIATE, HIDDEN),
    "qwen3_0.6b_lm_head": (HIDDEN, QWEN3_0_6B["vocab_size"]),
}
BATCHES = tuple(2**i for i in range(11))  # 1 ... 1024
QUICK_BATCHES = (1, 16, 256)
QUICK_SHAPES = ("square_4096", "qwen3_0.6b_gate_up_proj")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Weight copies rotated per measurement add up to at least this: far above a CPU's last-level
# cache (tens of MiB) and an H200's L2 (~60 MiB), so every matmul reads its weight from memory.
ROTATION_BYTES = 512 * 2**20
# ... but a rotation does at most this many FLOPs: past the ridge a layer is compute-bound and a
# warm cache changes little, while a CPU would spend minutes per point.
MAX_ROTATION_FLOP = {"cpu": 2e10, "cuda": 1e14}
COPY_BYTES = {"cpu": 512 * 2**20, "cuda": 4 * 2**30}  # bandwidth probe buffer
PEAK_SIZE = {"cpu": 2048, "cuda": 8192}  # square matmul for the compute roof
MIN_SECONDS = {"cpu": 0.3, "cuda": 0.05}  # keep timing rotations until this much has passed
MAX_ROTATIONS = 20
MIN_ROTATIONS = 3
LONG_SECONDS = 3.0


@dataclass(frozen=True)
class Point:
    shape: str
    in_features: int
    out_features: int
    dtype: str
    batch: int
    seconds: float
    weight_copies: int  # rotated per measurement

    @property
    def flop(self) -> int:
        return 2 * self.batch * self.in_features * self.out_features

    @property
    def bytes(self) -> int:
        K, N, B = self.in_features, self.out_features, self.batch
        return DTYPES[self.dtype].itemsize * (K * N + B * K + B * N)

    @property
    def intensity(self) -> float:
        return self.flop / self.bytes


def enough(times: list[float], min_seconds: float) -> bool:
    """Stop sampling rotations: MIN_ROTATIONS taking min_seconds, MAX_ROTATIONS, or one rotation
    alone so long (a big matmul on a CPU) that more samples would add nothing but minutes."""
    total = sum(times)
    return (
        len(times) >= MAX_ROTATIONS
        or (len(times) >= MIN_ROTATIONS and total >= min_seconds)
        or total >= LONG_SECONDS
    )


class Clock:
    """Times a list of zero-argument calls run back to back (one rotation), per call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.min_seconds = MIN_SECONDS[device.type]

    def per_call(self, calls: list) -> float:
        if self.device.type == "cuda":
            return self._cuda(calls)
        return self._cpu(calls)

    def _cpu(self, calls: list) -> float:
        calls[0]()  # warm-up: first-call setup (oneDNN primitives, allocations)
        times = []
        while not enough(times, self.min_seconds):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) / len(calls)

    def _cuda(self, calls: list) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS picks its kernels)
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        while not enough(times, self.min_seconds):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
        return statistics.median(times) / len(calls)


def copy_bandwidth(device: torch.device, clock: Clock) -> float:
    """Bytes per second of dst.copy_(src), counting the read and the write."""
    n = COPY_BYTES[device.type] // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = clock.per_call([lambda: dst.copy_(src)])
    return 2 * src.nbytes / seconds


def matmul_peak(device: torch.device, dtype: torch.dtype, clock: Clock) -> float:
    """FLOP/s of the best of a few large square matmuls."""
    n = PEAK_SIZE[device.type]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = min(clock.per_call([lambda: torch.mm(a, b, out=out)]) for _ in range(3))
    return 2 * n**3 / best


def time_linear(
    K: int, N: int, batch: int, dtype: torch.dtype, device: torch.device, clock: Clock
) -> tuple[float, int]:
    """(seconds of one y = x @ W.T, weight copies): W is cold, rotated over copies worth
    ROTATION_BYTES."""
    copies = math.ceil(ROTATION_BYTES / (K * N * dtype.itemsize))
    copies = max(1, min(copies, int(MAX_ROTATION_FLOP[device.type] // (2 * batch * K * N))))
    weights = [torch.randn(N, K, device=device).to(dtype) for _ in range(copies)]
    x = torch.randn(batch, K, device=device).to(dtype)
    y = torch.empty(batch, N, device=device, dtype=dtype)
    calls = [lambda w=w: torch.mm(x, w.t(), out=y) for w in weights]
    return clock.per_call(calls), copies


def flops(rate: float) -> str:
    return f"{rate / 1e12:.3g} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.3g} GFLOP/s"


def roofline(intensity: float, peak: float, bandwidth: float) -> float:
    return min(peak, bandwidth * intensity)


def plot(path: Path, points: list[Point], peaks: dict, bandwidth: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    markers = {"float32": "o", "bfloat16": "s"}
    colors = dict(zip(SHAPES, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    xs = [p.intensity for p in points]
    grid = [min(xs) / 2 * (max(xs) * 4 / min(xs)) ** (i / 200) for i in range(201)]
    for dtype, peak in peaks.items():
        ridge = peak / bandwidth
        ax.plot(grid, [roofline(x, peak, bandwidth) for x in grid], "k--", lw=1)
        ax.axvline(ridge, color="gray", ls=":", lw=1)
        ax.annotate(
            f"{dtype} ridge: {ridge:.0f} FLOP/B\npeak {flops(peak)}",
            (ridge, peak),
            textcoords="offset points",
            xytext=(6, -28),
            fontsize=8,
        )
    for shape in dict.fromkeys(p.shape for p in points):
        for dtype in dict.fromkeys(p.dtype for p in points):
            sel = [p for p in points if p.shape == shape and p.dtype == dtype]
            ax.plot(
                [p.intensity for p in sel],
                [p.flop / p.seconds for p in sel],
                marker=markers[dtype],
                color=colors[shape],
                lw=1,
                ms=4,
                label=f"{shape} {dtype}",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte); batch B = 1 ... 1024 left to right")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"{title}; copy bandwidth {bandwidth / 1e9:.3g} GB/s")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)  # --quick: QUICK_BATCHES and QUICK_SHAPES only
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device)
    return parser


def main():
    args = parse_args(build_parser())
    device = torch.device(args.device)
    clock = Clock(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on the GPU too
    bandwidth = copy_bandwidth(device, clock)
    peaks = {name: matmul_peak(device, dtype, clock) for name, dtype in DTYPES.items()}
    print(f"copy bandwidth {bandwidth / 1e9:.3g} GB/s")
    for name, peak in peaks.items():
        print(f"{name}: matmul peak {flops(peak)}, ridge {peak / bandwidth:.0f} FLOP/B")
    shapes = QUICK_SHAPES if args.quick else tuple(SHAPES)
    batches = QUICK_BATCHES if args.quick else BATCHES
    points = []
    for shape in shapes:
        K, N = SHAPES[shape]
        for name, dtype in DTYPES.items():
            for batch in batches:
                seconds, copies = time_linear(K, N, batch, dtype, device, clock)
                point = Point(shape, K, N, name, batch, seconds, copies)
                points.append(point)
                roof = roofline(point.intensity, peaks[name], bandwidth)
                print(
                    f"{shape:24s} {name:8s} B={batch:5d} AI={point.intensity:7.1f} FLOP/B "
                    f"{point.flop / seconds / 1e9:9.1f} GFLOP/s ({point.flop / seconds / roof:.0%}"
                    " of roofline)",
                    flush=True,
                )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    path = write_result(
        f"roofline_{device.type}",
        {
            "device": device_name,
            "load_average_1_5_15_min": os.getloadavg() if device.type == "cpu" else None,
            "quick": args.quick,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "matmul_peak_flop_per_s": peaks,
            "ridge_flop_per_byte": {name: peak / bandwidth for name, peak in peaks.items()},
            "rotation_bytes": ROTATION_BYTES,
            "max_rotation_flop": MAX_ROTATION_FLOP[device.type],
            "shapes": {
                s: {"in_features": SHAPES[s][0], "out_features": SHAPES[s][1]} for s in shapes
            },
            "points": [
                {
                    "shape": p.shape,
                    "dtype": p.dtype,
                    "batch": p.batch,
                    "weight_copies": p.weight_copies,
                    "seconds": p.seconds,
                    "flop": p.flop,
                    "bytes": p.bytes,
                    "flop_per_byte": p.intensity,
                    "flop_per_s": p.flop / p.seconds,
                    "bytes_per_s": p.bytes / p.seconds,
                    "fraction_of_roofline": p.flop
                    / p.seconds
                    / roofline(p.intensity, peaks[p.dtype], bandwidth),
                }
                for p in points
            ],
        },
        out=args.out,
    )
    png = path.with_suffix(".png")
    plot(png, points, peaks, bandwidth, f"One linear layer on {device_name}")
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
