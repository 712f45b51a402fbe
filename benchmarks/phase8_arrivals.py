"""Phase 8 benchmark: a second user arrives 1 s into a first user's reply. How long until their
first token?

Offline (`LLM.generate`, the only interface through phase 7) the second request can start only
when the first call returns; behind phase 8's engine core process (`AsyncLLM`, what the server
runs) it is admitted into the running batch at the next step. SmolLM2 (the embedded default),
greedy; the first reply is FIRST_REPLY_TOKENS long, the second user's time to first token is
measured from their arrival. The phase 8 README quotes the full run with --threads 1.
Run: python -m benchmarks.phase8_arrivals [--quick] [--threads 1] [--out DIR]
     (default DIR: a scratch folder; pass --out benchmarks/results to commit)
"""

import argparse
import asyncio
import time

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase8_serving import LLM, SamplingParams
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.default_model import default_model_dir
from phase8_serving.engine_core import EngineCoreSpec

ARRIVAL_DELAY_S = 1.0  # the second user arrives this long after the first
FIRST_REPLY_TOKENS = 48
QUICK_REPLY_TOKENS = 8
FIRST_QUESTION = "Tell me a long story about a dragon."
SECOND_QUESTION = "What is 2+2?"


def chat_ids(llm: LLM, question: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def offline_ttft(llm: LLM, first: list[int], second: list[int], long: SamplingParams) -> float:
    """The second user waits for the first `generate` call, then gets their first token."""
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    arrival = time.perf_counter() + ARRIVAL_DELAY_S
    llm.generate([first], long, use_tqdm=False)
    time.sleep(max(0.0, arrival - time.perf_counter()))  # a short first reply ends before it
    llm.generate([second], one_token, use_tqdm=False)
    return time.perf_counter() - arrival


async def served_ttft(
    engine: AsyncLLM, first: list[int], second: list[int], long: SamplingParams
) -> tuple[float, float]:
    """(the second user's time to first token, the first user's whole reply) behind AsyncLLM."""
    start = time.perf_counter()
    stream = await engine.add_requests("first", [first], [long])

    async def drain() -> float:
        async for _ in stream:
            pass
        return time.perf_counter() - start

    reply = asyncio.create_task(drain())
    await asyncio.sleep(ARRIVAL_DELAY_S)
    arrival = time.perf_counter()
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    async for _ in await engine.add_requests("second", [second], [one_token]):
        ttft = time.perf_counter() - arrival
    return ttft, await reply


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__)


def main() -> None:
    args = parse_args(build_parser())
    llm = LLM()
    first, second = chat_ids(llm, FIRST_QUESTION), chat_ids(llm, SECOND_QUESTION)
    reply_tokens = QUICK_REPLY_TOKENS if args.quick else FIRST_REPLY_TOKENS
    long = SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    llm.generate([second], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # warm
    offline = offline_ttft(llm, first, second, long)
    del llm  # the engine core process builds its own
    spec = EngineCoreSpec(str(default_model_dir()), num_threads=args.threads)
    engine = AsyncLLM.spawn(spec, "smollm2")

    async def served_twice() -> tuple[float, float]:  # one event loop: AsyncLLM lives on it
        await served_ttft(engine, second, second, long)  # warm-up
        return await served_ttft(engine, first, second, long)

    try:
        served, first_reply = asyncio.run(served_twice())
    finally:
        engine.shutdown()
    print(f"second user's time to first token: offline {offline:.2f} s, served {served:.2f} s")
    print(f"the first user's {reply_tokens}-token reply took {first_reply:.2f} s while served")
    payload = {
        "quick": args.quick,
        "workload": {
            "model": "the embedded SmolLM2-135M-Instruct, greedy",
            "questions": [FIRST_QUESTION, SECOND_QUESTION],
            "arrival_delay_s": ARRIVAL_DELAY_S,
            "first_reply_tokens": reply_tokens,
        },
        "second_user_ttft_offline_s": offline,
        "second_user_ttft_served_s": served,
        "first_reply_served_s": first_reply,
    }
    print(f"wrote {write_result('phase8_arrivals', payload, args.out)}")


if __name__ == "__main__":
    main()
