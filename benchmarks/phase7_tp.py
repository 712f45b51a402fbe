"""Phase 7 tensor parallelism: throughput, memory and all-reduce cost at TP = 1, 2, 4, 8.

Each run is one model shape at one tensor-parallel size, in its own process (so GPU memory and
the process group start clean), with `load_format="dummy"` weights (random, built on each rank's
shard: a 70B-parameter shape needs no checkpoint) in bf16:
- throughput: a slice of workload W (benchmarks/README.md: nano-vllm's bench.py, seed 0,
  temperature 0.6, ignore_eos), output tok/s including prefill;
- single stream: one 512-token prompt, 256 new tokens, ms per output token after the first
  (the prompt's prefill, timed alone, subtracted), against its byte floor: the bytes one decode
  step reads on a rank (every layer's weights, the LM head, one embedding row, the context's KV)
  over a device-to-device copy's bandwidth measured in the same process;
- decode step: B sequences of 16-token prompts decoding 64 tokens together, ms per step;
- all-reduce share of that decode step: before the engine starts, the same ranks time the
  collectives one decode step of batch B makes (2 all-reduces of (B, hidden) per layer, one for
  the embedding, one all-gather of the logits), replayed from a CUDA graph as the engine's decode
  steps are (eagerly with --enforce-eager), and divide by the step time;
- per-GPU memory (nvidia-smi, with the engine loaded), KV blocks per GPU and weight bytes per GPU.
The KV cache takes what is left of `GPU_MEMORY_UTILIZATION` of each GPU after the weights and a
fixed reserve for activations and CUDA graphs (vLLM sizes it the same way, by profiling).

Writes phase7_tp.json and phase7_tp.png into --out (phase7_tp_quick.* with --quick), rewritten
after every run so that a run cut short keeps the ones that finished.
Run (GPU): python -m benchmarks.phase7_tp [--runs qwen3-0.6b:1,2 llama3-70b:2@64] [--out DIR]
Qwen3-8B with decode attention's early loads (off at its width by default), TP=1:
--runs qwen3-8b:1@64 --early-loads-max-width 4096
Issue 13 on 8 GPUs: --runs qwen3-8b:1,2,4,8@128 llama3-70b:2,4,8@64
CPU smoke run (tiny model, gloo): python -m benchmarks.phase7_tp --quick
"""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import (
    QWEN3_0_6B,
    Timer,
    benchmark_parser,
    parse_args,
    workload_w,
    write_result,
)

MODELS = {  # config.json of each shape (random weights: the values do not matter)
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False, max_position_embeddings=40960,
                     rope_theta=1e6, rms_norm_eps=1e-6),
    "llama3-70b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                       hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=False, max_position_embeddings=8192,
                       rope_theta=5e5, rms_norm_eps=1e-5),
    "tiny": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                 hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=True, max_position_embeddings=2048,
                 rope_theta=1e6, rms_norm_eps=1e-6),
}  # fmt: skip
DEFAULT_RUNS = ["qwen3-0.6b:1,2", "llama3-70b:2@64"]  # issue 10's run on 2 GPUs
QUICK_RUNS = ["tiny:1,2@8"]
TEMPERATURE = 0.6  # workload W's
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each GPU
RESERVE_BYTES = 8 << 30  # activations, logits, CUDA graph pool, NCCL buffers
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 4096
DECODE_BATCH, DECODE_PROMPT, DECODE_STEPS = 64, 16, 64
SINGLE_PROMPT, SINGLE_TOKENS = 512, 256
QUICK = dict(max_output=16, max_prompt=128, decode_batch=4, decode_steps=8, single_tokens=8)
RUN_TIMEOUT_S = 240  # a hung run (a deadlocked collective) must not eat the whole GPU lease
TIMED_OUT = "timed out"
COLLECTIVE_REPEATS = 20
COPY_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    tp: int
    requests: int  # the first `requests` of workload W
    quick: bool
    enforce_eager: bool
    # decode attention's early loads up to this attention-output width (kernels/paged_decode.py's
    # EARLY_LOADS_MAX_WIDTH) instead of the default: an A/B of that rule in one call, TP=1 only
    early_loads_max_width: int | None = None


def parse_runs(
    specs: list[str], requests: int, quick: bool, eager: bool, early_width: int | None = None
) -> list[Run]:
    """'MODEL:TP[,TP...][@REQUESTS]' -> one Run per TP size."""
    runs = []
    for spec in specs:
        model, _, rest = spec.partition(":")
        sizes, _, n = rest.partition("@")
        if model not in MODELS or not sizes:
            raise SystemExit(
                f"--runs {spec!r}: expected MODEL:TP[,TP...][@N], MODEL in {list(MODELS)}"
            )
        runs += [Run(model, int(tp), int(n or requests), quick, eager, early_width)
                 for tp in sizes.split(",")]  # fmt: skip
    if early_width is not None and any(r.tp > 1 for r in runs):
        raise SystemExit("--early-loads-max-width is set in the driver only: TP=1 runs only")
    return runs


def write_checkpoint(directory: Path, model: str) -> Path:
    """config.json and the Qwen3 tokenizer files: all a dummy-weight engine reads."""
    from tests.assets import qwen3_tokenizer_dir

    (directory / "config.json").write_text(json.dumps(MODELS[model]))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir() / name, directory / name)
    return directory


def weight_bytes_per_rank(hf: dict, tp: int, dtype_bytes: int = 2) -> int:
    h, i, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    kv_rank = kv // tp if hf["num_key_value_heads"] >= tp else hf["head_dim"]  # replicas
    per_layer = h * (q // tp + 2 * kv_rank) + (q // tp) * h + 3 * h * (i // tp) + 2 * h
    tables = (1 if hf["tie_word_embeddings"] else 2) * hf["vocab_size"] // tp * h
    return (layers * per_layer + tables + h) * dtype_bytes


def decode_bytes_per_rank(hf: dict, tp: int, context: float, dtype_bytes: int = 2) -> float:
    """What one decode step of one sequence reads on a rank: the weights, except that an untied
    embedding table gives one row (the LM head is read whole), and `context` tokens of KV."""
    embedding = 0 if hf["tie_word_embeddings"] else hf["vocab_size"] // tp * hf["hidden_size"]
    kv_per_token = kv_block_bytes_per_rank(hf, tp, dtype_bytes) / BLOCK_SIZE
    weights = weight_bytes_per_rank(hf, tp, dtype_bytes) - embedding * dtype_bytes
    return weights + context * kv_per_token


def copy_bandwidth() -> float | None:
    """Bytes per second of a 2 GiB device-to-device copy (read + write) on this GPU, now."""
    if not torch.cuda.is_available():
        return None
    from triton.testing import do_bench

    def copy_ms() -> float:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return do_bench(lambda: dst.copy_(src))

    ms = copy_ms()
    torch.cuda.empty_cache()  # its 4 GiB back to the GPU before the KV cache is sized
    return 2 * COPY_BYTES / (ms * 1e-3)


def kv_block_bytes_per_rank(hf: dict, tp: int, dtype_bytes: int = 2) -> int:
    kv_heads = max(1, hf["num_key_value_heads"] // tp)
    return 2 * hf["num_hidden_layers"] * BLOCK_SIZE * kv_heads * hf["head_dim"] * dtype_bytes


def num_kv_blocks(hf: dict, tp: int, device: torch.device) -> int:
    """The blocks every rank can hold (ranks are alike here: the minimum is any rank's)."""
    if device.type != "cuda":
        return 2048
    total = torch.cuda.get_device_properties(0).total_memory * GPU_MEMORY_UTILIZATION
    free = total - weight_bytes_per_rank(hf, tp) - RESERVE_BYTES
    return int(free // kv_block_bytes_per_rank(hf, tp))


# ---- Collectives of one decode step, timed on the same ranks -----------------------------------


def _time_collectives(rank: int, tp: int, port: int, shapes: dict, out: str) -> None:
    import torch.distributed as dist

    from phase7_optim.distributed import TensorParallel, init_process_group, rank_device

    cuda = torch.cuda.is_available()
    device = rank_device(torch.device("cuda" if cuda else "cpu"), rank)
    init_process_group(TensorParallel(rank, tp), device, port)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(shapes["batch"], shapes["hidden"], dtype=dtype, device=device)
    logits = torch.randn(shapes["batch"], shapes["vocab"] // tp, dtype=dtype, device=device)
    gathered = [torch.empty_like(logits) for _ in range(tp)]

    def step():  # what one decode step of the model communicates
        for _ in range(shapes["all_reduces"]):
            dist.all_reduce(x)
        dist.all_gather(gathered, logits)

    graph = None
    if cuda and shapes["cuda_graphs"]:  # as the engine's decode steps run them: no launch gaps
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    replay = graph.replay if graph is not None else step
    for _ in range(3):
        replay()
    with Timer() as t:
        for _ in range(COLLECTIVE_REPEATS):
            replay()
    if rank == 0:
        Path(out).write_text(json.dumps({"ms": 1e3 * t.seconds / COLLECTIVE_REPEATS}))
    del graph, replay  # captured NCCL work goes before the process group does
    dist.destroy_process_group()


def collective_ms(tp: int, hf: dict, batch: int, cuda_graphs: bool) -> float | None:
    if tp == 1:
        return None
    import torch.multiprocessing as mp

    from phase7_optim.distributed import free_port

    shapes = dict(batch=batch, hidden=hf["hidden_size"], vocab=hf["vocab_size"],
                  all_reduces=2 * hf["num_hidden_layers"] + 1, cuda_graphs=cuda_graphs)  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_time_collectives, args=(tp, free_port(), shapes, f.name), nprocs=tp)
        return json.loads(Path(f.name).read_text())["ms"]


# ---- One run, in its own process ---------------------------------------------------------------


def gpu_memory_used_mib() -> list[int]:
    if not torch.cuda.is_available():
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return [int(v) for v in out.stdout.split()]


def timed_generate(llm, prompts, params) -> tuple[float, int]:
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return t.seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def run_one(run: Run) -> dict:
    from phase7_optim import LLM, SamplingParams
    from phase7_optim.kernels import paged_decode

    if run.early_loads_max_width is not None:  # this process is the run's: no need to restore
        paged_decode.EARLY_LOADS_MAX_WIDTH = run.early_loads_max_width

    q = QUICK if run.quick else {}
    hf = MODELS[run.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workload = workload_w()[: run.requests]
    max_out, max_prompt = q.get("max_output", 1024), q.get("max_prompt", 1024)
    prompts = [r.prompt_ids[:max_prompt] for r in workload]
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=min(r.max_tokens, max_out),
                             ignore_eos=True, seed=i) for i, r in enumerate(workload)]  # fmt: skip
    batch = q.get("decode_batch", DECODE_BATCH)
    comm_ms = collective_ms(run.tp, hf, batch, not run.enforce_eager)  # the GPUs are idle yet
    bandwidth = copy_bandwidth()
    blocks = num_kv_blocks(hf, run.tp, device)
    max_seqs = min(MAX_NUM_SEQS, max(run.requests, batch))  # fewer CUDA graphs to capture
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        llm = LLM(write_checkpoint(Path(tmp), run.model), dtype="bfloat16" if device.type ==
                  "cuda" else "float32", load_format="dummy", tensor_parallel_size=run.tp,
                  num_kv_blocks=blocks, block_size=BLOCK_SIZE, max_num_seqs=max_seqs,
                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                  enforce_eager=run.enforce_eager)  # fmt: skip
        startup_s = time.perf_counter() - start
        try:
            timed_generate(llm, prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)
            seconds, tokens = timed_generate(llm, prompts, params)
            memory = gpu_memory_used_mib()  # the engine loaded, its KV cache allocated
            steps = q.get("decode_steps", DECODE_STEPS)
            decode = SamplingParams(temperature=TEMPERATURE, max_tokens=steps, ignore_eos=True)
            decode_s, _ = timed_generate(llm, [[7] * DECODE_PROMPT] * batch, decode)
            single_n = q.get("single_tokens", SINGLE_TOKENS)
            single = SamplingParams(temperature=TEMPERATURE, max_tokens=single_n, ignore_eos=True)
            first = SamplingParams(temperature=TEMPERATURE, max_tokens=1, ignore_eos=True)
            single_prompt = [list(range(1, SINGLE_PROMPT + 1))]
            prefill_s, _ = timed_generate(llm, single_prompt, first)
            single_s, _ = timed_generate(llm, single_prompt, single)
        finally:
            llm.shutdown()
    step_ms = 1e3 * decode_s / steps  # prefill of B * 16 tokens included: one step of ~64
    single_ms = 1e3 * (single_s - prefill_s) / (single_n - 1)
    mean_context = SINGLE_PROMPT + single_n / 2
    floor_ms = (
        1e3 * decode_bytes_per_rank(hf, run.tp, mean_context) / bandwidth if bandwidth else None
    )
    return {
        **dataclasses.asdict(run),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "single_stream_ms_per_token": single_ms,
        "single_stream_prefill_ms": 1e3 * prefill_s,
        "single_stream_floor_ms_per_token": floor_ms,
        "single_stream_fraction_of_floor": floor_ms / single_ms if floor_ms else None,
        "copy_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None,
        "decode_batch": batch,
        "decode_step_ms": step_ms,
        "collectives_ms_per_decode_step": comm_ms,
        "all_reduce_share_of_decode_step": comm_ms / step_ms if comm_ms is not None else 0.0,
        "kv_blocks_per_gpu": blocks,
        "kv_cache_gib_per_gpu": blocks * kv_block_bytes_per_rank(hf, run.tp) / 2**30,
        "weights_gib_per_gpu": weight_bytes_per_rank(hf, run.tp) / 2**30,
        "gpu_memory_used_mib": memory,
        "startup_s": startup_s,
    }


# ---- The driver ----------------------------------------------------------------------------------


def run_in_subprocess(run: Run, timeout_s: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        spec = json.dumps(dataclasses.asdict(run))
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.phase7_tp",
            "--single",
            spec,
            "--single-out",
            f.name,
        ]
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {**dataclasses.asdict(run), "error": f"{TIMED_OUT} after {timeout_s} s"}
        if proc.returncode != 0:
            return {**dataclasses.asdict(run), "error": proc.stderr[-3000:]}
        return json.loads(Path(f.name).read_text())


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    labels = [f"{r['model']}\nTP={r['tp']}" for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("output_tok_s", "output tok/s (slice of W)"),
              ("single_stream_ms_per_token", "single stream, ms/token"),
              ("all_reduce_share_of_decode_step", "all-reduce share of a decode step"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels, strict=True):
        bars = ax.bar(labels, [r[key] for r in ok], color="tab:blue")
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("phase 7 tensor parallelism (dummy bf16 weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, threads=False)  # --quick: tiny model, short outputs, CPU
    parser.add_argument("--runs", nargs="+", default=None, help="MODEL:TP[,TP...][@REQUESTS]")
    parser.add_argument("--requests", type=int, default=256, help="W's requests, if no @N")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--timeout", type=int, default=RUN_TIMEOUT_S, help="seconds per run")
    parser.add_argument(
        "--early-loads-max-width", type=int, default=None, metavar="N",
        help="decode attention loads its first keys before its wait up to this many query heads "
        "x head_dim (default: the engine's rule); TP=1 runs only",
    )  # fmt: skip
    parser.add_argument("--single", help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--single-out", help=argparse.SUPPRESS)
    return parser


def main():
    args = parse_args(build_parser())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    if args.single:
        result = run_one(Run(**json.loads(args.single)))
        Path(args.single_out).write_text(json.dumps(result))
        return
    specs = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    name = "phase7_tp_quick" if args.quick else "phase7_tp"
    runs = parse_runs(specs, args.requests, args.quick, args.enforce_eager,
                      args.early_loads_max_width)  # fmt: skip
    run_all(runs, args.timeout, args.out, name)


def run_all(runs: list[Run], timeout_s: int, out: Path, name: str) -> None:
    """Each run in its own process; the JSON and PNG are rewritten after every run, so a lease
    that ends mid-way still leaves the runs that finished."""
    results = []
    for run in runs:
        r = run_in_subprocess(run, timeout_s)
        failed = "error" in r and not r["error"].startswith(TIMED_OUT)  # too slow: no retry
        if failed and not run.enforce_eager:  # numbers without CUDA graphs beat none
            print(f"{run.model} TP={run.tp} failed; again with enforce_eager:\n{r['error'][-800:]}")
            graphs_error = r["error"]
            r = run_in_subprocess(dataclasses.replace(run, enforce_eager=True), timeout_s)
            r["error_with_cuda_graphs"] = graphs_error
        results.append(r)
        summary = r.get("error", "")[-300:] or (
            f"{r['output_tok_s']:9.0f} tok/s  single {r['single_stream_ms_per_token']:.2f} ms/tok  "
            f"(floor {r['single_stream_floor_ms_per_token'] or float('nan'):.2f})  "
            f"all-reduce {100 * r['all_reduce_share_of_decode_step']:.0f}% of a "
            f"{r['decode_step_ms']:.1f} ms step  KV blocks/GPU {r['kv_blocks_per_gpu']}  "
            f"GPU MiB {r['gpu_memory_used_mib']}"
        )
        print(f"{run.model:>11} TP={run.tp}: {summary}", flush=True)
        payload = {
            "runs": results,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "reserve_gib": RESERVE_BYTES / 2**30,
            "gpus": torch.cuda.device_count(),
        }
        path = write_result(name, payload, out)
        plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
