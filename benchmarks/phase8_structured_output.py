"""Phase 8 benchmark: what structured outputs cost a batch, against the same batch without them.

A request under a grammar (structured_output.py) has its mask built on the host each step (its
matcher reads the new token, the mask comes from a per-stack cache or a walk of the vocabulary's
trie) and applied on the device. Measured, in one run on one engine, the same prompts, seeds,
batch and max_tokens on every row:
- `none`: no grammar (ignore_eos, so every request runs to max_tokens);
- `json_object` and `schema` (an object of a string, an integer, a boolean and an array), each
  twice: `cold`, the first batch of that grammar (the vocabulary's byte trie is built by the
  engine's first grammar, and every mask is new), then `warm`, new seeds (new documents, the
  caches kept), twice (`warm again`), each beside the same batch with the masks applied by the
  torch chain the one-pass kernel replaced (`, torch chain`: the kernel's ablation; on a CPU
  both rows run the torch chain).
Every row ignores EOS (a completed document is followed by EOS tokens, which its grammar then
allows alone), so every batch runs all its requests to max_tokens: the same steps, the same batch
sizes, on both sides. One untimed batch first compiles the kernels; `none` is measured first and
last. On a GPU the model is Qwen3-0.6B's shape
in bf16 with CUDA graphs and overlap scheduling; on a CPU a 2-layer model with Qwen3's vocabulary.
Each row also splits the host's time per step (`host_ms_per_step`, timers around the engine's
parts): the whole step, scheduling, preparing inputs, queueing the forward, sampling (the masking
in it: the matchers reading tokens and taking masks, the wait for the previous step's tokens,
and the rest, which sends the masks to the device and applies them), and reading the previous
step's outputs.
`--seeds-only` runs only `none`, with a seed on every row and with none, alternating three times
each (phase8_structured_output_seeds.json): what per-request seeds cost a batch (a seeded row's
noise is keyed by its seed: sampling.py).
`--host-costs` measures only the host's side, no model (phase8_structured_output_host.json):
building Qwen3's vocabulary as bytes, a JSON string's first mask, the first mask of `.*x` (a walk
that runs out of budget), a mask of an ambiguous grammar (`AMBIGUOUS` after 60 letters: a stack
for every way to have read them), and a warm step of 64 json_object rows replayed (each row
reads its token and takes its mask; the masks stacked, as the runner does).
Run: python -m benchmarks.phase8_structured_output [--quick] [--seeds-only] [--host-costs]
[--out DIR]
"""

import collections
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase8_serving import LLM, SamplingParams, StructuredOutputsParams
from phase8_serving.model_runner import SampledTokens
from phase8_serving.structured_output import GrammarMatcher
from tests import assets

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "count": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "count", "ok"],
}
AMBIGUOUS = 'root ::= x{0,100} "b"\nx ::= [a-z] | [a-z][a-z]'  # each x one letter or two
CPU_MODEL = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--host-costs", action="store_true", help="only the host's mask costs")
    parser.add_argument(
        "--seeds-only", action="store_true", help="only no grammar, seeded and unseeded"
    )
    return parser


def main() -> None:
    args = parse_args(build_parser())
    if args.host_costs:
        payload = host_costs()
        print(json.dumps(payload, indent=1))
        print(f"wrote {write_result('phase8_structured_output_host', payload, args.out)}")
        return
    gpu = torch.cuda.is_available()
    batch, max_tokens = (64, 128) if gpu and not args.quick else (8, 32)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp), gpu)
        llm = LLM(str(model_dir), device="cuda" if gpu else "cpu",
                  dtype="bfloat16" if gpu else "float32")  # fmt: skip
        prompts = [f"Describe item {i} as JSON:" for i in range(batch)]
        runner = llm.engine.runner
        run(llm, prompts, max_tokens, None, seed=0)  # compiles and tunes the kernels: untimed
        if args.seeds_only:
            return seeds_only(llm, prompts, max_tokens, batch, args.out)
        rows = {"none": run(llm, prompts, max_tokens, None, seed=0)}
        for name, spec in (("json_object", {"json_object": True}), ("schema", {"json": SCHEMA})):
            rows[f"{name} cold"] = run(llm, prompts, max_tokens, spec, seed=1000)
            # warm, alternating the masks' kernel with the torch chain it replaced (ablation)
            # a seed's first batch fills the grammar's step memo, which the second then finds
            # full: each side goes first once
            for seed, kernel in ((2000, True), (2000, False), (3000, False), (3000, True)):
                runner.grammar_mask_kernel = kernel
                label = f"{name} warm{' again' * (seed == 3000)}{'' if kernel else ', torch chain'}"
                rows[label] = run(llm, prompts, max_tokens, spec, seed=seed)
            runner.grammar_mask_kernel = True
        rows["none again"] = run(llm, prompts, max_tokens, None, seed=0)
    base = (rows["none"]["tok_s"] + rows["none again"]["tok_s"]) / 2
    for name, row in rows.items():
        row["vs_none"] = round(row["tok_s"] / base, 3)
        print(f"{name:34s} {row['tok_s']:9.0f} tok/s  {row['vs_none']:.3f}x  "
              f"complete JSON {row['valid_json']}/{row['documents']}  "
              f"mask {row['mask_host_ms_per_step']} ms/step", flush=True)  # fmt: skip
    ablation = {}  # the one-pass kernel's tok/s over the torch chain's, warm batches paired
    for name in ("json_object", "schema"):
        kernel = [rows[f"{name} warm{a}"]["tok_s"] for a in ("", " again")]
        chain = [rows[f"{name} warm{a}, torch chain"]["tok_s"] for a in ("", " again")]
        ablation[name] = round(sum(kernel) / sum(chain), 3)
        print(f"{name}: mask kernel / torch chain = {ablation[name]}")
    device = torch.cuda.get_device_name() if gpu else "cpu"
    payload = {"device": device, "batch": batch, "max_tokens": max_tokens, "schema": SCHEMA,
               "rows": rows, "mask_kernel_over_torch_chain": ablation,
               "quick": args.quick}  # fmt: skip
    print(f"wrote {write_result('phase8_structured_output', payload, args.out)}")


def seeds_only(llm: LLM, prompts: list[str], max_tokens: int, batch: int, out) -> None:
    rows = collections.defaultdict(list)
    for _ in range(3):
        for label, seed in (("seeded", 0), ("unseeded", None)):
            rows[label].append(run(llm, prompts, max_tokens, None, seed=seed))
    tok_s = {label: [r["tok_s"] for r in runs] for label, runs in rows.items()}
    ratio = round(sum(tok_s["seeded"]) / sum(tok_s["unseeded"]), 3)
    for label, runs in rows.items():
        sample_ms = [r["host_ms_per_step"]["sample"] for r in runs]
        print(f"{label:9s} {tok_s[label]} tok/s, sampling {sample_ms} host ms/step", flush=True)
    print(f"seeded / unseeded: {ratio}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    payload = {"device": device, "batch": batch, "max_tokens": max_tokens, "rows": dict(rows),
               "seeded_over_unseeded": ratio}  # fmt: skip
    print(f"wrote {write_result('phase8_structured_output_seeds', payload, out)}")


def host_costs(rows: int = 64, steps: int = 100) -> dict:
    import random

    import numpy as np

    from phase8_serving import structured_output as so
    from phase8_serving.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(assets.qwen3_tokenizer_dir())
    eos = frozenset(tokenizer.eos_token_ids)
    start = time.perf_counter()
    vocab = so.Vocabulary.from_tokenizer(tokenizer, CPU_MODEL["vocab_size"])
    result = {"vocabulary_s": time.perf_counter() - start}
    string = so.Grammar(so.compile_json_schema({"type": "string"}), vocab)
    in_string = string.advance(string.start, ord('"'))
    start = time.perf_counter()
    string.mask(in_string)
    result["first_string_mask_s"] = time.perf_counter() - start
    anything = so.Grammar(so.compile_regex(r".*x"), vocab)
    start = time.perf_counter()
    anything.mask(anything.start)
    result["first_dot_star_mask_s"] = time.perf_counter() - start
    # an ambiguous grammar: after 60 letters, a stack for each way x{0,100} may have read them
    ambiguous = so.Grammar(so.compile_grammar(AMBIGUOUS), vocab)
    state = ambiguous.start
    for _ in range(60):
        state = ambiguous.advance(state, ord("a"))
    start = time.perf_counter()
    ambiguous.mask(state)
    result["ambiguous_grammar_mask_s"] = time.perf_counter() - start
    result["ambiguous_grammar_stacks"] = len(state)
    cache = so.GrammarCache(lambda: vocab)
    rng, outputs = random.Random(0), [[] for _ in range(rows)]
    matchers = [cache.matcher("json_object", True) for _ in range(rows)]
    for _ in range(steps):  # random documents; every mask they need is now cached
        for matcher, out in zip(matchers, outputs, strict=True):
            matcher.read(out, eos)
            allowed = so.unpack_masks(matcher.mask(eos), vocab.vocab_size)
            out.append(int(rng.choice(np.flatnonzero(allowed))))
    matchers = [cache.matcher("json_object", True) for _ in range(rows)]
    start = time.perf_counter()
    for step in range(steps):
        masks = []
        for matcher, out in zip(matchers, outputs, strict=True):
            matcher.read_new(out[step : step + 1], eos)
            masks.append(matcher.mask(eos))
        np.stack(masks)
    seconds = time.perf_counter() - start
    result.update(rows=rows, warm_step_ms=1e3 * seconds / steps,
                  warm_row_us=1e6 * seconds / steps / rows)  # fmt: skip
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def write_model(directory: Path, gpu: bool) -> Path:
    if gpu:
        from benchmarks.phase6_qwen3_gpu import save_checkpoint

        return save_checkpoint(directory, assets.qwen3_tokenizer_dir())
    import shutil

    import transformers

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CPU_MODEL)).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.qwen3_tokenizer_dir() / name, directory / name)
    return directory


def run(llm: LLM, prompts: list[str], max_tokens: int, spec: dict | None, seed: int | None) -> dict:
    """One batch, request i seeded with seed + i (seed None: no seeds)."""
    params = [
        SamplingParams(temperature=1.0, seed=None if seed is None else seed + i,
                       max_tokens=max_tokens, ignore_eos=True,
                       structured_outputs=None if spec is None else StructuredOutputsParams(**spec))
        for i in range(len(prompts))
    ]  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    with host_timers(llm) as (parts, calls):
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = max(calls["step"], 1)
    parts["masking: the rest"] = (parts["masking"] - parts["masking: matchers"]
                                  - parts["masking: the previous step's tokens"])  # fmt: skip
    host_ms = {k: round(1e3 * v / steps, 3) for k, v in sorted(parts.items())}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    texts = [o.outputs[0].text for o in outs] if spec is not None else []
    valid = 0
    for text in texts:
        try:
            json.loads(text)
            valid += 1
        except json.JSONDecodeError:
            pass
    return {"seconds": round(seconds, 4), "tokens": tokens, "tok_s": round(tokens / seconds, 1),
            "documents": len(texts), "valid_json": valid,
            # the host's time in masking per step (it waits there for the previous step's
            # token under overlap scheduling, and walks the grammar)
            "mask_host_ms_per_step": round(1e3 * parts["masking"] / max(calls["masking"], 1), 3),
            "engine_steps": steps,
            "host_ms_per_step": host_ms}  # fmt: skip


@contextlib.contextmanager
def host_timers(llm: LLM):
    """Seconds spent in the engine's parts (timers around its methods) while the block runs,
    and the calls of each. A timer costs ~1 µs a call, on both sides of the comparison."""
    parts, calls = collections.defaultdict(float), collections.Counter()
    inside = set()  # the labels whose methods are running
    engine, runner = llm.engine, llm.engine.runner
    targets = [(llm, "step", "step"), (engine.scheduler, "schedule", "schedule"),
               (runner, "prepare", "prepare inputs"), (runner, "forward", "queue forward"),
               (runner, "sample", "sample"), (runner, "_keep_grammar_tokens", "masking"),
               (engine, "_process", "read outputs"),
               (llm.processor, "process_outputs", "read outputs: text"),
               (GrammarMatcher, "read_new", "masking: matchers"),
               (GrammarMatcher, "mask", "masking: matchers"),
               (SampledTokens, "tolist", "tokens to the host")]  # fmt: skip
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in targets]

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            inside.add(label)
            try:
                return fn(*args, **kwargs)
            finally:
                inside.discard(label)
                spent = time.perf_counter() - begin
                if label == "tokens to the host":  # only the masking's wait for them
                    parts["masking: the previous step's tokens"] += spent * ("masking" in inside)
                else:
                    parts[label] += spent
                calls[label] += 1

        return wrapper

    for obj, name, label in targets:
        setattr(obj, name, timed(getattr(obj, name), label))
    try:
        yield parts, calls
    finally:
        for obj, name, original in saved:
            if original is None:
                delattr(obj, name)  # an instance's method again
            else:
                setattr(obj, name, original)


if __name__ == "__main__":
    main()
