"""One long prompt's prefill on a CUDA GPU: phase 7 against transformers' SDPA, 1k to 32k tokens.

A prompt of L tokens costs L x 2 x params FLOPs in its linear layers and ~L^2 / 2 x 4 x heads x
head_dim per layer in causal attention: from ~16k tokens on, attention is most of the time, and the
attention kernel decides. This measures the whole path a user waits on, prompt in, first token
out, at L = 1,024 … 32,000:
- phase 7: `LLM.generate([prompt], max_tokens=1)` with its defaults (16,384 batched tokens a
  step, so a 32,000-token prompt is two chunks, the second attending to the first through the
  paged cache, block size 16); the prefix cache off, so each repeat computes everything;
- the baseline: transformers' `Qwen3ForCausalLM` on the same checkpoint, bf16, its default
  attention (`sdpa`: torch picks the backend, cuDNN's fused attention on Hopper), one forward
  of the prompt with `logits_to_keep=1` and the argmax of the last row (its best case: no
  `generate` loop, no cache object).
Both run the same random Qwen3-0.6B-shaped checkpoint (workload W's model: values do not change
the time). Each length is run once untimed, then timed REPEATS times: best wall time.

Beside it, the attention kernels alone at each length (causal, one sequence, 16 query and 8 KV
heads of 128, bf16, L2 flushed, median): our varlen paged prefill at block size 16 with the
default config, against torch SDPA with the backend it picks itself (what transformers calls);
and ours with each launch lever off in turn (`LEVERS`: two pipeline stages instead of three,
query tiles in launch order instead of longest first, longest first even past 16,384 tokens of
context). Past 16,384 tokens also the launches the engine makes for that prompt (chunks of
ENGINE_CHUNK queries, each attending to the keys before its end, its block table as wide as that
end), with the default config and each lever off: one 32,000-token launch is not what the engine
runs. At the longest length, a few other tiles (`TILE_SWEEP`) beside the default, and the whole
engine with ENGINE_LEVER off, then with the default again.

Goal (issue 26): phase 7 >= transformers at every length.

Run (CUDA machine): python -m benchmarks.phase7_prefill [--quick] [--out DIR]
Writes phase7_prefill.json into the --out directory, rewritten after each part, so that a run
cut short keeps the parts that finished.
"""

import gc
import tempfile
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import phase7_optim
from benchmarks.harness import Timer, benchmark_parser, parse_args, write_result
from benchmarks.phase6_qwen3_gpu import save_checkpoint
from phase7_optim.kernels import flash_attn_varlen_paged, flash_prefill
from phase7_optim.kernels.flash_prefill import default_prefill_config

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32000]
QUICK_LENGTHS = [1024, 4096]
REPEATS = 3
LEVERS = {  # the kernel's launch levers, each turned off alone in the kernel rows (ablation)
    "two pipeline stages (the config before 2026-12-05)": {"num_stages": 2},
    "query tiles in launch order, not longest first": {"longest_first": False},
    "longest first at every context length": {"longest_first_max_context": 2**31 - 1},
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
TILE_SWEEP = [  # other tiles, timed at the longest length only: is 32k's best the default?
    {"block_n": 64},
    {"block_n": 64, "num_stages": 4},
    {"block_m": 64, "num_warps": 4},
    {"block_m": 64, "block_n": 64, "num_warps": 4},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4},
    {"num_warps": 4, "block_n": 64},
]
ENGINE_LEVER = "longest first at every context length"  # also run off end to end (32k)
ENGINE_CHUNK = 16384  # LLM's default token budget: a longer prompt is prefilled in chunks
PROMPT_SEED, PROMPT_ID_RANGE = 0, 10000


def prompt(length: int) -> list[int]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, PROMPT_ID_RANGE, (length,), generator=g).tolist()


def best_seconds(fn) -> float:
    fn()  # warm-up: kernels compiled for this shape, allocator grown
    times = []
    for _ in range(REPEATS):
        with Timer() as t:
            fn()
        times.append(t.seconds)
    return min(times)


def run_phase7(checkpoint: Path, lengths: list[int]) -> tuple[dict[int, float], dict]:
    """The sweep's seconds per length, then at the longest length the engine with
    ENGINE_LEVER off (the engine picks its prefill config itself, so the default is swapped for
    that run) against the default once more, in the same process."""
    llm = phase7_optim.LLM(checkpoint, dtype="bfloat16", enable_prefix_caching=False)
    params = phase7_optim.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seconds = {}
    for n in lengths:
        ids = prompt(n)
        seconds[n] = best_seconds(lambda ids=ids: llm.generate([ids], params, use_tqdm=False))
        print(f"phase 7       {n:6d} tokens: {seconds[n] * 1e3:8.1f} ms", flush=True)
    ids, default = prompt(lengths[-1]), flash_prefill.default_prefill_config

    def lever_off(head_dim, device):
        return replace(default(head_dim, device), **LEVERS[ENGINE_LEVER])

    with mock.patch.object(flash_prefill, "default_prefill_config", lever_off):
        off = best_seconds(lambda: llm.generate([ids], params, use_tqdm=False))
    again = best_seconds(lambda: llm.generate([ids], params, use_tqdm=False))
    print(f"phase 7 {lengths[-1]} tokens, {ENGINE_LEVER}: {off * 1e3:.1f} ms "
          f"(default: {seconds[lengths[-1]] * 1e3:.1f}, again {again * 1e3:.1f})")  # fmt: skip
    ablation = {"lever_off": ENGINE_LEVER, "tokens": lengths[-1], "lever_off_s": off,
                "default_s": [seconds[lengths[-1]], again]}  # fmt: skip
    return seconds, ablation


def run_transformers(checkpoint: Path, lengths: list[int]) -> tuple[dict[int, float], str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    seconds = {}
    for n in lengths:
        ids = torch.tensor([prompt(n)], device="cuda")

        def first_token(ids=ids):
            with torch.inference_mode():
                return model(ids, logits_to_keep=1).logits[0, -1].argmax().item()

        seconds[n] = best_seconds(first_token)
        print(f"transformers  {n:6d} tokens: {seconds[n] * 1e3:8.1f} ms", flush=True)
    return seconds, model.config._attn_implementation


def attention_flops(n: int) -> float:
    return 4 * NUM_HEADS * HEAD_DIM * n * n / 2  # QK^T and PV over the causal half


def kernel_row(n: int, sweep: bool = False) -> dict:
    """Our prefill kernel (paged, block size 16, blocks in random order) and SDPA's own pick."""
    dev, dtype = "cuda", torch.bfloat16
    num_blocks = triton.cdiv(n, BLOCK_SIZE)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=dev).int()[None]
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    query_start_loc = torch.tensor([0, n], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([n], device=dev, dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    def ours(config):
        return do_bench(
            lambda: flash_attn_varlen_paged(
                q, k_cache, v_cache, query_start_loc, seq_lens, table, n, scale, config
            )
        )

    def ours_in_chunks(config):  # the launches the engine makes: chunk i attends to 0 … its end
        starts = range(0, n, ENGINE_CHUNK)
        ends = [min(n, start + ENGINE_CHUNK) for start in starts]
        lens = [torch.tensor([end], device=dev, dtype=torch.int32) for end in ends]
        locs = [torch.tensor([0, end - start], device=dev, dtype=torch.int32)
                for start, end in zip(starts, ends, strict=True)]  # fmt: skip

        # as wide as the engine's table at that step: its width picks the launch order
        tables = [table[:, : triton.cdiv(end, BLOCK_SIZE)] for end in ends]

        def launches():
            for start, end, loc, seq_len, t in zip(starts, ends, locs, lens, tables, strict=True):
                flash_attn_varlen_paged(
                    q[start:end], k_cache, v_cache, loc, seq_len, t, end - start, scale, config
                )

        return do_bench(launches)

    default = default_prefill_config(HEAD_DIM, q.device)
    ours_ms = ours(default)
    levers_off = {name: ours(replace(default, **change)) for name, change in LEVERS.items()}
    tiles = None
    if sweep:
        tiles = []
        for change in TILE_SWEEP:
            config = replace(default, **change)
            try:
                tiles.append({"config": config.__dict__, "ms": ours(config)})
            except Exception as e:  # a tile past the shared memory: recorded, not fatal
                tiles.append({"config": config.__dict__, "error": f"{type(e).__name__}: {e}"[:200]})
    chunked = None
    if n > ENGINE_CHUNK:
        chunked = {"chunk_tokens": ENGINE_CHUNK, "ours_ms": ours_in_chunks(default)}
        for name, change in LEVERS.items():
            chunked[f"ours_ms, {name}"] = ours_in_chunks(replace(default, **change))
    qs = q.transpose(0, 1)[None]  # [1, H, N, D]
    ks = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)[None].contiguous()
    vs = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)[None].contiguous()
    sdpa_ms = do_bench(
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    )
    flops = attention_flops(n)
    return {
        "tokens": n,
        "ours_ms": ours_ms,
        "ours_TFLOPs": flops / ours_ms / 1e9,
        "sdpa_ms": sdpa_ms,
        "sdpa_TFLOPs": flops / sdpa_ms / 1e9,
        "ours_over_sdpa": sdpa_ms / ours_ms,
        "ours_ms_with_one_lever_off": levers_off,
        "ours_in_the_engines_chunks": chunked,  # the same prompt in the engine's launches
        "other_tiles": tiles,
    }


def build_parser():
    return benchmark_parser(__doc__, threads=False)


def main():
    args = parse_args(build_parser())
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    from tests.assets import qwen3_tokenizer_dir

    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    config = default_prefill_config(HEAD_DIM, torch.device("cuda"))
    result = {
        "model": "Qwen3-0.6B shapes (random weights, bf16)",
        "workload": {
            "prompt_lengths": lengths,
            "prompt_ids": f"torch.randint(0, {PROMPT_ID_RANGE}) seeded {PROMPT_SEED}",
            "output": "the first token (max_tokens=1 / logits_to_keep=1)",
            "timing": f"best of {REPEATS} after one untimed run",
            "phase7": "LLM defaults (16,384 batched tokens a step, block size 16), no prefix cache",
        },
        "prefill_config": config.__dict__,
        "goal": "phase 7 >= transformers at every length",
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(Path(tmp), qwen3_tokenizer_dir())
        # transformers first: phase 7 then sizes its KV cache from all the memory it leaves
        theirs, impl = run_transformers(checkpoint, lengths)
        gc.collect()  # the transformers model, if a reference cycle holds it
        torch.cuda.empty_cache()
        ours, engine_ablation = run_phase7(checkpoint, lengths)
    result["baseline"] = f"transformers Qwen3ForCausalLM, attn_implementation={impl}, bf16"
    result["end_to_end"] = [
        {
            "tokens": n,
            "phase7_s": ours[n],
            "phase7_tok_s": n / ours[n],
            "transformers_s": theirs[n],
            "transformers_tok_s": n / theirs[n],
            "phase7_over_transformers": theirs[n] / ours[n],
        }
        for n in lengths
    ]
    result["end_to_end_lever_off"] = engine_ablation
    write_result("phase7_prefill", result, args.out)  # a run cut short keeps what finished
    result["attention_kernel"] = []
    for n in lengths:
        result["attention_kernel"].append(kernel_row(n, sweep=n == lengths[-1]))
        write_result("phase7_prefill", result, args.out)
    ratios = [r["phase7_over_transformers"] for r in result["end_to_end"]]
    result["summary"] = {
        "phase7_over_transformers_by_length": {
            r["tokens"]: round(r["phase7_over_transformers"], 3) for r in result["end_to_end"]
        },
        "kernel_over_sdpa_by_length": {
            r["tokens"]: round(r["ours_over_sdpa"], 3) for r in result["attention_kernel"]
        },
        "goal_met": min(ratios) >= 1.0,
    }
    for row in result["end_to_end"]:
        print(f"{row['tokens']:6d} tokens: phase 7 / transformers = "
              f"{row['phase7_over_transformers']:.3f}")  # fmt: skip
    write_result("phase7_prefill", result, args.out)


if __name__ == "__main__":
    main()
