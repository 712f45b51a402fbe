"""Phase 5 benchmark: paged KV memory vs phase 4's contiguous regions, and prefix caching.

(a) KV memory utilization, phase 4 (baseline, same run, same weights) vs phase 5, in the same KV
    capacity: tokens actually stored / slots reserved, sampled after every step, plus how many
    requests ran at once. Requests declare max_tokens=256 (what a client asks for, and what
    phase 4 must reserve) but stop after a seeded number of tokens, the way EOS or a stop string
    ends real requests early: the engine cannot know it in advance. The stop is applied by
    aborting the request the moment it has that many tokens, in both phases. The gain depends on
    how far replies fall short of max_tokens, so it is measured over several distributions of
    that length (STOP_DISTRIBUTIONS): uniform 8-128, a long tail (1 in 8 long), all short, all long.
(b) Prefix caching on a shared-system-prompt workload: 32 requests = one 256-token system prompt
    + a unique 8-32-token suffix, 32 output tokens each; hit rate, prompt tokens computed, wall
    time, output tok/s and mean time to first token, caching on vs off.
Writes phase5_paged.json and phase5_paged.png into --out.
Run: python -m benchmarks.phase5_paged [--quick] [--out DIR] [--threads 2]
"""

import argparse
import random
import time

import torch

import phase4_scheduler as p4
import phase5_paged as p5
from benchmarks.harness import benchmark_parser, parse_args, seeded_workload, write_result

MODEL = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 1024,
}
KV_SLOTS = 4096  # the same KV memory for both phases: 256 blocks of 16 in phase 5
BLOCK_SIZE = 16
MAX_NUM_SEQS = 64  # high enough that KV memory, not this cap, limits concurrency
DECLARED_MAX_TOKENS = 256
NUM_REQUESTS, QUICK_NUM_REQUESTS = 32, 8
LONG_SHARE = 0.125  # the long-tail mix: 1 request in 8 runs almost to max_tokens
# Reply length (tokens until the request stops) drawn per request from random.Random(6).
STOP_DISTRIBUTIONS = {
    "uniform 8-128": lambda rng: rng.randint(8, 128),
    "long tail: 7/8 at 8-32, 1/8 at 192-256": lambda rng: (
        rng.randint(192, DECLARED_MAX_TOKENS) if rng.random() < LONG_SHARE else rng.randint(8, 32)
    ),
    "all short 8-32": lambda rng: rng.randint(8, 32),
    "all long 192-256": lambda rng: rng.randint(192, DECLARED_MAX_TOKENS),
}
HEADLINE = "uniform 8-128"  # the distribution the plot's step curves show
SYSTEM_PROMPT_LEN, SUFFIX_LEN, SHARED_OUTPUT = 256, (8, 32), 32
SHARED_REQUESTS, QUICK_SHARED_REQUESTS = 32, 8


def build(mod, state):
    model = mod.TinyTransformer(mod.ModelConfig(**MODEL)).eval()
    model.load_state_dict(state)
    return model


def kv_stats(engine) -> tuple[int, int]:
    """(tokens stored, slots reserved): phase 4's slot regions or phase 5's blocks."""
    pool = engine.block_manager
    return pool.num_used_slots, pool.num_reserved_slots


def drive(engine, mod, prompts, max_tokens, stop_after=None) -> dict:
    """Adds every request at t=0 and steps to the end, sampling KV use and concurrency."""
    greedy = [mod.SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, greedy, strict=True)]
    stop_at = dict(zip(ids, stop_after or max_tokens, strict=True))
    first_token, num_out, util, running, start = {}, 0, [], [], time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
            n = len(out.outputs[0].token_ids)
            if out.finished or n >= stop_at[out.request_id]:
                num_out += n
                engine.abort_request(out.request_id)  # stopped early: EOS-like, unforeseeable
        used, reserved = kv_stats(engine)
        running.append(len(engine.scheduler.running))
        if reserved:
            util.append(used / reserved)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": num_out,
        "output_tok_s": num_out / seconds,
        "mean_ttft_s": sum(first_token.values()) / len(first_token),
        "util": util,
        "running": running,
    }


def utilization(state, distribution: str, num_requests: int) -> dict:
    work = seeded_workload(
        5, num_requests, (16, 256), (DECLARED_MAX_TOKENS,) * 2, MODEL["vocab_size"]
    )
    rng = random.Random(6)
    stop_after = [STOP_DISTRIBUTIONS[distribution](rng) for _ in work]
    prompts, max_tokens = [r.prompt_ids for r in work], [r.max_tokens for r in work]
    common = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 512}
    engines = {
        "phase4_scheduler": (
            p4,
            p4.LLMEngine(build(p4, state), config=p4.EngineConfig(num_kv_slots=KV_SLOTS, **common)),
        ),
        "phase5_paged": (
            p5,
            p5.LLMEngine(
                build(p5, state),
                config=p5.EngineConfig(
                    num_kv_blocks=KV_SLOTS // BLOCK_SIZE,
                    block_size=BLOCK_SIZE,
                    enable_prefix_caching=False,
                    **common,
                ),
            ),
        ),
    }
    results = {}
    for name, (mod, engine) in engines.items():
        r = drive(engine, mod, prompts, max_tokens, stop_after)
        busy = [u for u, n in zip(r["util"], r["running"], strict=False) if n]
        results[name] = {
            "mean_utilization": sum(busy) / len(busy),
            "final_utilization": busy[-1],
            "peak_running_seqs": max(r["running"]),
            "mean_running_seqs": sum(r["running"]) / len(r["running"]),
            "steps": len(r["running"]),
            **{k: r[k] for k in ("seconds", "output_tokens", "output_tok_s", "mean_ttft_s")},
            "utilization_per_step": [round(u, 4) for u in r["util"]],
        }
        print(
            f"  {name}: utilization mean {results[name]['mean_utilization']:.1%}, "
            f"peak running {results[name]['peak_running_seqs']}, "
            f"{r['output_tok_s']:.0f} tok/s, {r['seconds']:.1f} s"
        )
    results["speedup_output_tok_s"] = (
        results["phase5_paged"]["output_tok_s"] / results["phase4_scheduler"]["output_tok_s"]
    )
    results["mean_stop_after"] = sum(stop_after) / len(stop_after)
    results["workload"] = (
        f"seeded_workload(5, {num_requests}, (16, 256), ({DECLARED_MAX_TOKENS}, "
        f"{DECLARED_MAX_TOKENS})): declared max_tokens {DECLARED_MAX_TOKENS}, each request stops "
        f"after {distribution} tokens (random.Random(6)); greedy; KV capacity {KV_SLOTS} token "
        f"slots (phase 5: block_size {BLOCK_SIZE}, prefix caching off); max_num_seqs "
        f"{MAX_NUM_SEQS}, max_num_batched_tokens 512"
    )
    return results


def prefix_caching(state, num_requests: int) -> dict:
    rng = random.Random(7)
    system = [rng.randrange(MODEL["vocab_size"]) for _ in range(SYSTEM_PROMPT_LEN)]
    prompts = [
        system + [rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randint(*SUFFIX_LEN))]
        for _ in range(num_requests)
    ]
    results = {}
    for caching in (False, True):
        config = p5.EngineConfig(max_num_seqs=num_requests, enable_prefix_caching=caching)
        engine = p5.LLMEngine(build(p5, state), config=config, trace=p5.StepTrace())
        r = drive(engine, p5, prompts, [SHARED_OUTPUT] * len(prompts))
        bm = engine.block_manager
        computed = sum(sum(s.prefill.values()) for s in engine.trace.steps)
        results["on" if caching else "off"] = {
            "hit_rate": bm.num_hit_tokens / bm.num_queried_tokens,
            "prompt_tokens_computed": computed,
            **{k: r[k] for k in ("seconds", "output_tokens", "output_tok_s", "mean_ttft_s")},
        }
        print(
            f"prefix caching {'on' if caching else 'off'}: hit rate "
            f"{bm.num_hit_tokens / bm.num_queried_tokens:.1%}, {computed} prompt tokens "
            f"computed, {r['output_tok_s']:.0f} tok/s, TTFT {r['mean_ttft_s'] * 1e3:.0f} ms"
        )
    on, off = results["on"], results["off"]
    results["speedup_output_tok_s"] = on["output_tok_s"] / off["output_tok_s"]
    results["ttft_reduction"] = 1 - on["mean_ttft_s"] / off["mean_ttft_s"]
    results["workload"] = (
        f"{num_requests} requests: one {SYSTEM_PROMPT_LEN}-token system prompt + a unique "
        f"random.Random(7) suffix of {SUFFIX_LEN} tokens, {SHARED_OUTPUT} greedy output tokens; "
        f"EngineConfig defaults (block_size 16, 512 blocks, budget 256), max_num_seqs "
        f"{num_requests}"
    )
    return results


def plot(path, util: dict, prefix: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(
        1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [2, 1.4, 1]}
    )
    for name in ("phase4_scheduler", "phase5_paged"):
        r = util[HEADLINE][name]
        a.plot(
            [100 * u for u in r["utilization_per_step"]],
            lw=0.8,
            label=f"{name}: mean {r['mean_utilization']:.0%}, "
            f"peak {r['peak_running_seqs']} running",
        )
    a.set(
        xlabel="step",
        ylabel="tokens stored / slots reserved (%)",
        ylim=(0, 105),
        title=f"KV utilization, same {KV_SLOTS}-slot cache, replies {HEADLINE}",
    )
    a.legend(loc="lower right", fontsize=8)
    names = list(util)
    x = range(len(names))
    for offset, phase in ((-0.2, "phase4_scheduler"), (0.2, "phase5_paged")):
        c.bar([i + offset for i in x], [100 * util[n][phase]["mean_utilization"] for n in names],
              width=0.4, label=phase)  # fmt: skip
    c.set_xticks(list(x), [n.split(":")[0] for n in names], fontsize=7)
    c.set(ylabel="mean KV utilization (%)", ylim=(0, 105), title="by reply-length distribution")
    c.legend(loc="lower right", fontsize=8)
    labels = ["caching off", "caching on"]
    b.bar(labels, [prefix[k]["output_tok_s"] for k in ("off", "on")], color=["grey", "tab:green"])
    b.set(
        ylabel="output tok/s",
        title=f"{SYSTEM_PROMPT_LEN}-token shared prefix, hit rate {prefix['on']['hit_rate']:.0%}",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__)


def main():
    args = parse_args(build_parser())
    torch.manual_seed(0)
    state = p4.TinyTransformer(p4.ModelConfig(**MODEL)).state_dict()
    util = {}
    for distribution in STOP_DISTRIBUTIONS:
        print(f"replies {distribution}:")
        util[distribution] = utilization(
            state, distribution, QUICK_NUM_REQUESTS if args.quick else NUM_REQUESTS
        )
    prefix = prefix_caching(state, QUICK_SHARED_REQUESTS if args.quick else SHARED_REQUESTS)
    path = write_result(
        "phase5_paged",
        {
            "quick": args.quick,
            "model": MODEL,
            "baseline": "phase4_scheduler (contiguous slot regions), same weights, same run",
            "kv_utilization": util,
            "prefix_caching": prefix,
        },
        args.out,
    )
    print(f"wrote {path}")
    plot(args.out / "phase5_paged.png", util, prefix)


if __name__ == "__main__":
    main()
