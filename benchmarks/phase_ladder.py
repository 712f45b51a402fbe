"""The phase ladder: every phase runs one seeded workload; output tok/s per phase, one chart.

Each phase is an optimization of the one before, so one workload through all of them is the
whole tutorial in one picture. Everything but the phase is held fixed:
- the weights: one seeded TinyTransformer (phase 0 builds it). Phases 1-5 load its state dict;
  phases 6-8 load the same tensors from a Llama checkpoint written here (config.json +
  model.safetensors: TinyTransformer is Llama's architecture with Hugging Face's key names, under
  `model.`), with the real Qwen3 tokenizer files beside it (prompts are token ids; the tokenizer
  only detokenizes the outputs);
- the requests: `seeded_workload` (harness.py), greedy, EOS never ends one (phases 1-3 get no
  EOS id, phases 4-8 `ignore_eos`), so every phase emits exactly the requested tokens;
- the KV memory: `kv_slots` token slots per layer. Phase 3 cuts the requests, in arrival order,
  into static batches whose cache (rows x (longest prompt + longest output)) fits in it; phase 4
  reserves prompt + max_tokens contiguous slots per running request; phases 5-8 take
  `block_size`-token blocks on demand (prefix caching off: the prompts share nothing, and a
  repeated run must not find the previous run's blocks). Engines (4-8) share max_num_seqs and
  the token budget.
How each phase runs the requests: 1-2 one at a time, the whole sequence re-run per token
(`generate`); 3 static batches with a KV cache (`generate_batch`); 4-5 `LLM(model)`; 6-8
`LLM(checkpoint)`.
Throughput = output tokens / wall time, prefill included, the best of `repeats` runs (other jobs
on a shared machine only ever slow a run down); loading the model and a warm-up are not timed.
Phases 1-2 are O(n^2) and serve one request at a time, so they run once, on the first
`naive_requests` requests only (the workload is seeded-random, so that is a random sample), and
report those requests' tokens over their time; the JSON says so.
Before timing, every phase decodes the same short prompts greedily (this is also the warm-up);
the JSON records whether each matches the first phase run, and that reference's smallest
top-1/top-2 logit margin in phase 0's model, so a real difference can be told from a near-tie.
A phase that fails to import (a phase still being built) is skipped and the error recorded.

`--device cuda`: phases 6-8 on workload W (benchmarks/README.md; nano-vllm's bench.py) with
Qwen3-0.6B shapes, random bf16 weights (benchmarks/phase6_qwen3_gpu.py's checkpoint) and W's
temperature 0.6; phases 1-5 only run TinyTransformer. The token budget is phase 6's GPU
benchmark's, 512, for all three: the readable attention (phase 6's, on the GPU) gathers contexts
into tensors that grow with it.

Run: python -m benchmarks.phase_ladder [--phases 1 2 ...] [--device cuda] [--quick] [--threads 2]
     [--out DIR]   (phase_ladder_<device>.json and .png, phase_ladder_<device>_quick.* for a
                   --quick run, so it never overwrites a full one; `--out benchmarks/results`
                   publishes)
"""

import os

# libgomp reads this once, when torch loads it, so it is set before `import torch`. Its default,
# spinning at every barrier, made 2 threads 30-100x slower here when other jobs held the 2 cores
# (measured: phase 4 on the --quick workload, 6.8 tok/s spinning vs 731 passive, load ~10).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    W_TEMPERATURE,
    Request,
    Timer,
    benchmark_parser,
    parse_args,
    seeded_workload,
    workload_w,
    write_result,
)
from benchmarks.phase5_paged import MODEL  # noqa: E402  (phase 5's model: a TinyTransformer config)

PHASES = {
    1: "phase1_naive",
    2: "phase2_sampling",
    3: "phase3_kvcache",
    4: "phase4_scheduler",
    5: "phase5_paged",
    6: "phase6_qwen3",
    7: "phase7_optim",
    8: "phase8_serving",
}
CHECKPOINT_PHASES = (6, 7, 8)  # LLM(path to a Hugging Face checkpoint)
WEIGHT_SEED = 0
CHECK_PROMPTS, CHECK_PROMPT_LEN, CHECK_TOKENS = 2, 16, 16  # the equivalence check's greedy decode
# Phases 5-8: the requests share no prefix, and with the cache on a repeated run would find the
# previous run's blocks and skip its prefill.
ENABLE_PREFIX_CACHING = False


@dataclass(frozen=True)
class Setup:
    """What one ladder run holds fixed across phases."""

    description: str
    workload: list[Request]
    naive_requests: int  # how many of the workload's requests phases 1-2 run
    kv_slots: int  # KV cache capacity per layer, in tokens, for phases 3-8
    block_size: int  # phases 5-8
    max_num_seqs: int  # phases 4-8
    max_num_batched_tokens: int  # phases 4-8
    temperature: float  # of the timed run; the equivalence check is always greedy
    repeats: int  # timed runs per phase (phases 1-2: one); the fastest is reported


def cpu_setup(quick: bool) -> Setup:
    n, prompt_len, output_len, naive = (
        (8, (16, 64), (8, 32), 2) if quick else (32, (16, 256), (16, 128), 6)
    )
    workload = seeded_workload(0, n, prompt_len, output_len, MODEL["vocab_size"])
    return Setup(
        description=f"seeded_workload(0, {n}, {prompt_len}, {output_len}, "
        f"{MODEL['vocab_size']}), greedy, no EOS; phases 1-2: first {naive} requests",
        workload=workload,
        naive_requests=naive,
        kv_slots=1024 if quick else 4096,
        block_size=16,
        max_num_seqs=n,
        max_num_batched_tokens=512,
        temperature=0.0,
        repeats=1 if quick else 3,
    )


def gpu_setup(quick: bool) -> Setup:
    n, cap = (16, 64) if quick else (256, None)
    workload = [
        Request(r.prompt_ids, min(r.max_tokens, cap or r.max_tokens)) for r in workload_w()[:n]
    ]
    return Setup(
        description=f"first {n} requests of workload W"
        + (f", outputs capped at {cap}" if cap else "")
        + f", temperature {W_TEMPERATURE}, ignore_eos",
        workload=workload,
        naive_requests=0,
        kv_slots=327_680,  # 20,480 blocks: all of W at once (276,793 tokens), 37.6 GB in bf16
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        temperature=W_TEMPERATURE,
        repeats=1,
    )


# A runner decodes requests with one phase: (requests, temperature) -> output token ids.
Runner = Callable[[list[Request], float], list[list[int]]]


def tiny_model(mod, state: dict):
    model = mod.TinyTransformer(mod.ModelConfig(**MODEL)).eval()
    model.load_state_dict(state)
    return model


def naive_runner(phase: int, mod, state: dict) -> Runner:
    model = tiny_model(mod, state)

    def run(requests: list[Request], temperature: float) -> list[list[int]]:
        if phase == 1:  # argmax only: phase 1 has no sampler
            return [mod.generate(model, r.prompt_ids, r.max_tokens) for r in requests]
        return [
            mod.generate(
                model, r.prompt_ids, mod.SamplingParams(temperature, max_tokens=r.max_tokens)
            )
            for r in requests
        ]

    return run


def static_batches(requests: list[Request], kv_slots: int) -> list[list[Request]]:
    """Requests in arrival order, cut where the next one would overflow the batch's KV cache."""
    batches: list[list[Request]] = [[]]
    for r in requests:
        trial = batches[-1] + [r]
        rows, columns = len(trial), max(len(x.prompt_ids) for x in trial)
        columns += max(x.max_tokens for x in trial)  # phase 3's cache: (rows, longest + max_new)
        if rows * columns > kv_slots and batches[-1]:
            batches.append([r])
        else:
            batches[-1] = trial
    return batches


def static_batch_runner(mod, state: dict, setup: Setup) -> Runner:
    model = tiny_model(mod, state)

    def run(requests: list[Request], temperature: float) -> list[list[int]]:
        outputs = []
        for batch in static_batches(requests, setup.kv_slots):
            params = [mod.SamplingParams(temperature, max_tokens=r.max_tokens) for r in batch]
            outputs += mod.generate_batch(model, [r.prompt_ids for r in batch], params).token_ids
        return outputs

    return run


def engine_runner(mod, llm) -> Runner:
    def run(requests: list[Request], temperature: float) -> list[list[int]]:
        params = [
            mod.SamplingParams(temperature, max_tokens=r.max_tokens, ignore_eos=True)
            for r in requests
        ]
        outs = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return run


def make_runner(phase: int, mod, setup: Setup, state: dict, checkpoint: Path, device: str):
    engine = {
        "max_num_seqs": setup.max_num_seqs,
        "max_num_batched_tokens": setup.max_num_batched_tokens,
    }
    paged = {
        "num_kv_blocks": setup.kv_slots // setup.block_size,
        "block_size": setup.block_size,
        "enable_prefix_caching": ENABLE_PREFIX_CACHING,
        **engine,
    }
    if phase in (1, 2):
        return naive_runner(phase, mod, state)
    if phase == 3:
        return static_batch_runner(mod, state, setup)
    if phase == 4:
        return engine_runner(
            mod, mod.LLM(tiny_model(mod, state), num_kv_slots=setup.kv_slots, **engine)
        )
    if phase == 5:
        return engine_runner(mod, mod.LLM(tiny_model(mod, state), **paged))
    return engine_runner(mod, mod.LLM(str(checkpoint), device=device, **paged))


def save_llama_checkpoint(model, directory: Path, tokenizer_dir: Path) -> Path:
    """A TinyTransformer as a Hugging Face Llama checkpoint (same keys, under `model.`)."""
    state = model.state_dict()
    tensors = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    c = model.config
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    return directory


def check_margin(state: dict, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Smallest top-1/top-2 logit gap along the reference's greedy path, in phase 0's model."""
    import phase0_basics

    model = tiny_model(phase0_basics, state)
    margins = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1]  # (T_out, V)
            top2 = logits.topk(2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).min().item())
    return min(margins)


def first_difference(ours: list[list[int]], reference: list[list[int]]) -> dict | None:
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        if a != b:
            at = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            return {"prompt": i, "token": at}
    return None


def measure(runner: Runner, setup: Setup, phase: int) -> dict:
    requests = setup.workload[: setup.naive_requests] if phase in (1, 2) else setup.workload
    with Timer() as t:
        outputs = runner(requests, setup.temperature)
    tokens = sum(len(o) for o in outputs)
    expected = sum(r.max_tokens for r in requests)
    if tokens != expected:  # EOS is off: anything else means a request ended early
        raise RuntimeError(f"phase {phase} produced {tokens} output tokens, expected {expected}")
    result = {
        "requests": len(requests),
        "output_tokens": tokens,
        "seconds": t.seconds,
        "tok_s": tokens / t.seconds,
    }
    if phase == 3:
        result["static_batches"] = len(static_batches(requests, setup.kv_slots))
    return result


def load_phase(phase: int):
    """The phase's package, or the reason it cannot be imported (a phase still being built)."""
    try:
        return importlib.import_module(PHASES[phase]), None
    except Exception as e:  # any import failure skips the phase; the JSON says why
        return None, f"{type(e).__name__}: {e}"


def prepare_weights(phases: list[int], directory: Path, gpu: bool):
    """(TinyTransformer state dict or None, checkpoint directory for phases 6-8 or None)."""
    from tests.assets import qwen3_tokenizer_dir

    if gpu:
        from benchmarks.phase6_qwen3_gpu import save_checkpoint

        return None, save_checkpoint(directory, qwen3_tokenizer_dir())
    import phase0_basics

    torch.manual_seed(WEIGHT_SEED)
    model = phase0_basics.TinyTransformer(phase0_basics.ModelConfig(**MODEL))
    if not any(p in CHECKPOINT_PHASES for p in phases):
        return model.state_dict(), None
    return model.state_dict(), save_llama_checkpoint(model, directory, qwen3_tokenizer_dir())


def run_ladder(args, setup: Setup, name: str) -> dict:
    gpu = args.device == "cuda"
    check = [
        Request(r.prompt_ids[:CHECK_PROMPT_LEN], CHECK_TOKENS)
        for r in setup.workload[:CHECK_PROMPTS]
    ]
    result = {
        "setup": {
            "workload": setup.description,
            "requests": len(setup.workload),
            "prompt_tokens": sum(len(r.prompt_ids) for r in setup.workload),
            "output_tokens": sum(r.max_tokens for r in setup.workload),
            "naive_requests": setup.naive_requests,
            "kv_slots": setup.kv_slots,
            "block_size": setup.block_size,
            "max_num_seqs": setup.max_num_seqs,
            "max_num_batched_tokens": setup.max_num_batched_tokens,
            "enable_prefix_caching": ENABLE_PREFIX_CACHING,
            "temperature": setup.temperature,
            "repeats": setup.repeats,
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
        },
        "quick": args.quick,
        "model": "random Qwen3-0.6B shapes, bf16" if gpu else {**MODEL, "seed": WEIGHT_SEED},
        "check": {"prompts": len(check), "prompt_len": CHECK_PROMPT_LEN, "tokens": CHECK_TOKENS},
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "load_average_before": os.getloadavg(),
        "phases": {},
    }
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        state, checkpoint = prepare_weights(args.phases, Path(tmp), gpu)
        for phase in args.phases:
            entry = {"name": PHASES[phase]}
            mod, error = load_phase(phase)
            if mod is None:
                entry["skipped"] = error
                print(f"phase {phase}: skipped ({error})")
            else:
                entry.update(
                    run_phase(phase, mod, setup, state, checkpoint, args.device, check, reference)
                )
                outputs = entry.pop("check_outputs")
                reference = reference or (phase, outputs)
            result["phases"][str(phase)] = entry
            result["load_average_after"] = os.getloadavg()
            write_result(name, result, args.out)  # after every phase: a crash keeps the rest
    if reference is not None and state is not None:
        margin = check_margin(state, [r.prompt_ids for r in check], reference[1])
        result["check"]["reference_phase"] = reference[0]
        result["check"]["reference_min_top2_margin"] = margin
    result["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result["uncommitted_changes"] = uncommitted_changes()
    return result


def uncommitted_changes() -> list[str]:
    """Tracked files that differ from the recorded commit: the numbers are of this tree, not it."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return []  # a copy without .git (the GPU box): its commit is told, not checked
    return [line[3:] for line in out.stdout.splitlines()]


def run_phase(phase, mod, setup, state, checkpoint, device, check, reference) -> dict:
    runner = make_runner(phase, mod, setup, state, checkpoint, device)
    outputs = runner(check, 0.0)  # greedy; also the warm-up
    entry: dict = {"check_outputs": outputs}
    if reference is not None:
        diff = first_difference(outputs, reference[1])
        entry["same_check_tokens_as_phase"] = {"phase": reference[0], "same": diff is None}
        if diff is not None:
            entry["first_difference"] = diff
            print(f"phase {phase}: check tokens differ from phase {reference[0]}'s at {diff}")
    # Best of `repeats` runs: other jobs on a shared machine only ever slow a run down. Phases 1-2
    # run once: their minutes would double for a number ten times below the rest.
    runs = [measure(runner, setup, phase) for _ in range(1 if phase in (1, 2) else setup.repeats)]
    entry.update(min(runs, key=lambda r: r["seconds"]))
    entry["all_runs_seconds"] = [r["seconds"] for r in runs]
    if phase in (1, 2):
        entry["subset"] = (
            f"first {setup.naive_requests} of {len(setup.workload)} requests, served one at a "
            "time: the whole workload's tok/s is the same ratio in expectation"
        )
    print(
        f"phase {phase}: {entry['tok_s']:9.1f} output tok/s ({entry['output_tokens']} tokens, "
        f"{entry['requests']} requests, best of {len(runs)}: {entry['seconds']:.1f} s)"
    )
    del runner
    gc.collect()  # phases 6-8 each hold a GPU-sized KV cache: free it before the next phase
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return entry


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["phases"]
    labels = [f"{p}\n{e['name'].split('_', 1)[1]}" for p, e in phases.items()]
    values = [e.get("tok_s", 0.0) for e in phases.values()]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(labels) + 1.5), 4.2))
    measured = [v for v in values if v > 0] or [1.0]
    # Log bars need a floor: the power of ten below the slowest phase.
    floor = 10.0 ** math.floor(math.log10(min(measured)))
    bars = ax.bar(labels, values, color="tab:blue")
    for bar, entry in zip(bars, phases.values(), strict=True):
        text = "skipped" if "skipped" in entry else f"{entry['tok_s']:.0f}"
        y = bar.get_height() if "tok_s" in entry else floor
        ax.annotate(
            text, (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8
        )
    ax.set_yscale("log")
    ax.set_ylim(floor, 2 * max(measured))  # headroom for the labels above the bars
    s = result["setup"]
    ax.set(
        ylabel="output tok/s (log scale)",
        title=f"The phase ladder on {s['device']}: {s['requests']} requests, "
        f"{s['output_tokens']} output tokens, KV {s['kv_slots']} slots\n"
        f"{s['torch_threads']} torch threads, best of {s['repeats']}, 1-min load "
        f"{result['load_average_before'][0]:.1f}"
        + (f"; phases 1-2: first {s['naive_requests']} requests" if s["naive_requests"] else ""),
    )
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--phases",
        type=int,
        nargs="+",
        choices=sorted(PHASES),
        default=None,
        help="phases to run (default: 1-8 on cpu, 6-8 on cuda)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser


def main():
    parser = build_parser()
    args = parse_args(parser)
    gpu = args.device == "cuda"
    args.phases = args.phases or (list(CHECKPOINT_PHASES) if gpu else sorted(PHASES))
    if gpu and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    if gpu and any(p not in CHECKPOINT_PHASES for p in args.phases):
        parser.error("--device cuda runs phases 6-8 only (phases 1-5 run TinyTransformer)")
    setup = gpu_setup(args.quick) if gpu else cpu_setup(args.quick)
    name = f"phase_ladder_{args.device}" + ("_quick" if args.quick else "")
    start = time.perf_counter()
    result = run_ladder(args, setup, name)
    result["total_seconds"] = time.perf_counter() - start
    path = write_result(name, result, args.out)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and {name}.png beside it ({result['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
