"""Phase 2's sampling filters on a real checkpoint: what they do to a trained model's output.

Phase 2 measured repetition on random weights, where every sampled setting looks alike (the
distribution is near uniform). On a trained model the distribution has a head and a long tail,
and the filters decide how often the tail is drawn. The embedded SmolLM2-135M-Instruct (phase 6's
default model, float32, CPU) answers the same open-ended chat prompts under phase 2's settings
(seeded per request, EOS ends a reply, at most MAX_TOKENS tokens), and for each setting we report:
- repeated 4-grams: share of the reply's 4-grams that already occurred earlier in it;
- distinct tokens: distinct ids / reply length;
- tail draws: share of reply tokens outside the model's 40 most likely next tokens, and mean
  surprise (negative log-probability, nats per token) under the unfiltered distribution at
  temperature 1, both scored by transformers on the same checkpoint (an independent forward pass).
Writes phase6_sampling.json into --out.
Run: python -m benchmarks.phase6_sampling [--quick] [--out DIR] [--threads 2]
"""

import argparse
import statistics

import torch

import phase6_qwen3
from benchmarks.harness import benchmark_parser, parse_args, write_result
from benchmarks.phase2_sampling import CONFIGS, NGRAM, SEED

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a walk through a forest in autumn.",
    "Explain how a bicycle works to a ten-year-old.",
    "Write a letter to a friend about your favourite city.",
]
MAX_TOKENS, QUICK_MAX_TOKENS = 96, 16
QUICK_PROMPTS = 2
TAIL_RANK = 40  # a token outside the model's 40 most likely ones counts as a tail draw


def repeated_ngram_fraction(ids: list[int]) -> float | None:
    """Share of the 4-grams in `ids` seen earlier in `ids`; None if the reply is too short."""
    grams = [tuple(ids[i : i + NGRAM]) for i in range(len(ids) - NGRAM + 1)]
    if not grams:
        return None
    seen, repeats = set(), 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


@torch.inference_mode()
def score(hf_model, prompt_ids: list[int], reply_ids: list[int]) -> tuple[float, float]:
    """(share of reply tokens outside the top TAIL_RANK, mean surprise in nats) at temperature 1."""
    ids = torch.tensor([prompt_ids + reply_ids])
    logprobs = hf_model(ids).logits[0, len(prompt_ids) - 1 : -1].float().log_softmax(-1)
    reply = torch.tensor(reply_ids)
    chosen = logprobs.gather(1, reply[:, None])[:, 0]  # (T,)
    rank = (logprobs > chosen[:, None]).sum(1)  # 0 = the most likely token
    return (rank >= TAIL_RANK).float().mean().item(), -chosen.mean().item()


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.mean(values), 3) if values else None


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__)


def main():
    args = parse_args(build_parser())
    from transformers import AutoModelForCausalLM

    from phase6_qwen3.default_model import default_model_dir

    prompts = PROMPTS[:QUICK_PROMPTS] if args.quick else PROMPTS
    max_tokens = QUICK_MAX_TOKENS if args.quick else MAX_TOKENS
    llm = phase6_qwen3.LLM(dtype="float32")
    tokenizer = llm.get_tokenizer()
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    prompt_ids = [
        tokenizer.encode(tokenizer.apply_chat_template(c, True), add_special_tokens=False)
        for c in conversations
    ]
    rows = []
    for name, kwargs in CONFIGS.items():
        params = [
            phase6_qwen3.SamplingParams(max_tokens=max_tokens, seed=SEED + i, **kwargs)
            for i in range(len(prompts))
        ]
        outs = llm.chat(conversations, params, use_tqdm=False)
        replies = [list(o.outputs[0].token_ids) for o in outs]
        scores = [score(hf_model, p, r) for p, r in zip(prompt_ids, replies, strict=True) if r]
        rows.append(
            {
                "config": name,
                "repeated_4gram_fraction": mean([repeated_ngram_fraction(r) for r in replies]),
                "distinct_token_fraction": mean([len(set(r)) / len(r) for r in replies if r]),
                "tail_draw_fraction": mean([s[0] for s in scores]),
                "surprise_nats_per_token": mean([s[1] for s in scores]),
                "mean_reply_tokens": mean([len(r) for r in replies]),
                "example": outs[0].outputs[0].text[:300],
            }
        )
        r = rows[-1]
        print(
            f"{name:30s} repeated 4-grams {r['repeated_4gram_fraction']}, distinct "
            f"{r['distinct_token_fraction']}, outside top-{TAIL_RANK} {r['tail_draw_fraction']}, "
            f"surprise {r['surprise_nats_per_token']} nats, {r['mean_reply_tokens']} tokens"
        )
    path = write_result(
        "phase6_sampling",
        {
            "quick": args.quick,
            "workload": {
                "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized), float32",
                "prompts": prompts,
                "max_tokens": max_tokens,
                "seeds": f"{SEED} + prompt index",
                "stop": "EOS (the model's own end of reply) or max_tokens",
                "tail_rank": TAIL_RANK,
                "scoring": "transformers forward on the same checkpoint, temperature 1, no filter",
            },
            "settings": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
