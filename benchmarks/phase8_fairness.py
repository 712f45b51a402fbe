"""Phase 8 benchmark: a second user asks a short question while a first user's request of n=16
long choices runs. How long until their first token?

Behind phase 8's engine core (`AsyncLLM`, what the server runs), the 16 choices of one request
share a group and the scheduler shares the engine fairly between requests: the second user's
chat is admitted at the next step, even when the choices fill every running slot
(`max_num_seqs` = 16 here, the CPU's default). The same 16 sequences sent as 16 requests of one
choice each are what phase 7's first come, first served saw: the chat then waits for a slot, that
is for the choices to finish. The embedded SmolLM2, greedy, `ignore_eos`; the chat arrives
ARRIVAL_DELAY_S after the big request, its time to first token is measured from its arrival.
Run: python -m benchmarks.phase8_fairness [--quick] [--threads 1] [--big-tokens N] [--qwen3]
     [--out DIR] (default DIR: a scratch folder; pass --out benchmarks/results to commit). On a
     GPU, `--qwen3 --big-tokens 8000`: Qwen3-0.6B's shapes with random weights (no download),
     and a huge request, 16 choices of 8,000 tokens.
"""

import asyncio
import tempfile
import time
from pathlib import Path

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase8_serving import SamplingParams
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.config import EngineConfig
from phase8_serving.default_model import default_model_dir
from phase8_serving.engine_core import EngineCoreSpec

N = 16  # the first user's choices; the engine runs 16 sequences at once
MAX_NUM_SEQS = 16
BIG_TOKENS = 64  # each choice's reply
QUICK_BIG_TOKENS = 12
ARRIVAL_DELAY_S = 1.0  # the chat arrives this long after the big request
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids: what they say does not matter
CHAT_PROMPT = [9, 10, 11, 12]


async def chat_ttft(engine: AsyncLLM, grouped: bool, big_tokens: int) -> tuple[float, float]:
    """(the chat's time to first token, the big request's whole run) with the N choices sent as
    one request (`grouped`) or as N requests of one choice each."""
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=big_tokens, ignore_eos=True)
    if grouped:
        streams = [await engine.add_requests("big", [PROMPT] * N, [params] * N)]
    else:
        streams = [await engine.add_requests(f"big{i}", [PROMPT], [params]) for i in range(N)]

    async def drain(stream) -> float:
        async for _ in stream:
            pass
        return time.perf_counter() - start

    big = [asyncio.create_task(drain(s)) for s in streams]
    await asyncio.sleep(ARRIVAL_DELAY_S)
    arrival = time.perf_counter()
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    async for _ in await engine.add_requests("chat", [CHAT_PROMPT], [one_token]):
        ttft = time.perf_counter() - arrival
    return ttft, max(await asyncio.gather(*big))


def build_parser():
    parser = benchmark_parser(__doc__)
    default = f"default {BIG_TOKENS}, {QUICK_BIG_TOKENS} with --quick"
    parser.add_argument("--big-tokens", type=int, help=f"each choice's reply ({default})")
    parser.add_argument("--qwen3", action="store_true",
                        help="Qwen3-0.6B's shapes, random weights, instead of SmolLM2")  # fmt: skip
    return parser


def main() -> None:
    args = parse_args(build_parser())
    big_tokens = args.big_tokens or (QUICK_BIG_TOKENS if args.quick else BIG_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        if args.qwen3:  # what phase8_serving.py serves: config.json and the tokenizer
            from benchmarks.phase8_serving import QWEN3_0_6B, write_checkpoint
            from tests import assets

            model = write_checkpoint(Path(tmp), QWEN3_0_6B, assets.qwen3_tokenizer_dir())
            config = EngineConfig(max_num_seqs=MAX_NUM_SEQS, load_format="dummy")
        else:
            model, config = default_model_dir(), EngineConfig(max_num_seqs=MAX_NUM_SEQS)
        spec = EngineCoreSpec(str(model), config=config, num_threads=args.threads)
        engine = AsyncLLM.spawn(spec, "qwen3" if args.qwen3 else "smollm2")
        payload = measure_engine(engine, big_tokens)
    payload["workload"]["model"] = (
        "Qwen3-0.6B shapes, random weights" if args.qwen3 else "the embedded SmolLM2-135M-Instruct"
    ) + ", greedy, ignore_eos"
    payload["quick"] = args.quick
    print(f"wrote {write_result('phase8_fairness', payload, args.out)}")


def measure_engine(engine: AsyncLLM, big_tokens: int) -> dict:
    """The chat's TTFT beside the big request, grouped and as N requests; the engine shut down."""

    async def measure() -> dict:  # one event loop: AsyncLLM lives on it
        await chat_ttft(engine, True, 2)  # warm-up
        results = {}
        for name, grouped in (("fair", True), ("first_come_first_served", False)):
            ttft, run = await chat_ttft(engine, grouped, big_tokens)
            print(f"{name}: the chat's first token after {ttft:.2f} s; the big request {run:.2f} s")
            results[name] = {"chat_ttft_s": ttft, "big_request_s": run}
        return results

    try:
        results = asyncio.run(measure())
    finally:
        engine.shutdown()
    return {
        "workload": {
            "n": N,
            "big_tokens": big_tokens,
            "max_num_seqs": MAX_NUM_SEQS,
            "arrival_delay_s": ARRIVAL_DELAY_S,
            "first_come_first_served": f"the same {N} sequences as {N} requests of one choice",
        },
        **results,
    }


if __name__ == "__main__":
    main()
