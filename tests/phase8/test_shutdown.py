"""`--shutdown-timeout` (vLLM's flag): after SIGTERM, requests in flight may run that long, no
longer; then they are aborted (their KV blocks freed in the engine core) and the process exits.

In-process: a uvicorn server built by `serve.uvicorn_config` on the test server's event loop (where
its `AsyncLLM` lives), in front of the shared spawned engine core, with prompts that carry
`engine_cores.SLOW_MARK` (every step they are in is slowed down), and `should_exit` set as
uvicorn's SIGTERM handler sets it. In a subprocess: the real `mini-vllm serve`, its own engine core
process, and a real SIGTERM, to the server alone or (with SIGINT, as Ctrl-C) to its process group.
"""

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from phase8_serving.api_server import build_app
from phase8_serving.cli import build_parser
from phase8_serving.serve import SHUTDOWN_TICK_S, uvicorn_config

from .conftest import wait_for_health
from .engine_cores import SLOW_MARK

LONG_MAX_TOKENS = 40  # >= 1.2 s at SLOW_STEP_S a token: far past the deadline below
ABORT_DEADLINE_S = 0.3
EXIT_MARGIN_S = 1.5  # uvicorn polls every 0.1 s; a slow step may be running; a busy machine
SERVE_STARTUP_S = 120  # import + load on a busy 2-core machine


@pytest.fixture
def slow_server(live_server):
    yield live_server
    live_server.wait_until_idle(timeout=5.0)


def serve_on_host(live_server, shutdown_timeout: float):
    """A second server over the shared `AsyncLLM`, on its loop; returns it, its `serve`'s future
    and its base URL."""
    args = build_parser().parse_args(["serve", "--shutdown-timeout", str(shutdown_timeout)])
    server = uvicorn.Server(uvicorn_config(build_app(live_server.llm, live_server.config), args))
    sock = socket.create_server(("127.0.0.1", 0))
    done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), live_server.host.loop)
    while not server.started:
        assert not done.done(), done.result()
        time.sleep(0.01)
    host, port = sock.getsockname()
    return server, done, f"http://{host}:{port}"


def wait_stopped(done: concurrent.futures.Future) -> None:
    done.result(timeout=10)  # `serve` returned: the server has shut down


def stream_until_shutdown(url: str, max_tokens: int, server: uvicorn.Server) -> tuple[list, float]:
    """Streams a completion; right after its first chunk, asks the server to shut down.
    Returns the SSE payloads received and when the shutdown was asked."""
    body = {"prompt": [*SLOW_MARK, *b"long"], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    payloads, asked = [], None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[len("data: ") :])
                    if asked is None:
                        asked = time.perf_counter()
                        server.should_exit = True  # what uvicorn's SIGTERM handler does
    except httpx.TransportError:  # the connection closed mid-stream: the request was aborted
        pass
    return payloads, asked


def test_flag_defaults_to_abort_at_once():
    args = build_parser().parse_args(["serve"])
    assert args.shutdown_timeout == 0
    assert uvicorn_config(None, args).timeout_graceful_shutdown == SHUTDOWN_TICK_S
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--shutdown-timeout", "-1"])


def test_requests_past_the_deadline_are_aborted(slow_server):
    server, done, url = serve_on_host(slow_server, ABORT_DEADLINE_S)
    tokens_before = slow_server.llm.metrics.generation_tokens._value.get()
    payloads, asked = stream_until_shutdown(url, LONG_MAX_TOKENS, server)
    wait_stopped(done)
    assert time.perf_counter() - asked < ABORT_DEADLINE_S + EXIT_MARGIN_S
    assert "[DONE]" not in payloads  # cut short, not finished
    slow_server.wait_until_idle(timeout=1.0)  # aborted in the engine core: every block free
    generated = slow_server.llm.metrics.generation_tokens._value.get() - tokens_before
    assert generated < LONG_MAX_TOKENS


def test_requests_within_the_deadline_finish(slow_server):
    server, done, url = serve_on_host(slow_server, 10.0)
    payloads, asked = stream_until_shutdown(url, 6, server)  # ~0.3 s of work
    wait_stopped(done)
    assert time.perf_counter() - asked < 3  # exits once the request is done, not at 10 s
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # a real `serve` process: ~15 s of imports and loading on 2 busy cores
def test_sigterm_stops_the_serve_command_at_the_deadline(tiny_dir):
    """The real command: 64 long requests queued on 2 slots (several seconds of work); SIGTERM
    after the first chunk; the stream is cut at the deadline, and the process exits cleanly,
    its engine core process stopped before it (its interpreter takes ~3 s to finalize torch on
    the 2-core CPU machine, hence no tight bound on the exit itself)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "phase8_serving", "serve", str(tiny_dir), "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
               "--max-num-seqs", "2", "--shutdown-timeout", str(ABORT_DEADLINE_S)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, server, timeout_s=SERVE_STARTUP_S)
        (core,) = engine_core_pids(server.pid)
        body = {"prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 100, "stream": True,
                "ignore_eos": True}  # fmt: skip
        payloads = []
        with pytest.raises(httpx.TransportError):  # the server goes away mid-stream
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                for line in response.iter_lines():
                    payloads.append(line)
                    if len(payloads) == 1:
                        server.send_signal(signal.SIGTERM)
                        asked = time.perf_counter()
        assert time.perf_counter() - asked < ABORT_DEADLINE_S + EXIT_MARGIN_S
        assert "data: [DONE]" not in payloads
        assert server.wait(timeout=30) == 0  # through Python's exit, so the cleanup ran
        assert not is_running(core)  # stopped and reaped by `serve`, not left behind
    finally:
        server.kill()
        server.wait(timeout=30)


def engine_core_pids(parent: int) -> list[int]:
    """The processes `parent` spawned with multiprocessing (its engine cores), from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # it exited while we read
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited, only its parent has not read its status


@pytest.mark.slow  # a real `serve` process per signal: ~15 s each on 2 busy cores
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_is_a_quiet_shutdown(tiny_dir, signum):
    """Ctrl-C (SIGINT to the whole process group) or a service manager's SIGTERM to it: the
    engine core, which gets the signal too, leaves the shutdown to its front end, so a request in
    flight finishes within `--shutdown-timeout`; the command exits with code 0 and logs no error
    and no traceback. Before, the core died at once ("ERROR ... engine core 0 died") and took the
    request with it, and Ctrl-C ended in a KeyboardInterrupt's traceback."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "phase8_serving", "serve", str(tiny_dir), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--shutdown-timeout", "20"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, server, timeout_s=SERVE_STARTUP_S)
        (core,) = engine_core_pids(server.pid)
        body = {"prompt": "a", "max_tokens": 120, "stream": True, "ignore_eos": True}
        payloads = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[len("data: ") :])
                    if len(payloads) == 1:
                        os.killpg(server.pid, signum)  # the server, its core, and their threads
        assert payloads[-1] == "[DONE]", payloads[-3:]
        last = json.loads(payloads[-2])  # an error event if the core died under the stream
        assert last.get("choices", [{}])[0].get("finish_reason") == "length", last
        assert server.wait(timeout=60) == 0
        log = server.stderr.read().decode()
        for noise in ("ERROR", "Traceback", "leaked"):
            assert noise not in log, log
        assert not is_running(core)
    finally:
        server.kill()
        server.wait(timeout=30)
