"""Gated DeltaNet kernel microbenchmarks (GPU): the decode step against its byte floor, the
chunked prefill against the torch reference and fla-core's `chunk_gated_delta_rule`.

Workload (Qwen3.5-0.8B's DeltaNet layers: 16 key and 16 value heads, d_k = d_v = 128, conv of
6,144 channels and width 4, bf16 activations, fp32 state, seed 0):
- decode (`gated_delta_rule_decode`), batch 1/16/64/256, slots in random order: 18 layers (the
  model's DeltaNet layers) each with its own state pool in one CUDA graph, so every call reads its
  state from HBM; the floor is the state read and written once (2 x batch x 1 MiB) at the
  device-to-device copy bandwidth measured in the same run. Beside it the decode conv
  (`causal_conv1d_update`) and gated norm in µs, the torch reference (phase 6's path) eagerly,
  and a sweep of the d_v tile.
- prefill (`gated_delta_rule_prefill`), 512/4,096/16,384 tokens as one sequence and as several:
  tok/s of ours, of the torch reference (chunked form, one sequence at a time) and of fla's
  `chunk_gated_delta_rule` (gates, sigmoid and L2 norm fused in its kernels as in ours, states
  gathered from and scattered back to the pool inside the timed region, as the engine would
  have to) when `import fla` works; relative errors against the fp32 reference; a sweep of
  ChunkConfig. fla is never a dependency: without it its columns are absent.
Timing: triton.testing.do_bench, median, L2 flushed between repetitions.

Writes phase7_gdn_kernels.json into --out DIR.
Run: python -m benchmarks.phase7_gdn_kernels [--out DIR] [--quick]
"""

import os

import torch
import triton
from triton.testing import do_bench

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase7_optim import gated_delta as ref
from phase7_optim.kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    gated_rms_norm,
)
from phase7_optim.kernels.gated_delta import ChunkConfig, decode_block_v

DEVICE = "cuda"
DTYPE = torch.bfloat16
H_K, H_V, D_K, D_V = 16, 16, 128, 128
CONV_CHANNELS = 2 * H_K * D_K + H_V * D_V
WIDTH = 4
LAYERS = 18  # Qwen3.5-0.8B: 24 layers, 3 of every 4 DeltaNet
STATE_BYTES = H_V * D_K * D_V * 4  # fp32, per sequence per layer
DECODE_BATCHES = [1, 16, 64, 256]
DECODE_BLOCK_V = [16, 32, 64, 128]
PREFILL_CASES = [(512, 1), (4096, 1), (4096, 8), (16384, 1), (16384, 8), (16384, 32)]
CHUNK_SWEEP = [
    ChunkConfig(),
    ChunkConfig(intra_warps=8),
    ChunkConfig(state_block_v=16),
    ChunkConfig(state_block_v=64, state_warps=8),
    ChunkConfig(output_block_v=128, output_warps=8),
    ChunkConfig(output_block_v=32),
]


def median_ms(fn, rep: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.float16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


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


def rule_inputs(num_tokens: int, num_slots: int):
    """q, k, v as views into one projection output (as the model slices them), raw gates, the
    layer's parameters, a state pool."""
    widths = [H_K * D_K, H_K * D_K, H_V * D_V]
    qkv = torch.randn(num_tokens, sum(widths), device=DEVICE, dtype=DTYPE)
    q, k, v = qkv.split(widths, dim=-1)
    q, k, v = q.view(-1, H_K, D_K), k.view(-1, H_K, D_K), v.view(-1, H_V, D_V)
    a, b = (torch.randn(num_tokens, H_V, device=DEVICE, dtype=DTYPE) for _ in range(2))
    A_log = torch.empty(H_V, device=DEVICE).uniform_(1, 16).log()
    dt_bias = torch.randn(H_V, device=DEVICE)
    state = torch.randn(num_slots, H_V, D_K, D_V, device=DEVICE) * 0.1
    return (q, k, v, a, b, A_log, dt_bias), state


# ---- decode -------------------------------------------------------------------------------------


def bench_decode(batch: int, copy_gbps: float, block_v: int | None = None) -> dict:
    tensors, _ = rule_inputs(batch, 1)
    pools = [torch.zeros(batch, H_V, D_K, D_V, device=DEVICE) for _ in range(LAYERS)]
    slots = torch.randperm(batch, device=DEVICE).int()
    calls = [
        lambda p=p: gated_delta_rule_decode(*tensors, p, slots, block_v=block_v) for p in pools
    ]
    ms = graph_ms(lambda: [call() for call in calls]) / LAYERS
    state_bytes = 2 * batch * STATE_BYTES
    return {
        "us": ms * 1e3,
        "state_GBps": state_bytes / (ms * 1e-3) / 1e9,
        "floor_us": state_bytes / (copy_gbps * 1e9) * 1e6,
        "pct_of_copy": 100 * state_bytes / (ms * 1e-3) / 1e9 / copy_gbps,
        "block_v": block_v or decode_block_v(batch, H_V, D_V),
    }


def bench_decode_others(batch: int) -> dict:
    """The decode conv and gated norm (µs, graph, per layer), and the torch reference's step
    (eager: phase 6's path, gating and the slot gather/scatter included)."""
    x = torch.randn(batch, 2 * CONV_CHANNELS, device=DEVICE, dtype=DTYPE)[:, :CONV_CHANNELS]
    conv_states = [
        torch.zeros(batch, CONV_CHANNELS, WIDTH - 1, device=DEVICE, dtype=DTYPE)
        for _ in range(LAYERS)
    ]
    weight = torch.randn(CONV_CHANNELS, WIDTH, device=DEVICE, dtype=DTYPE)
    slots = torch.randperm(batch, device=DEVICE).int()
    conv_ms = graph_ms(lambda: [causal_conv1d_update(x, s, weight, slots) for s in conv_states])
    o, z = (torch.randn(batch, H_V, D_V, device=DEVICE, dtype=DTYPE) for _ in range(2))
    norm_w = torch.ones(D_V, device=DEVICE, dtype=DTYPE)
    norm_ms = graph_ms(lambda: [gated_rms_norm(o, z, norm_w, 1e-6) for _ in range(LAYERS)])
    tensors, state = rule_inputs(batch, batch)
    q, k, v, a, b, A_log, dt_bias = tensors
    slot_list, qsl = slots.tolist(), list(range(batch + 1))

    def torch_step():
        g, beta = ref.gating(a, b, A_log, dt_bias)
        return ref.gated_delta_rule(q, k, v, g, beta, state, qsl, slot_list)

    return {
        "conv_update_us": conv_ms / LAYERS * 1e3,
        "gated_norm_us": norm_ms / LAYERS * 1e3,
        "torch_ref_rule_us": median_ms(torch_step) * 1e3,
    }


def run_decode(results, copy_gbps, save, batches, sweep: bool) -> None:
    rows = results.setdefault("decode", [])
    for batch in batches:
        row = {"batch": batch, **bench_decode(batch, copy_gbps), **bench_decode_others(batch)}
        if sweep:
            row["block_v_sweep_us"] = {
                bv: bench_decode(batch, copy_gbps, bv)["us"] for bv in DECODE_BLOCK_V
            }
        rows.append(row)
        print(row, flush=True)
        save()


# ---- prefill ------------------------------------------------------------------------------------


def import_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as err:  # not installed, or a Triton it does not support
        return None, f"{type(err).__name__}: {str(err)[:200]}"
    import fla

    return chunk_gated_delta_rule, getattr(fla, "__version__", "?")


def prefill_case(tokens: int, num_seqs: int):
    tensors, state = rule_inputs(tokens, 2 * num_seqs)
    qsl = torch.arange(num_seqs + 1, device=DEVICE, dtype=torch.int32) * (tokens // num_seqs)
    slots = torch.randperm(2 * num_seqs, device=DEVICE)[:num_seqs].int()
    return tensors, state, qsl, slots


def fla_prefill(fla_rule, tensors, state, qsl, slots):
    """fla's chunked rule as the engine would call it: states gathered from the pool by slot,
    the final ones scattered back."""
    q, k, v, a, b, A_log, dt_bias = tensors
    o, final = fla_rule(
        q[None], k[None], v[None], a[None], b[None],
        initial_state=state[slots.long()], output_final_state=True, cu_seqlens=qsl.long(),
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    state[slots.long()] = final
    return o[0]


def torch_prefill(tensors, state, qsl, slots):
    q, k, v, a, b, A_log, dt_bias = tensors
    g, beta = ref.gating(a, b, A_log, dt_bias)
    return ref.gated_delta_rule(q, k, v, g, beta, state, qsl.tolist(), slots.tolist())


def rel_error(actual, expected) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def prefill_errors(fla_rule) -> dict:
    """Ours and fla against the fp32 reference on 4,096 tokens as 8 sequences: o and states."""
    tensors, state, qsl, slots = prefill_case(4096, 8)
    expected_state = state.clone()
    expected = torch_prefill([t.float() for t in tensors], expected_state, qsl, slots)
    errors = {}
    for name, fn in (("ours", gated_delta_rule_prefill), ("fla", fla_rule)):
        if fn is None:
            continue
        s = state.clone()
        if name == "fla":
            out = fla_prefill(fla_rule, tensors, s, qsl, slots)
        else:
            out = fn(*tensors, s, qsl, slots)
        errors[f"{name}_o"] = rel_error(out.float(), expected)
        errors[f"{name}_state"] = rel_error(s[slots.long()], expected_state[slots.long()])
    return errors


def bench_prefill_case(tokens: int, num_seqs: int, fla_rule, sweep: bool) -> dict:
    tensors, state, qsl, slots = prefill_case(tokens, num_seqs)

    def timed(name: str, fn, rep: int = 100) -> dict:
        ms = median_ms(fn, rep)
        return {f"{name}_ms": ms, f"{name}_tok_s": tokens / (ms * 1e-3)}

    row = {"tokens": tokens, "num_seqs": num_seqs}
    row |= timed("ours", lambda: gated_delta_rule_prefill(*tensors, state, qsl, slots))
    row |= timed("torch_ref", lambda: torch_prefill(tensors, state, qsl, slots), rep=300)
    row["ours_over_ref"] = row["torch_ref_ms"] / row["ours_ms"]
    if fla_rule is not None:
        row |= timed("fla", lambda: fla_prefill(fla_rule, tensors, state, qsl, slots))
        row["ours_over_fla"] = row["fla_ms"] / row["ours_ms"]
    x = torch.randn(tokens, CONV_CHANNELS, device=DEVICE, dtype=DTYPE)
    conv_state = torch.zeros(2 * num_seqs, CONV_CHANNELS, WIDTH - 1, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(CONV_CHANNELS, WIDTH, device=DEVICE, dtype=DTYPE)
    max_len = tokens // num_seqs
    row["conv_varlen_ms"] = median_ms(
        lambda: causal_conv1d_varlen(x, conv_state, weight, qsl, slots, max_len)
    )
    if sweep:
        row["chunk_config_sweep"] = [
            {**vars(c), "ms": median_ms(
                lambda c=c: gated_delta_rule_prefill(*tensors, state, qsl, slots, config=c))}
            for c in CHUNK_SWEEP
        ]  # fmt: skip
    return row


def run_prefill(results, fla_rule, save, cases, sweep: bool) -> None:
    try:
        results["prefill_rel_errors_4096x8"] = prefill_errors(fla_rule)
    except Exception as err:  # fla installed but failing here: measure without it
        results["fla_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        fla_rule = None
        results["prefill_rel_errors_4096x8"] = prefill_errors(None)
    print(results["prefill_rel_errors_4096x8"], flush=True)
    rows = results.setdefault("prefill", [])
    for tokens, num_seqs in cases:
        case_sweep = sweep and tokens == 16384 and num_seqs in (1, 8)
        rows.append(bench_prefill_case(tokens, num_seqs, fla_rule, case_sweep))
        print(rows[-1], flush=True)
        save()


def summarize(results) -> dict:
    decode = {r["batch"]: round(r["pct_of_copy"], 1) for r in results["decode"]}
    prefill = {
        f"{r['tokens']}x{r['num_seqs']}": {
            "ours_tok_s": round(r["ours_tok_s"]),
            "ours_over_ref": round(r["ours_over_ref"], 2),
            **({"ours_over_fla": round(r["ours_over_fla"], 2)} if "ours_over_fla" in r else {}),
        }
        for r in results["prefill"]
    }
    return {"decode_pct_of_copy_by_batch": decode, "prefill": prefill}


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--commit", default=os.environ.get("MINI_VLLM_COMMIT"))
    parser.add_argument("--no-sweeps", action="store_true", help="defaults only, no sweeps")
    return parser


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("phase7_gdn_kernels needs a CUDA GPU; nothing to measure here")
    torch.manual_seed(0)
    fla_rule, fla_version = import_fla()
    results = {
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "fla": fla_version if fla_rule is not None else None,
        "fla_import_error": None if fla_rule is not None else fla_version,
        "workload": {
            "h_k": H_K, "h_v": H_V, "d_k": D_K, "d_v": D_V, "conv_channels": CONV_CHANNELS,
            "dtype": str(DTYPE), "layers_per_graph": LAYERS, "decode_batches": DECODE_BATCHES,
            "prefill_cases_(tokens,num_seqs)": PREFILL_CASES,
            "timing": "triton.testing.do_bench median, warmup 25 ms, L2 flushed",
        },
    }  # fmt: skip
    if args.commit:
        results["commit"] = args.commit

    def save():
        write_result("phase7_gdn_kernels", results, args.out)

    batches, cases = DECODE_BATCHES, PREFILL_CASES
    if args.quick:  # checks the script, not the numbers
        batches, cases = [1, 64], [(512, 1), (4096, 8)]
        results["quick"] = True
    copy_gbps = results["copy_bandwidth_GBps"] = copy_bandwidth_gbps()
    sweep = not (args.no_sweeps or args.quick)
    with torch.inference_mode():
        run_decode(results, copy_gbps, save, batches, sweep)
        run_prefill(results, fla_rule, save, cases, sweep)
    results["summary"] = summarize(results)
    save()
    print(results["summary"])


if __name__ == "__main__":
    main()
