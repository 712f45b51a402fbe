"""Phase 8 fixtures: a tiny byte-level checkpoint and a live server on a free local port.

The server tests talk HTTP to a real uvicorn server (in a thread of the test process), so
streaming, disconnects and the `openai` client behave as in production. The checkpoint is a
random 1-layer Qwen3 with a byte-level tokenizer of 256 byte tokens plus ChatML's specials: a
vocabulary of 259 keeps sampling and the LM head nearly free on CPU, so hundreds of requests take
seconds. Byte tokens also split every non-ASCII character across tokens, which is what the
streaming tests need.
"""

import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import uvicorn

from phase8_serving import LLM
from phase8_serving.api_server import ServerConfig, build_app
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.engine import LLMEngine

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


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    llm: AsyncLLM
    config: ServerConfig

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    def wait_until_idle(self, timeout: float) -> float:
        """Seconds until the engine holds no request and every KV block is free (or fails)."""
        start = time.perf_counter()
        bm = self.engine.block_manager
        while time.perf_counter() - start < timeout:
            if bm.num_free_blocks == len(bm.blocks) and not self.engine.requests:
                return time.perf_counter() - start
            time.sleep(0.01)
        raise AssertionError(
            f"after {timeout} s: {len(bm.blocks) - bm.num_free_blocks} KV blocks still used, "
            f"requests {list(self.engine.requests)}"
        )


def start_server(app, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread


@pytest.fixture(scope="session")
def live_server(tiny_dir):
    engine = LLM(tiny_dir, dtype="float32", device="cpu", **ENGINE).engine
    llm = AsyncLLM(engine, MODEL_NAME)
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN)
    sock = socket.create_server(("127.0.0.1", 0))
    server, thread = start_server(build_app(llm, config), sock)
    host, port = sock.getsockname()
    yield LiveServer(f"http://{host}:{port}", llm, config)
    server.should_exit = True
    thread.join()
    llm.shutdown()
