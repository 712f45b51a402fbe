"""The server on the GPU (`pytest -m gpu tests/phase8` on the H200): Qwen3-0.6B shapes with dummy
weights (`load_format="dummy"`: config.json and the real tokenizer, seeded random weights), bf16,
CUDA graphs, an engine core process in front of which the HTTP server runs as in production.

- 64 concurrent streams complete, each with exactly the tokens it asked for (ignore_eos);
- a greedy request's token ids through the server equal the offline engine's (same seeded
  weights, same engine flags, the request alone in both: the same kernels on the same shapes);
- a client that hangs up mid-stream has its blocks freed at once.
"""

import asyncio
import json
import random
import time

import httpx
import pytest

from phase8_serving import LLM, SamplingParams
from phase8_serving.api_server import build_app
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.config import EngineConfig, ServerConfig
from phase8_serving.engine_core import EngineCoreSpec
from tests import assets

from .conftest import ServerHost

pytestmark = pytest.mark.gpu
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=4096, num_kv_blocks=8192,
              load_format="dummy")  # fmt: skip
MAX_MODEL_LEN = 4096
NUM_STREAMS = 64
NAME = "qwen3-dummy"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import shutil

    from transformers import Qwen3Config

    directory = tmp_path_factory.mktemp("qwen3-0.6b-dummy")
    Qwen3Config(**QWEN3_0_6B).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.qwen3_tokenizer_dir() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def gpu_server(checkpoint):
    spec = EngineCoreSpec(str(checkpoint), "bfloat16", "cuda", EngineConfig(**ENGINE))
    llm = AsyncLLM.spawn(spec, NAME)
    host = ServerHost()
    try:
        yield host, llm, host.serve(build_app(llm, ServerConfig(NAME, MAX_MODEL_LEN)))
    finally:
        host.close()
        llm.shutdown()


def wait_until_idle(host: ServerHost, llm: AsyncLLM, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        (state,) = host.run(llm.engine_state())
        if state.num_requests == 0 and state.num_free_blocks == state.num_blocks:
            return
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {state}"
        time.sleep(0.01)


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    usage, reason = None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                if chunk["choices"]:
                    reason = chunk["choices"][0]["finish_reason"] or reason
    return usage["completion_tokens"], reason


def test_64_concurrent_streams_get_their_token_counts(gpu_server):
    host, llm, url = gpu_server
    rng = random.Random(0)
    requests = [([rng.randrange(10000) for _ in range(rng.randrange(10, 600))],
                 rng.randrange(20, 300)) for _ in range(NUM_STREAMS)]  # fmt: skip

    async def main():
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, p, m) for p, m in requests))

    results = asyncio.run(main())
    assert results == [(m, "length") for _, m in requests]
    wait_until_idle(host, llm, timeout=5)


def test_greedy_ids_equal_the_offline_engine(gpu_server, checkpoint):
    host, llm, _ = gpu_server
    prompt = [random.Random(1).randrange(10000) for _ in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def served() -> list[int]:
        stream = await llm.add_requests("greedy", [prompt], [params])
        ids = []
        async for deltas in stream:
            ids += deltas[0].token_ids
        return ids

    served_ids = host.run(served())
    offline = LLM(checkpoint, dtype="bfloat16", device="cuda", **ENGINE)
    try:
        offline_ids = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        offline.shutdown()
    assert served_ids == offline_ids


def test_a_hang_up_frees_its_blocks(gpu_server):
    host, llm, url = gpu_server
    body = {"prompt": list(range(100, 400)), "max_tokens": 3000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            (state,) = host.run(llm.engine_state())
            assert state.num_free_blocks < state.num_blocks
    hung_up = time.monotonic()
    wait_until_idle(host, llm, timeout=2)
    assert time.monotonic() - hung_up < 2
