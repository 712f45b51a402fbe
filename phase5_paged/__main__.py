"""Demo: `python -m phase5_paged` runs the phase 5 engine end to end on CPU in seconds.

A seeded TinyTransformer (random weights, so the text is gibberish: the point is the engine, not
the words) and a small BPE tokenizer trained on the paragraphs below go into `LLM`; a few prompts
of different lengths and sampling settings are generated together with continuous batching, and
the outputs and the throughput are printed. Phase 6 moves the main job to a real model.
"""

import time

import torch

from . import LLM, BPETokenizer, ModelConfig, SamplingParams, TinyTransformer

SEED = 0
VOCAB_SIZE = 512  # = ModelConfig().vocab_size: the tokenizer's ids must index the embedding
EOS = "<|endoftext|>"
CORPUS = """\
An inference engine turns a trained model into a service. It receives prompts, turns them into
tokens, runs the model one step at a time, and streams the new tokens back as text.

The first engines ran one request at a time and recomputed the whole sequence at every step.
A key-value cache keeps what attention has already computed, so each new token costs one step
instead of a pass over the entire history.

Batching shares the weights between requests: reading the weights once serves every sequence in
the batch. Continuous batching goes further: a request joins the batch as soon as a slot frees
up, and leaves it the moment it is done, so no slot sits idle waiting for the longest request.

When memory runs out, the scheduler preempts the newest request, frees its cache, and computes
it again later. Long prompts are split into chunks, so one big prefill never stalls the decodes
of everyone else.
"""
PROMPTS = [
    "The scheduler",
    "A key-value cache keeps",
    "Continuous batching goes further: a request joins the batch",
    "When memory runs out,",
]


def main() -> None:
    tokenizer = BPETokenizer.train([CORPUS], vocab_size=VOCAB_SIZE, special_tokens=[EOS])
    torch.manual_seed(SEED)  # same seed, same weights as in every other phase
    model = TinyTransformer(ModelConfig(vocab_size=VOCAB_SIZE))
    llm = LLM(model, tokenizer, eos_token_id=tokenizer.token_to_id(EOS), max_num_seqs=4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=48),  # greedy
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=1),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=32, seed=2),
        SamplingParams(temperature=0.7, min_p=0.05, max_tokens=64, seed=3),
    ]

    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    for out in outputs:
        completion = out.outputs[0]
        print(f"{out.prompt!r} -> {completion.text!r}")
        print(f"    {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    num_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(
        f"{len(outputs)} requests, {num_tokens} output tokens in {elapsed:.2f} s "
        f"= {num_tokens / elapsed:.0f} tok/s"
    )
    print("(random weights: the text is noise; the batching, caching and sampling are real)")


if __name__ == "__main__":
    main()
