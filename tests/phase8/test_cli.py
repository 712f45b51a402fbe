"""The `mini-vllm` command: flags derived from EngineConfig, offline generate and chat, and a real
`serve` in a subprocess answering the `openai` client."""

import dataclasses
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from phase8_serving import LLM, SamplingParams
from phase8_serving.cli import build_parser, chat, engine_kwargs, main, resolve_max_model_len
from phase8_serving.config import EngineConfig, PreemptionMode

SERVE_STARTUP_S = 120  # import + load on a busy 2-core machine


def test_every_engine_config_field_is_a_flag():
    args = build_parser().parse_args(
        ["serve", "m", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--block-size", "8"]
    )
    kwargs = engine_kwargs(args)
    assert set(kwargs) == {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**kwargs)
    assert (config.max_num_seqs, config.block_size, config.enable_prefix_caching) == (3, 8, False)
    assert (args.model, args.host, args.port) == ("m", "127.0.0.1", 8000)


def test_phase7_engine_flags_reach_the_config():
    args = build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "2", "--load-format", "dummy", "--enforce-eager",
         "--preemption-mode", "recompute"]
    )  # fmt: skip
    config = EngineConfig(**engine_kwargs(args))
    assert (config.tensor_parallel_size, config.load_format, config.enforce_eager) == (
        2, "dummy", True,
    )  # fmt: skip
    assert config.preemption_mode == PreemptionMode.RECOMPUTE
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["serve", "--preemption-mode", "drop"])


def test_kv_cache_flags_reach_the_config():
    config = EngineConfig(**engine_kwargs(build_parser().parse_args(["serve"])))
    # sized at start-up, the device's default, vLLM's default
    assert (config.num_kv_blocks, config.max_num_seqs, config.gpu_memory_utilization) == (
        None, None, 0.9,
    )  # fmt: skip
    args = ["serve", "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "4096"]
    config = EngineConfig(**engine_kwargs(build_parser().parse_args(args)))
    assert (config.gpu_memory_utilization, config.kv_cache_memory_bytes) == (0.5, 4096)
    for flag in ("--num-kv-blocks", "--num-gpu-blocks-override"):  # ours, and vLLM's name
        config = EngineConfig(**engine_kwargs(build_parser().parse_args(["serve", flag, "7"])))
        assert config.num_kv_blocks == 7


def test_bad_gpu_memory_utilization_is_a_one_line_error(tiny_dir):
    with pytest.raises(SystemExit, match="gpu_memory_utilization must be in"):
        main(["generate", "hi", "--model", str(tiny_dir), "--gpu-memory-utilization", "1.5"])


def test_bad_engine_flag_is_a_one_line_error(tiny_dir):
    with pytest.raises(SystemExit, match="max_num_seqs"):
        main(["generate", "hi", "--model", str(tiny_dir), "--max-num-seqs", "0"])


def test_generate_prints_the_greedy_completion(tiny_dir, capsys):
    main(["generate", "Hello", "--model", str(tiny_dir), "--dtype", "float32",
          "--max-tokens", "6", "--device", "cpu"])  # fmt: skip
    expected = LLM(tiny_dir, dtype="float32", device="cpu").generate(
        ["Hello"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
    )[0]
    assert "Hello" + expected.outputs[0].text in capsys.readouterr().out


def test_chat_streams_the_reply_and_keeps_the_history(tiny_dir, capsys):
    args = build_parser().parse_args(
        ["chat", "--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu",
         "--temperature", "0", "--max-tokens", "5"]
    )  # fmt: skip
    lines = iter(["Hi", "And again?", ""])
    chat(args, read=lambda prompt: next(lines))
    out = capsys.readouterr().out
    llm = LLM(tiny_dir, dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    first = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)[0]
    reply = first.outputs[0].text
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply},
               {"role": "user", "content": "And again?"}]  # fmt: skip
    second = llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    assert reply + "\n" in out and second + "\n" in out


def test_max_model_len_is_bounded_by_context_and_kv_cache(tiny_dir):
    engine = LLM(tiny_dir, dtype="float32", device="cpu", num_kv_blocks=4, block_size=8).engine
    assert resolve_max_model_len(engine, None) == 32  # 4 blocks of 8 < the 128-token context
    assert resolve_max_model_len(engine, 16) == 16
    with pytest.raises(ValueError, match="max-model-len"):
        resolve_max_model_len(engine, 33)


def test_serve_subcommand_answers_the_openai_client(tiny_dir):
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # free now; the server binds it right after
    command = [sys.executable, "-m", "phase8_serving", "serve", str(tiny_dir), "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
               "--num-kv-blocks", "24"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_STARTUP_S
        while True:
            assert server.poll() is None, server.stderr.read().decode()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        assert [c.choices[0].finish_reason for c in stream][-1] in ("stop", "length")
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = server.stderr.read().decode()  # vLLM's start-up lines: 24 blocks of 16, context 128
    assert "CPU KV cache size: 384 tokens" in log
    assert "Maximum concurrency for 128 tokens per request: 3.00x" in log
