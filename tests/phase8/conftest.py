"""Phase 8 fixtures: a tiny byte-level checkpoint and a live server on a free local port.

The server tests talk HTTP to a real uvicorn server (on an event loop in a thread of the test
process) in front of a real engine core process (spawned, as `mini-vllm serve` spawns it; one for
the whole session, since starting one costs seconds), so streaming, disconnects and the `openai`
client behave as in production. The checkpoint is a
random 1-layer Qwen3 with a byte-level tokenizer of 256 byte tokens plus ChatML's specials: a
vocabulary of 259 keeps sampling and the LM head nearly free on CPU, so hundreds of requests take
seconds. Byte tokens also split every non-ASCII character across tokens, which is what the
streaming tests need.
"""

import asyncio
import concurrent.futures
import json
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from phase8_serving.api_server import build_app
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.config import EngineConfig, ServerConfig
from phase8_serving.core_messages import EngineState
from phase8_serving.engine_core import EngineCoreSpec

from .engine_cores import make_test_llm

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
)
MAX_MODEL_LEN = 48  # small, so a request generated at random ends quickly
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=96, block_size=8)
MODEL_NAME = "tiny"
SEED = 0


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def save_tiny_checkpoint(directory: Path, **config_overrides) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = byte_level_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(SEED)
    settings = {**TINY_CONFIG, "tie_word_embeddings": True, **config_overrides}
    model_config = Qwen3Config(
        vocab_size=tokenizer.get_vocab_size(), eos_token_id=eos_id, **settings
    )
    Qwen3ForCausalLM(model_config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-byte-qwen3"))


class ServerHost:
    """One event loop in a thread, serving any number of uvicorn servers: an `AsyncLLM` lives on
    one loop, so every server (and every test coroutine) that uses it must run on that loop."""

    def __init__(self):
        try:
            import uvloop  # what `mini-vllm serve` runs on, where installed

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[tuple[uvicorn.Server, concurrent.futures.Future]] = []

    def serve(self, app, **uvicorn_config) -> str:
        """Starts a server for `app` on a free local port (with uvicorn's settings, TLS's say);
        returns its base URL."""
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_config))
        done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self.servers.append((server, done))
        while not server.started:
            assert not done.done(), done.result()
            time.sleep(0.01)
        host, port = sock.getsockname()
        return f"http://{host}:{port}"

    def run(self, coroutine, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        for server, done in self.servers:
            server.should_exit = True
            done.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    llm: AsyncLLM
    config: ServerConfig
    host: ServerHost

    def engine_state(self) -> EngineState:
        (state,) = self.host.run(self.llm.engine_state())
        return state

    def wait_until_idle(self, timeout: float) -> float:
        """Seconds until the engine holds no request and every KV block is free (or fails)."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            state = self.engine_state()
            idle = state.num_requests == 0 and state.num_free_blocks == state.num_blocks
            if idle and not self.llm.processor.states:
                return time.perf_counter() - start
            time.sleep(0.01)
        raise AssertionError(
            f"after {timeout} s: {state}; front end still follows {list(self.llm.processor.states)}"
        )


def tiny_core_spec(model_dir: Path, **engine) -> EngineCoreSpec:
    """The tests' engine core: float32 on the CPU, one thread, `engine_cores.make_test_llm`."""
    config = EngineConfig(**{**ENGINE, **engine})
    return EngineCoreSpec(str(model_dir), "float32", "cpu", config, make_llm=make_test_llm,
                          num_threads=1)  # fmt: skip


@pytest.fixture(scope="session")
def live_server(tiny_dir):
    llm = AsyncLLM.spawn(tiny_core_spec(tiny_dir), MODEL_NAME)
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN)
    host = ServerHost()
    try:
        yield LiveServer(host.serve(build_app(llm, config)), llm, config, host)
    finally:
        host.close()
        llm.shutdown()


@pytest.fixture
def http(live_server):
    """An HTTP client of the live server; after the test, nothing may be left running there and
    every KV block must be free."""
    with httpx.Client(base_url=live_server.base_url, timeout=30) as c:
        yield c
    live_server.wait_until_idle(timeout=1.0)


@pytest.fixture
def client(live_server):
    """The `openai` SDK's client of the live server; checked afterwards as `http` is."""
    import openai  # only the tests that talk through the SDK need it

    with openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c
    live_server.wait_until_idle(timeout=1.0)


@pytest.fixture
def sent_params(live_server, monkeypatch) -> list:
    """The `SamplingParams` of every engine request the live server's front end sends during
    the test (what a request's fields became), in order; the requests still run."""
    sent, add = [], live_server.llm.add_requests

    async def spy(request_id, prompts, params, *rest):
        sent.extend(params)
        return await add(request_id, prompts, params, *rest)

    monkeypatch.setattr(live_server.llm, "add_requests", spy)
    return sent


def wait_for_health(url: str, *processes: subprocess.Popen, timeout_s: float = 120) -> None:
    """Polls `url`/health until it answers 200; fails at once if one of `processes` (a server
    started as a command, and whatever it needs) has exited, and after `timeout_s` (import +
    load on a busy 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for process in processes:
            if process.poll() is not None:
                reason = process.stderr.read().decode() if process.stderr else ""
                raise AssertionError(f"{process.args[:4]} exited ({process.returncode}): {reason}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """An error in OpenAI's shape, with this status (and, if given, this `param`)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
