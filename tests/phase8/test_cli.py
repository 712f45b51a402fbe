"""The `mini-vllm` command: flags derived from EngineConfig, offline generate and chat, and a real
`serve` in a subprocess answering the `openai` client."""

import dataclasses
import os
import re
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from phase8_serving import LLM, SamplingParams, cli, serve
from phase8_serving.api_server import build_app
from phase8_serving.arg_utils import engine_kwargs, vllm_kwargs
from phase8_serving.bench import LATENCY_DEFAULTS, THROUGHPUT_DEFAULTS, fill_device_defaults
from phase8_serving.cli import build_parser, chat, main
from phase8_serving.config import EngineConfig, PreemptionMode, ServerConfig, engine_config
from phase8_serving.engine_core import build_llm, core_info

from .conftest import MAX_MODEL_LEN, MODEL_NAME, wait_for_health

SERVE_STARTUP_S = 120  # import + load on a busy 2-core machine
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


def test_every_engine_config_field_is_a_flag():
    args = build_parser().parse_args(
        ["serve", "m", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--block-size", "8"]
    )
    kwargs = engine_kwargs(args)
    assert set(kwargs) == {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**kwargs)
    assert (config.max_num_seqs, config.block_size, config.enable_prefix_caching) == (3, 8, False)
    assert (serve.serve_model(args), args.host, args.port) == ("m", "127.0.0.1", 8000)


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
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert EngineConfig(**engine_kwargs(args)).kv_cache_dtype == "fp8"


def test_the_serve_flags_take_the_server_settings_defaults_without_the_server():
    """ServerConfig lives beside EngineConfig (config.py), not in api_server.py: the command
    line reads its defaults from there without importing FastAPI, and they are ServerConfig's."""
    code = (
        "import sys; sys.modules['fastapi'] = None\n"  # any import of it fails
        "from phase8_serving.cli import build_parser\n"
        "from phase8_serving.config import ServerConfig\n"
        "args = build_parser().parse_args(['serve'])\n"
        "default = ServerConfig('m', 2)\n"
        "assert args.max_request_body_bytes == default.max_request_body_bytes\n"
        "assert args.max_choices_per_request == default.max_choices_per_request\n"
        "assert args.max_stored_responses == default.max_stored_responses\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_vllm_command_line_runs_and_what_it_cannot_have_is_refused(tiny_dir):
    """vLLM's engine flags that mean nothing here are accepted at the value that asks for
    nothing (`--trust-remote-code` at any), and refused with the reason at any other, before
    anything loads; the server's (`--enable-auto-tool-choice`, `--tool-call-parser hermes`) are
    accepted too (reaching the server: the serve test below)."""
    parse = build_parser().parse_args
    args = parse(["serve", "m", "--trust-remote-code", "--disable-log-stats", "--swap-space", "0",
                  "--quantization", "fp8", "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes"])  # fmt: skip
    assert vllm_kwargs(args)["trust_remote_code"] and vllm_kwargs(args)["swap_space"] == 0
    with pytest.raises(ValueError, match="quantization='fp8' is not supported here"):
        serve.core_spec(args)
    neutral = parse(["serve", str(tiny_dir), "--trust-remote-code", "--max-logprobs", "20"])
    assert serve.core_spec(neutral).config == EngineConfig(**engine_kwargs(neutral))
    for refused in (["--swap-space", "4"], ["--max-logprobs", "100"], ["--enable-lora"]):
        with pytest.raises(SystemExit, match="not supported here"):
            main(["serve", str(tiny_dir), *refused])
        with pytest.raises(SystemExit, match="not supported here"):  # offline: LLM's own check
            main(["generate", "hi", "--model", str(tiny_dir), *refused])
    assert parse(["generate", "hi", "--data-parallel-size", "1"])  # serve's own flag elsewhere
    with pytest.raises(SystemExit):  # argparse names the one parser there is
        parse(["serve", "--tool-call-parser", "mistral"])
    with pytest.raises(SystemExit):  # before the model loads
        parse(["serve", "--root-path", "llm/"])
    origins = parse(["serve", "--allowed-origins", '["https://ui.example"]']).allowed_origins
    assert origins == ["https://ui.example"] and parse(["serve"]).allowed_methods == ["*"]
    with pytest.raises(SystemExit):  # vLLM's spelling is a JSON list
        parse(["serve", "--allowed-origins", "https://ui.example"])


def test_serve_seed_seeds_each_engine_core(tiny_dir):
    """vLLM's `--seed` on serve and engine-core: the engine's random state, which unseeded
    requests draw from (the offline commands' --seed seeds each request)."""
    parse = build_parser().parse_args
    spec = serve.core_spec(parse(["serve", str(tiny_dir), "--seed", "7", "--device", "cpu",
                                  "--dtype", "float32"]))  # fmt: skip
    core = parse(["engine-core", str(tiny_dir), "--address", "tcp://x:1", "--seed", "7"])
    assert spec.seed == 7 and serve.core_spec(core).seed == 7
    torch.manual_seed(0)
    build_llm(spec)
    assert torch.initial_seed() == 7
    with pytest.raises(ValueError, match="--seed must be in"):
        serve.core_spec(parse(["serve", str(tiny_dir), "--seed", "-1"]))
    assert parse(["generate", "hi", "--seed", "3"]).seed == 3  # a request's seed there


def test_the_api_key_comes_from_the_flag_or_vllms_environment_variable(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve.api_key(None) is None and serve.api_key("k") == "k"
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve.api_key(None) == "from-env" and serve.api_key("k") == "k"
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert serve.api_key(None) is None  # set but empty: no key, not the empty key


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert serve.read_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert serve.read_chat_template(TEMPLATE) == TEMPLATE
    assert serve.read_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="no such file"):
        serve.read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        serve.read_chat_template("{% for m in messages %}")


def test_bad_gpu_memory_utilization_is_a_one_line_error(tiny_dir):
    with pytest.raises(SystemExit, match="gpu_memory_utilization must be in"):
        main(["generate", "hi", "--model", str(tiny_dir), "--gpu-memory-utilization", "1.5"])


def test_bad_engine_flag_is_a_one_line_error(tiny_dir):
    with pytest.raises(SystemExit, match="max_num_seqs"):
        main(["generate", "hi", "--model", str(tiny_dir), "--max-num-seqs", "0"])


def test_generate_prints_only_the_reply_to_the_chat_template(tiny_dir, capsys):
    main(["generate", "Hello", "--model", str(tiny_dir), "--dtype", "float32",
          "--max-tokens", "6", "--device", "cpu"])  # fmt: skip
    llm = LLM(tiny_dir, dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    reply = llm.chat([{"role": "user", "content": "Hello"}], greedy, use_tqdm=False)[0].outputs[0]
    marker = f"--- completion 1 of 1 ({len(reply.token_ids)} tokens, finish: {reply.finish_reason})"
    assert capsys.readouterr().out == f"{marker} ---\n{reply.text}\n"  # no prompt echoed


def test_generate_no_chat_completes_the_raw_prompts_and_shows_progress(
    tiny_dir, capsys, monkeypatch
):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the counter shows
    main(["generate", "Hello", "Bye", "--no-chat", "--model", str(tiny_dir), "--dtype",
          "float32", "--max-tokens", "5", "--device", "cpu"])  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    outs = LLM(tiny_dir, dtype="float32", device="cpu").generate(["Hello", "Bye"], greedy)
    out, err = capsys.readouterr()
    texts = out.split("\n")
    assert texts[0].startswith("--- completion 1 of 2") and texts[1] == outs[0].outputs[0].text
    assert "--- completion 2 of 2" in out and "Hello" not in out
    assert "generating" in err and "tokens" in err


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


def fake_replies(*replies):
    """A stand-in for stream_reply: each call streams the next reply; an exception in it is
    raised mid-reply, as Ctrl-C would be. Records the messages each call saw."""
    seen, replies = [], iter(replies)

    def stream(engine, messages, params):
        seen.append([m["content"] for m in messages])
        for piece in next(replies):
            if isinstance(piece, BaseException):
                raise piece
            yield piece

    return stream, seen


def converse_or_fail(read) -> None:
    """The chat loop; a KeyboardInterrupt escaping it would stop pytest itself, so it fails."""
    try:
        cli.converse(None, None, None, read)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the chat loop (a traceback for the user)")


def test_chat_ctrl_c_cancels_the_reply_and_asks_again(monkeypatch, capsys):
    stream, seen = fake_replies(["Hel", KeyboardInterrupt()], ["Fine", "."])
    monkeypatch.setattr(cli, "stream_reply", stream)
    lines = iter(["Hi", "How are you?"])

    def read(prompt):  # a terminal: the prompt shows, then the typed line, then Ctrl-D
        print(prompt, end="")
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    converse_or_fail(read)
    out = capsys.readouterr().out
    assert "> Hel [cancelled]\n> Fine.\n> \n" in out  # Ctrl-D: the shell starts a new line
    assert seen == [["Hi"], ["How are you?"]]  # the cancelled turn is forgotten


def test_chat_ctrl_c_at_the_prompt_ends_quietly(capsys):
    def interrupted(prompt):
        raise KeyboardInterrupt

    converse_or_fail(interrupted)
    assert capsys.readouterr().out.endswith("quits.\n\n")


def test_stopping_a_reply_aborts_its_request(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    deltas = cli.stream_reply(llm, [{"role": "user", "content": "Hi"}], params)
    next(deltas)
    deltas.close()  # what leaving the `with closing(...)` does on Ctrl-C
    assert not engine.has_unfinished_requests() and not llm.processor.states
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.kv_cache_config.num_blocks


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert re.search(r"--max-tokens MAX_TOKENS [\w ]*\(default: 128\)", text)
    assert "--block-size BLOCK_SIZE EngineConfig.block_size (default: 16)" in text
    # a default the engine picks per device says so instead of printing None
    assert "--max-num-seqs MAX_NUM_SEQS EngineConfig.max_num_seqs (default: the device's)" in text
    assert re.search(r"--chat, --no-chat [^(]*\(default: True\)", text)


def test_serve_takes_the_model_as_a_flag_or_positional_and_tp_as_short_flag():
    parse = build_parser().parse_args
    assert serve.serve_model(parse(["serve", "--model", "m"])) == "m"
    assert serve.serve_model(parse(["serve", "m"])) == "m"
    assert serve.serve_model(parse(["serve"])) is None
    with pytest.raises(ValueError, match="two models"):
        serve.serve_model(parse(["serve", "a", "--model", "b"]))
    assert parse(["serve", "-tp", "2"]).tensor_parallel_size == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("mini-vllm ")


def test_bench_sizes_fit_the_device(capsys):
    for device, prompts in (("cpu", 8), ("cuda", 256)):
        args = build_parser().parse_args(["bench", "throughput", "--device", device])
        fill_device_defaults(args, THROUGHPUT_DEFAULTS)
        assert args.num_prompts == prompts
        assert f"on {device}: --num-prompts {prompts}" in capsys.readouterr().out
    args = build_parser().parse_args(["bench", "latency", "--device", "cpu", "--num-iters", "9"])
    fill_device_defaults(args, LATENCY_DEFAULTS)
    assert (args.num_iters, args.output_len) == (9, LATENCY_DEFAULTS["cpu"]["output_len"])


def test_omp_wait_policy_is_passive_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    cli.set_omp_wait_policy(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_command_imports_torch_only_after_setting_the_policy():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: the package and the CLI module
    must not load torch on import."""
    code = "import sys, phase8_serving.cli; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_max_model_len_is_bounded_by_context_and_kv_cache(tiny_dir):
    """What the server's front end enforces (`CoreInfo.max_model_len`) is the engine's own."""
    engine = LLM(tiny_dir, dtype="float32", device="cpu", num_kv_blocks=4, block_size=8).engine
    assert core_info(engine).max_model_len == 32  # 4 blocks of 8 < the 128-token context
    engine = LLM(tiny_dir, dtype="float32", device="cpu", num_kv_blocks=4, block_size=8,
                 max_model_len=16).engine  # fmt: skip
    assert core_info(engine).max_model_len == 16


def test_serve_subcommand_answers_the_openai_client(tiny_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"repetition_penalty": 1.0}')  # neutral
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # free now; the server binds it right after
    command = [sys.executable, "-m", "phase8_serving", "serve", str(tiny_dir), "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
               "--num-kv-blocks", "24", "--enable-prompt-tokens-details",
               "--reasoning-parser", "qwen3", "--enable-server-load-tracking",
               "--enable-force-include-usage", "--root-path", "/llm", "--chat-template",
               TEMPLATE, "--trust-remote-code", "--enable-auto-tool-choice",
               "--max-stored-responses", "0", "--generation-config", str(tmp_path),
               "--allowed-origins", '["https://ui.example"]', "--served-model-name", "tiny",
               "tiny-alias", "--override-generation-config", '{"min_p": 0.0}']  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, server, timeout_s=SERVE_STARTUP_S)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        chunks = list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert all(c.usage for c in chunks) and not chunks[-1].choices  # usage forced
        assert client.models.retrieve("tiny").root == str(tiny_dir)  # the name's checkpoint
        usage = client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage
        assert usage.prompt_tokens_details.cached_tokens == 0  # the flag reached the server
        thinking = {"structured_outputs": {"regex": "<think>[a-z]{2}</think>[a-z]{2}"}}
        message = (
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], extra_body=thinking
            )
            .choices[0]
            .message
        )
        assert len(message.reasoning_content) == 2 and len(message.content) == 2  # so did this
        assert set(httpx.get(url + "/load").json()) == {"server_load"}  # and this
        page = {"origin": "https://ui.example"}  # --allowed-origins
        cors = httpx.get(url + "/v1/models", headers=page).headers["access-control-allow-origin"]
        assert cors == "https://ui.example"
        for prefix in ("", "/llm"):  # --root-path: behind a proxy's prefix, and without it
            assert httpx.get(f"{url}{prefix}/v1/models").json()["data"][0]["id"] == "tiny"
        ids = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
        text = httpx.post(url + "/detokenize", json={"tokens": ids.json()["tokens"]}).json()
        assert text["prompt"] == "[user]Hi"  # --chat-template
        response = client.responses.create(model="tiny-alias", input="Hi", max_output_tokens=2)
        assert response.model == "tiny"  # another --served-model-name; replies carry the first
        assert response.usage.output_tokens >= 1  # the Responses API, not stored:
        assert httpx.get(f"{url}/v1/responses/{response.id}").status_code == 404
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = server.stderr.read().decode()  # vLLM's start-up lines: 24 blocks of 16, context 128
    assert "CPU KV cache size: 384 tokens" in log  # the engine core's own line
    assert "Maximum concurrency for 128 tokens per request: 3.00x" in log
    assert "POST /v1/chat/completions" not in log  # no access log without --enable-log-requests
    assert "KV cache:" in log  # the front end's line: tokens per core, cores
    assert "generation config recommends" in log and "'repetition_penalty': 1.0" in log
    assert "'min_p': 0.0" in log  # --override-generation-config, over the file's


def test_a_deployment_command_line_of_vllms_runs():
    """Flags a `vllm serve` deployment carries: the engine's that change nothing here are taken
    at any value, those that ask for nothing (vLLM's defaults) accepted, the rest refused with
    the reason before anything loads; the server's own parse to what they set."""
    parse = build_parser().parse_args
    line = ["serve", "m", "--disable-custom-all-reduce", "--distributed-executor-backend", "mp",
            "--max-seq-len-to-capture", "8192", "--guided-decoding-backend", "xgrammar",
            "--prefix-caching-hash-algo", "sha256", "--model-impl", "auto",
            "--max-num-partial-prefills", "1", "--disable-log-requests", "--max-log-len", "100",
            "--response-role", "assistant", "--api-server-count", "1",
            "--served-model-name", "qwen", "qwen3-0.6b", "--disable-fastapi-docs",
            "--override-generation-config", '{"temperature": 0.5}',
            "--no-async-scheduling"]  # fmt: skip
    args = parse(line)
    assert engine_config("serve", {**engine_kwargs(args), **vllm_kwargs(args)}, ()) == (
        EngineConfig(async_scheduling=False))  # fmt: skip
    assert args.served_model_name == ["qwen", "qwen3-0.6b"] and args.disable_fastapi_docs
    assert args.override_generation_config == {"temperature": 0.5}
    assert parse(["serve", "--async-scheduling"]).async_scheduling is True  # a switch, not
    assert parse(["serve"]).async_scheduling is None  # a value: "false" would read as True
    for refused, why in ((["--enable-sleep-mode"], "no sleep mode"),
                         (["--max-num-partial-prefills", "2"], "token budget alone"),
                         (["--download-dir", "/data"], "Hugging Face cache")):  # fmt: skip
        args = parse(["serve", "m", *refused])
        with pytest.raises(ValueError, match=why):
            engine_config("serve", {**engine_kwargs(args), **vllm_kwargs(args)}, ())
    for bad in (["--api-server-count", "2"], ["--response-role", "user"],
                ["--override-generation-config", "[1]"],
                ["--async-scheduling", "false"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse(["serve", "m", *bad])


def test_https_with_the_ssl_flags(live_server):
    """--ssl-keyfile and --ssl-certfile reach uvicorn: the server answers over HTTPS, to a
    client that trusts the certificate (tests/phase8/data: a self-signed one for 127.0.0.1 made
    for this test alone, `openssl req -x509 -newkey rsa:2048 -nodes -days 36500 -subj
    /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1,DNS:localhost`)."""
    data = Path(__file__).parent / "data"
    args = build_parser().parse_args(["serve", "--ssl-keyfile", str(data / "localhost.key"),
                                      "--ssl-certfile", str(data / "localhost.crt")])  # fmt: skip
    app = build_app(live_server.llm, ServerConfig(MODEL_NAME, MAX_MODEL_LEN))
    config = serve.uvicorn_config(app, args)
    assert (config.ssl_keyfile, config.ssl_certfile) == (args.ssl_keyfile, args.ssl_certfile)
    url = live_server.host.serve(app, ssl_keyfile=config.ssl_keyfile,
                                 ssl_certfile=config.ssl_certfile)  # fmt: skip
    https = url.replace("http://", "https://")
    verify = ssl.create_default_context(cafile=str(data / "localhost.crt"))
    assert httpx.get(https + "/v1/models", verify=verify).json()["data"][0]["id"] == MODEL_NAME
