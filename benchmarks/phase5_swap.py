"""Phase 5 benchmark: preemption by recompute vs by swap, at a short and a long prompt length.

A preempted sequence either loses its KV blocks and prefills all its tokens again later
(recompute), or has its blocks copied to a CPU pool and back (swap). Which is cheaper depends on
what a token costs to recompute (a forward pass: FLOPs) against what it costs to copy (its keys
and values: bytes, twice). For each prompt length:
1. unit costs: one prefill of the whole context vs one swap out + in of its blocks, and both per
   token;
2. end to end: NUM_REQUESTS requests under a KV cache that admits two at once but cannot finish
   both, so the newer is preempted; in each mode: wall time, preemptions, tokens recomputed,
   blocks swapped, and whether the tokens are identical (they must be).
On this CPU-only setup both pools live in the same RAM, so a swap is a memcpy; on a GPU it crosses
PCIe (tens of GB/s) while recompute runs at the GPU's FLOP rate.
Run: python -m benchmarks.phase5_swap [--quick] [--threads 2] [--out DIR]
     (default DIR: a scratch folder; pass --out benchmarks/results to commit)
"""

import argparse
import os
import time

import torch

import phase5_paged
from benchmarks.harness import Timer, benchmark_parser, parse_args, seeded_workload, write_result
from phase5_paged.kv_cache import copy_blocks

MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=768,
    max_position_embeddings=2048,
)  # fmt: skip  (phase 4's benchmark model)
PROMPT_LENS = (64, 768)  # short and long contexts
NUM_REQUESTS, OUTPUT_LEN, BLOCK_SIZE = 6, 32, 16
REPEATS = 5  # unit costs: the median of this many
QUICK = dict(prompt_lens=(32, 128), num_requests=4, repeats=2)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def unit_costs(model, prompt_len: int, repeats: int) -> dict:
    """Seconds to prefill `prompt_len` tokens once, and to swap their blocks out and back in."""
    blocks = -(-prompt_len // BLOCK_SIZE)
    config = phase5_paged.EngineConfig(
        num_kv_blocks=blocks + 1, block_size=BLOCK_SIZE, max_num_batched_tokens=prompt_len,
        enable_prefix_caching=False, preemption_mode="swap", num_cpu_kv_blocks=blocks,
    )  # fmt: skip
    prefill, swap = [], []
    for _ in range(repeats):
        engine = phase5_paged.LLMEngine(model, config=config)
        engine.add_request(list(range(prompt_len)), phase5_paged.SamplingParams(max_tokens=1))
        with Timer() as t:
            engine.step()  # the whole prompt in one step: what a recompute costs
        prefill.append(t.seconds)
        pairs = [(b, b) for b in range(blocks)]
        runner = engine.runner
        with Timer() as t:
            copy_blocks(runner.kv_cache, runner.cpu_kv_cache, pairs)
            copy_blocks(runner.cpu_kv_cache, runner.kv_cache, pairs)
        swap.append(t.seconds)
    c = model.config
    kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * prompt_len  # fp32 K and V
    return {
        "recompute_s": median(prefill),
        "swap_out_and_in_s": median(swap),
        "recompute_us_per_token": 1e6 * median(prefill) / prompt_len,
        "swap_us_per_token": 1e6 * median(swap) / prompt_len,
        "kv_bytes": kv_bytes,
        "swap_bandwidth_gb_s": 2 * kv_bytes / median(swap) / 1e9,
    }


def end_to_end(model, prompt_len: int, num_requests: int, mode: str) -> tuple[dict, list]:
    workload = seeded_workload(
        seed=3, num_requests=num_requests, prompt_len=(prompt_len, prompt_len),
        output_len=(OUTPUT_LEN, OUTPUT_LEN), vocab_size=MODEL["vocab_size"],
    )  # fmt: skip
    longest = -(-(prompt_len + OUTPUT_LEN) // BLOCK_SIZE)
    # Two prompts, the first one's first new block and admission's watermark of 2: two requests
    # run at once, and cannot both finish (the JSON records the preemptions that follow).
    config = phase5_paged.EngineConfig(
        num_kv_blocks=2 * -(-prompt_len // BLOCK_SIZE) + 1 + 2, block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        preemption_mode=mode, num_cpu_kv_blocks=num_requests * longest if mode == "swap" else 0,
    )  # fmt: skip
    trace = phase5_paged.StepTrace()
    engine = phase5_paged.LLMEngine(model, config=config, trace=trace)
    swapped_blocks = 0
    ids = [
        engine.add_request(r.prompt_ids, phase5_paged.SamplingParams(temperature=0.0,
                                                                     max_tokens=r.max_tokens))
        for r in workload
    ]  # fmt: skip
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = {b for t in engine.block_manager.cpu_block_tables.values() for b in t}
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        after = {b for t in engine.block_manager.cpu_block_tables.values() for b in t}
        swapped_blocks += len(after - before)
    seconds = time.perf_counter() - start
    recomputed = sum(sum(r.prefill.values()) for r in trace.steps) - prompt_len * num_requests
    return {
        "num_kv_blocks": config.num_kv_blocks,
        "seconds": seconds,
        "steps": len(trace.steps),
        "preemptions": sum(len(r.preempted) for r in trace.steps),
        "blocks_swapped_out": swapped_blocks,
        "tokens_recomputed": recomputed,
        "output_tok_s": num_requests * OUTPUT_LEN / seconds,
    }, [done[i] for i in ids]


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__)


def main():
    args = parse_args(build_parser())
    load_before = os.getloadavg()[0]
    prompt_lens = QUICK["prompt_lens"] if args.quick else PROMPT_LENS
    num_requests = QUICK["num_requests"] if args.quick else NUM_REQUESTS
    repeats = QUICK["repeats"] if args.quick else REPEATS
    torch.manual_seed(0)
    model = phase5_paged.TinyTransformer(phase5_paged.ModelConfig(**MODEL)).eval()
    unit_costs(model, prompt_lens[0], 1)  # warm-up
    results = {}
    for prompt_len in prompt_lens:
        unit = unit_costs(model, prompt_len, repeats)
        runs, tokens = {}, {}
        for mode in ("recompute", "swap"):
            runs[mode], tokens[mode] = end_to_end(model, prompt_len, num_requests, mode)
        results[str(prompt_len)] = {
            "unit": unit,
            **runs,
            "same_tokens": tokens["recompute"] == tokens["swap"],
            "swap_speedup": runs["recompute"]["seconds"] / runs["swap"]["seconds"],
        }
        print(
            f"prompt {prompt_len}: recompute {1e3 * unit['recompute_s']:.1f} ms vs swap out+in "
            f"{1e3 * unit['swap_out_and_in_s']:.2f} ms ({unit['kv_bytes'] / 1e6:.1f} MB of KV); "
            f"end to end recompute {runs['recompute']['seconds']:.2f} s "
            f"({runs['recompute']['preemptions']} preemptions, "
            f"{runs['recompute']['tokens_recomputed']} tokens recomputed) vs swap "
            f"{runs['swap']['seconds']:.2f} s ({runs['swap']['blocks_swapped_out']} blocks "
            f"swapped); same tokens: {results[str(prompt_len)]['same_tokens']}"
        )
    write_result(
        "phase5_swap",
        {
            "model": MODEL,
            "quick": args.quick,
            "workload": {
                "num_requests": num_requests,
                "output_len": OUTPUT_LEN,
                "greedy": True,
                "block_size": BLOCK_SIZE,
            },
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "by_prompt_len": results,
        },  # fmt: skip
        args.out,
    )


if __name__ == "__main__":
    main()
