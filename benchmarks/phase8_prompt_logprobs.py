"""Phase 8 benchmark: what a prompt's logprobs cost, and that they are the model's.

A request with `prompt_logprobs` (or the server's `echo` with `logprobs`, lm-evaluation-harness's
loglikelihood request) has every prompt position scored: the LM head over each position's hidden
state, a log-softmax normalizer, the prompt token's logprob and rank, the top k. Phase 8 does it
in the steps that compute the prompt, 512 positions per LM-head pass.
Measured, in one run on one engine:
- the values against transformers' forward over the whole prompt in float32 (a random Qwen3 of 4
  layers with Qwen3's 151,936-token vocabulary; the engine in bf16 with CUDA graphs on a GPU,
  float32 on a CPU): logprob errors, the share of ranks within 2 %, the share of top-1 agreement;
- that the other requests of a batch it shares sample the tokens they sample alone;
- the time of a request of one long prompt and one output token, each prompt new to the prefix
  cache, without prompt logprobs (the baseline) and with `prompt_logprobs=5`.
Run: python -m benchmarks.phase8_prompt_logprobs [--quick] [--out DIR] (default DIR: a scratch
     folder; pass --out benchmarks/results to commit). On a CPU the model has one layer and the
     prompts are short.
"""

import random
import tempfile
import time
from pathlib import Path

import torch
import transformers

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase8_serving import LLM, SamplingParams
from tests import assets

QWEN3_SMALL = dict(vocab_size=151936, hidden_size=512, intermediate_size=1536,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                   max_position_embeddings=40960, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
TOP_K = 5
RUNS = 4  # timed runs of each kind; the middle two are kept


def build_parser():
    return benchmark_parser(__doc__)


def main() -> None:
    args = parse_args(build_parser())
    gpu = torch.cuda.is_available()
    small = args.quick or not gpu
    sizes = {"layers": 1 if small else 4, "scored": 600 if small else 3000,
             "long": 800 if small else 8000, "others": 4 if small else 16}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_qwen3(Path(tmp), sizes["layers"])
        payload = measure(model_dir, "cuda" if gpu else "cpu", sizes)
    payload["quick"] = args.quick
    print(f"wrote {write_result('phase8_prompt_logprobs', payload, args.out)}")


def write_random_qwen3(directory: Path, num_layers: int) -> Path:
    config = transformers.Qwen3Config(num_hidden_layers=num_layers, **QWEN3_SMALL)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((assets.qwen3_tokenizer_dir() / name).read_bytes())
    return directory


def measure(model_dir: Path, device: str, sizes: dict) -> dict:
    rng = random.Random(0)
    vocab = QWEN3_SMALL["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(sizes["scored"])]
    others = [[rng.randrange(vocab) for _ in range(rng.randrange(20, 300))]
              for _ in range(sizes["others"])]  # fmt: skip
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference.to(device)(torch.tensor([prompt], device=device)).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)
    del reference, logits
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(str(model_dir), dtype=dtype, device=device)
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(others, plain, use_tqdm=False)]
    scoring = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=TOP_K)
    outputs = llm.generate([prompt, *others], [scoring] + [plain] * len(others), use_tqdm=False)
    scored = outputs[0].prompt_logprobs
    errors, ranks_close, top1 = [], 0, 0
    for i in range(1, len(prompt)):
        want, got = expected[i - 1], scored[i]
        errors.append(abs(got.logprob - want[prompt[i]].item()))
        want_rank = 1 + int((want > want[prompt[i]]).sum())
        ranks_close += abs(got.rank - want_rank) <= max(2, 0.02 * want_rank)
        top1 += got.top_logprobs[0][0] == int(want.argmax())
    n = len(prompt) - 1
    result = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "model": f"random Qwen3, {sizes['layers']} layers, hidden 512, vocab {vocab}, {dtype}",
        "values": {
            "prompt_tokens": len(prompt),
            "entries": len(scored),
            "first_is_none": scored[0] is None,
            "max_abs_logprob_error": max(errors),
            "mean_abs_logprob_error": sum(errors) / n,
            "ranks_within_2_percent": ranks_close / n,
            "top1_agreement": top1 / n,
        },
        "batch_neighbours_unchanged": [o.outputs[0].token_ids for o in outputs[1:]] == alone,
        "long_prompt_tokens": sizes["long"],
    }
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kinds = {
        "without": SamplingParams(max_tokens=1),
        "with_prompt_logprobs": SamplingParams(max_tokens=1, prompt_logprobs=TOP_K),
    }
    for label, params in kinds.items():
        times = []
        for _ in range(RUNS):
            long_prompt = [rng.randrange(vocab) for _ in range(sizes["long"])]  # no cache hit
            sync()
            start = time.perf_counter()
            llm.generate([long_prompt], params, use_tqdm=False)
            sync()
            times.append(time.perf_counter() - start)
        result[f"long_prompt_s_{label}"] = sorted(times)[1:-1]
        print(f"{sizes['long']}-token prompt, {label}: {sorted(times)[1:-1]} s")
    print({k: v for k, v in result["values"].items()})
    return result


if __name__ == "__main__":
    main()
