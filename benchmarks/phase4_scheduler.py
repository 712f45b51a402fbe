"""Phase 4 benchmark: continuous batching beats static batching; chunked prefill bounds stalls.

1. Throughput on a workload with mixed output lengths, same weights, same run: phase 3 static
   batching (groups of MAX_NUM_SEQS in arrival order, each decoded until its longest row is done)
   vs phase 4 continuous batching (at most MAX_NUM_SEQS running, a finished one replaced at once).
   Also static batching's wasted slot fraction (padding + rows already finished).
2. Decode stall: a few requests are decoding when a long prompt arrives. The worst wall time
   between two consecutive tokens of a decoding request, with and without chunked prefill.
3. Step traces (Chrome trace JSON + PNG): the chunked-prefill run of 2, and a run whose KV cache
   holds only the longest request, so requests are preempted and recomputed. The preemption
   trace's JSON carries its summary under "otherData": preemptions in all, and of the worst
   sequence. Before admission kept a watermark and regions could move (commit e7e9f21) the same
   run preempted 24 times in 281 steps, the worst sequence 8 times (`PREVIOUS_SCHEDULER`).
Run: python -m benchmarks.phase4_scheduler [--plot] [--threads 2] [--quick] [--traces-only]
     [--out DIR]   (default DIR: a scratch folder; pass --out benchmarks/results to commit)
"""

import argparse
import collections
import os
import time

import torch

import phase3_kvcache
import phase4_scheduler
from benchmarks.harness import (
    Timer,
    benchmark_parser,
    parse_args,
    seeded_workload,
    write_result,
)

# Big enough that the forward pass, not Python, dominates a step; small enough for 2 CPU cores.
MODEL = dict(
    vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
    intermediate_size=768, max_position_embeddings=1024,
)  # fmt: skip
MAX_NUM_SEQS = 8
THROUGHPUT_WORKLOAD = dict(seed=2, num_requests=24, prompt_len=(16, 64), output_len=(8, 96))
NUM_DECODERS, DECODER_PROMPT, DECODER_TOKENS = 4, 16, 40
LONG_PROMPT, ARRIVES_AFTER_STEPS = 896, 8  # the long prompt arrives mid-decode
CHUNKED_BUDGET = 128  # max_num_batched_tokens with chunked prefill
PREEMPTION_WORKLOAD = dict(seed=5, num_requests=8, prompt_len=(8, 24), output_len=(24, 64))
PREVIOUS_SCHEDULER = {"commit": "e7e9f21", "steps": 281, "preemptions": 24, "worst_sequence": 8}
QUICK = dict(num_requests=8, long_prompt=256)  # --quick: a smoke run, not a measurement


def greedy(mod, max_tokens: int):
    return mod.SamplingParams(temperature=0.0, max_tokens=max_tokens)  # no EOS id: full length


def static_vs_continuous(state: dict, workload_args: dict) -> dict:
    workload = seeded_workload(vocab_size=MODEL["vocab_size"], **workload_args)
    prompts = [r.prompt_ids for r in workload]
    num_output = sum(r.max_tokens for r in workload)
    p3 = phase3_kvcache.TinyTransformer(phase3_kvcache.ModelConfig(**MODEL)).eval()
    p3.load_state_dict(state)
    p3_params = [greedy(phase3_kvcache, r.max_tokens) for r in workload]
    p4 = phase4_scheduler.TinyTransformer(phase4_scheduler.ModelConfig(**MODEL)).eval()
    p4.load_state_dict(state)
    p4_params = [greedy(phase4_scheduler, r.max_tokens) for r in workload]
    llm = phase4_scheduler.LLM(p4, max_num_seqs=MAX_NUM_SEQS)
    # Warm-up both paths (allocator, first-call overheads) on a small slice.
    phase3_kvcache.generate_batch(p3, prompts[:2], [greedy(phase3_kvcache, 4)] * 2)
    llm.generate(prompts[:2], greedy(phase4_scheduler, 4), use_tqdm=False)

    static_tokens, slots, wasted = [], 0, 0
    with Timer() as static:
        for i in range(0, len(prompts), MAX_NUM_SEQS):
            group = slice(i, i + MAX_NUM_SEQS)
            out = phase3_kvcache.generate_batch(p3, prompts[group], p3_params[group])
            static_tokens += out.token_ids
            slots, wasted = slots + out.num_slots, wasted + out.num_wasted_slots
    with Timer() as continuous:
        outs = llm.generate(prompts, p4_params, use_tqdm=False)
    return {
        "workload": {**workload_args, "greedy": True, "eos": None},
        "max_num_seqs": MAX_NUM_SEQS,
        "output_tokens": num_output,
        "static_batching_tok_s": num_output / static.seconds,
        "continuous_batching_tok_s": num_output / continuous.seconds,
        "speedup": static.seconds / continuous.seconds,
        "static_wasted_slot_fraction": wasted / slots,
        "same_tokens": static_tokens == [o.outputs[0].token_ids for o in outs],
    }


def decode_stall(model, chunked: bool, long_prompt: int) -> tuple[dict, phase4_scheduler.StepTrace]:
    """Max wall time between consecutive tokens of the decoding requests, long prompt arriving."""
    if chunked:
        config = phase4_scheduler.EngineConfig(max_num_batched_tokens=CHUNKED_BUDGET)
    else:  # the budget must hold the long prompt whole
        budget = long_prompt + DECODER_TOKENS
        config = phase4_scheduler.EngineConfig(
            max_num_batched_tokens=budget, enable_chunked_prefill=False
        )
    trace = phase4_scheduler.StepTrace()
    engine = phase4_scheduler.LLMEngine(model, config=config, trace=trace)
    decoders = [
        engine.add_request([1 + i] * DECODER_PROMPT, greedy(phase4_scheduler, DECODER_TOKENS))
        for i in range(NUM_DECODERS)
    ]
    token_times: dict[str, list[float]] = {rid: [] for rid in decoders}
    step = 0
    while engine.has_unfinished_requests():
        if step == ARRIVES_AFTER_STEPS:
            engine.add_request(list(range(long_prompt)), greedy(phase4_scheduler, 8))
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in token_times:
                token_times[out.request_id].append(now)
        step += 1
    gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:], strict=False)]
    gaps.sort()
    return {
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "worst_stall_ms": 1000 * gaps[-1],
        "median_inter_token_ms": 1000 * gaps[len(gaps) // 2],
        "steps": step,
    }, trace


def preemption_trace(model) -> tuple[dict, phase4_scheduler.StepTrace]:
    workload = seeded_workload(vocab_size=MODEL["vocab_size"], **PREEMPTION_WORKLOAD)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload)
    trace = phase4_scheduler.StepTrace()
    llm = phase4_scheduler.LLM(model, trace=trace, num_kv_slots=longest)
    params = [greedy(phase4_scheduler, r.max_tokens) for r in workload]
    llm.generate([r.prompt_ids for r in workload], params, use_tqdm=False)
    per_sequence = collections.Counter(i for r in trace.steps for i in r.preempted)
    info = {
        "workload": PREEMPTION_WORKLOAD,
        "num_kv_slots": longest,
        "steps": len(trace.steps),
        "preemptions": sum(per_sequence.values()),
        "preemptions_per_sequence": {str(i): n for i, n in sorted(per_sequence.items())},
        "worst_sequence": max(per_sequence.values(), default=0),
        "previous_scheduler": PREVIOUS_SCHEDULER,
    }
    return info, trace


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--plot", action="store_true", help="also write the PNGs")
    parser.add_argument("--traces-only", action="store_true", help="only the two step traces")
    return parser


def main():
    load_before = os.getloadavg()[0]
    args = parse_args(build_parser())
    torch.manual_seed(0)
    model = phase4_scheduler.TinyTransformer(phase4_scheduler.ModelConfig(**MODEL)).eval()
    state = model.state_dict()
    long_prompt = QUICK["long_prompt"] if args.quick else LONG_PROMPT
    workload_args = THROUGHPUT_WORKLOAD | (
        {"num_requests": QUICK["num_requests"]} if args.quick else {}
    )

    stalls, traces = {}, {}
    for name, chunked in [("without_chunked_prefill", False), ("chunked_prefill", True)]:
        if args.traces_only and not chunked:
            continue
        stalls[name], traces[name] = decode_stall(model, chunked, long_prompt)
        print(
            f"{name}: worst decode stall {stalls[name]['worst_stall_ms']:.0f} ms "
            f"(median inter-token {stalls[name]['median_inter_token_ms']:.0f} ms)"
        )
    preemption, preemption_steps = preemption_trace(model)
    print(
        f"preemption run: {preemption['preemptions']} preemptions in {preemption['steps']} steps, "
        f"the worst sequence {preemption['worst_sequence']} times (previous scheduler: "
        f"{PREVIOUS_SCHEDULER['preemptions']}, worst {PREVIOUS_SCHEDULER['worst_sequence']})"
    )
    for name, trace, title in [
        ("chunked", traces["chunked_prefill"],
         f"chunked prefill: a {long_prompt}-token prompt joins {NUM_DECODERS} decodes"),
        ("preemption", preemption_steps,
         f"preemption: KV cache = {preemption['num_kv_slots']} slots (the longest request)"),
    ]:  # fmt: skip
        summary = preemption if name == "preemption" else None
        trace.to_chrome(args.out / f"phase4_trace_{name}.json", summary)
        if args.plot:
            trace.plot(args.out / f"phase4_trace_{name}.png", title=title)
    if args.traces_only:
        return

    throughput = static_vs_continuous(state, workload_args)
    print(
        f"static batching {throughput['static_batching_tok_s']:.0f} tok/s, continuous "
        f"{throughput['continuous_batching_tok_s']:.0f} tok/s ({throughput['speedup']:.2f}x); "
        f"static wasted {100 * throughput['static_wasted_slot_fraction']:.0f}% of slots"
    )
    write_result(
        "phase4_scheduler",
        {
            "model": MODEL,
            "baseline": "phase3_kvcache static batching, same weights, same run",
            "quick": args.quick,
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "throughput": throughput,
            "decode_stall": {
                "decoders": NUM_DECODERS,
                "decoder_prompt": DECODER_PROMPT,
                "long_prompt": long_prompt,
                "arrives_after_steps": ARRIVES_AFTER_STEPS,
                **stalls,
            },
            "preemption": preemption,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
