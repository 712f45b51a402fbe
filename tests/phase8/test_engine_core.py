"""The process layout: data parallelism over two CPU engine cores, the dashboard's stats hook,
a core that dies mid-stream, a front end and a core started as separate commands over tcp, and
a backlog of step outputs that no socket drops."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from phase8_serving.api_server import build_app
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.config import ServerConfig

from .conftest import MAX_MODEL_LEN, MODEL_NAME, ServerHost, tiny_core_spec, wait_for_health
from .engine_cores import SLOW_MARK

STARTUP_S = 180  # two processes importing torch on a busy 2-core machine
SLOW = {"prompt": [*SLOW_MARK, *b"dp"], "max_tokens": 40, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def dp_server(tiny_dir):
    """Two engine cores behind one front end; the last test of this module kills one."""
    llm = AsyncLLM.spawn(tiny_core_spec(tiny_dir), MODEL_NAME, data_parallel_size=2)
    host = ServerHost()
    try:
        yield host, llm, host.serve(build_app(llm, ServerConfig(MODEL_NAME, MAX_MODEL_LEN)))
    finally:
        host.close()
        llm.shutdown()


def test_requests_go_to_the_least_loaded_core(dp_server):
    host, llm, url = dp_server
    snapshots = []
    llm.on_engine_stats(lambda core, snapshot: snapshots.append((core, snapshot)))
    host.run(watch(llm, True))
    with httpx.Client(base_url=url, timeout=60) as client:
        streams = [client.stream("POST", "/v1/completions", json=SLOW) for _ in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]
        for it in lines:
            assert next(it).startswith("data: ")
        states = host.run(llm.engine_state())
        assert [s.num_requests for s in states] == [2, 2]  # two each: balanced by load
        for s in streams:
            s.__exit__(None, None, None)
    for _ in range(100):
        states = host.run(llm.engine_state())
        if all(s.num_requests == 0 and s.num_free_blocks == s.num_blocks for s in states):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"the cores are not idle: {states}")
    # the dashboard's hook: each watched core's snapshots, the last one of the idle engine (an
    # idle core sends the one it owes when due: a costly snapshot is followed by a long wait)
    for _ in range(500):
        last = [[s for core, s in snapshots if core == index][-1] for index in (0, 1)]
        if all(s["num_running"] == 0 and s["kv_usage"] == 0 for s in last):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"no snapshot of the idle cores: {last}")
    host.run(watch(llm, False))
    assert all({"num_running", "kv", "cost_s", "step_num_tokens"} <= set(s) for s in last)
    assert all(isinstance(n, int) for _, s in snapshots for n in s["step_num_tokens"])


async def watch(llm: AsyncLLM, watching: bool) -> None:
    llm.watch_engine(watching)  # on the event loop, as the dashboard calls it


def test_a_core_that_dies_fails_its_streams_and_health(dp_server):
    host, llm, url = dp_server
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=SLOW) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            (state,) = llm.processor.states.values()
            os.kill(llm.client.cores[state.core].process.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"server_error"' in rest[-2], rest[-3:]
        assert "died" in rest[-2]
        assert client.get("/health").status_code == 503
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.mark.slow  # two more processes that import torch
def test_front_end_and_core_as_separate_commands_over_tcp(tiny_dir):
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    python = [sys.executable, "-m", "phase8_serving"]
    engine = ["--dtype", "float32", "--device", "cpu"]
    core = subprocess.Popen([*python, "engine-core", str(tiny_dir), "--address", address,
                             *engine], env=env)  # fmt: skip
    serve = subprocess.Popen([*python, "serve", str(tiny_dir), "--port", str(port),
                              "--served-model-name", "tiny", "--engine-core-address", address,
                              *engine], env=env, stderr=subprocess.PIPE)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, serve, core, timeout_s=STARTUP_S)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="over tcp", max_tokens=4, stream=True, logprobs=0
        )
        assert sum(len(c.choices[0].logprobs.tokens) for c in stream) >= 1
        serve.terminate()  # uvicorn shuts down, then dies of the signal it caught
        assert serve.wait(timeout=60) in (0, -signal.SIGTERM)
        assert core.poll() is None  # a core started on its own outlives its front end
    finally:
        for process in (serve, core):
            process.terminate()
            process.wait(timeout=60)


@pytest.mark.parametrize("make", ["make_socket", "zmq_default"])
def test_a_front_end_that_falls_behind_loses_no_step_output(make):
    """The core's ROUTER queues what a slow front end has not read yet: 5,000 step messages sent
    before the front end reads one all arrive, in order (ZMQ's default high-water mark would drop
    all but ~2,000 of them, silently, and leave their requests waiting forever)."""
    import zmq

    from phase8_serving.core_messages import make_socket

    context = zmq.Context()
    if make == "make_socket":
        router, dealer = make_socket(context, zmq.ROUTER), make_socket(context, zmq.DEALER)
    else:
        router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    try:
        router.bind("inproc://core")
        dealer.connect("inproc://core")
        dealer.send(b"hello")
        identity, _ = router.recv_multipart()
        for i in range(5000):
            router.send_multipart([identity, b"%d" % i])  # a ROUTER never blocks: it drops
        received = []
        while dealer.poll(200):
            received.append(int(dealer.recv()))
        if make == "zmq_default":  # what the test guards against
            assert len(received) < 5000
        else:
            assert received == list(range(5000))
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()


def test_the_front_end_reads_a_backlog_in_order_then_waits_again(monkeypatch):
    """A front end behind its core reads the queued step outputs without a wait per message
    (core_client._received), all of them and in order, heartbeats skipped; then it waits on the
    socket again, and a message sent later still arrives."""
    import asyncio

    import msgspec
    import zmq

    from phase8_serving import core_client
    from phase8_serving.core_client import CoreConnection, EngineCoreClient
    from phase8_serving.core_messages import Heartbeat, StepOutputs, make_socket
    from phase8_serving.metrics import EngineStats

    read_at_once = []  # frames the reader took without waiting

    def received(socket):
        frame = unspied(socket)
        read_at_once.append(frame is not None)
        return frame

    unspied = core_client._received
    monkeypatch.setattr(core_client, "_received", received)

    context = zmq.Context()
    router, dealer = make_socket(context, zmq.ROUTER), make_socket(context, zmq.DEALER)
    router.bind("inproc://backlog")
    dealer.connect("inproc://backlog")
    client = EngineCoreClient([CoreConnection(0, "inproc://backlog", dealer, None)], context)
    encoder = msgspec.msgpack.Encoder()
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()

    def send(message) -> None:
        router.send_multipart([identity, encoder.encode(message)])

    async def main() -> list[float]:
        got: list[float] = []
        for i in range(3000):
            send(Heartbeat() if i % 100 == 0 else StepOutputs([], float(i), EngineStats()))
        client.start(lambda core, message: got.append(message.timestamp), lambda *_: None)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(got) == 2970:
                break
        send(StepOutputs([], -1.0, EngineStats()))  # the reader sleeps on the socket by now
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(got) == 2971:
                break
        for task in client.tasks:
            task.cancel()
        return got

    try:
        got = asyncio.run(main())
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()
    assert got == [float(i) for i in range(3000) if i % 100] + [-1.0]
    assert sum(read_at_once) > 2000  # the backlog, read without a wait per message


def test_requests_added_in_one_loop_turn_leave_in_one_message_and_before_what_follows():
    """Adds of one event-loop turn (a burst of HTTP requests) reach the core as one
    AddRequests, so it runs one step for all of them; any other message to the core (an abort,
    a GetState) leaves after the adds made before it, never ahead of them."""
    import asyncio

    import msgspec
    import zmq

    from phase8_serving.core_client import CoreConnection, EngineCoreClient
    from phase8_serving.core_messages import (
        AbortRequests,
        AddRequests,
        CoreInput,
        EngineCoreRequest,
        make_socket,
    )
    from phase8_serving.sampling_params import SamplingParams

    context = zmq.Context()
    router, dealer = make_socket(context, zmq.ROUTER), make_socket(context, zmq.DEALER)
    router.bind("inproc://adds")
    dealer.connect("inproc://adds")
    core = CoreConnection(0, "inproc://adds", dealer, None)
    client = EngineCoreClient([core], context)

    def request(request_id: str) -> EngineCoreRequest:
        return EngineCoreRequest(request_id, [1, 2], SamplingParams())

    async def main() -> None:
        client.start(lambda *_: None, lambda *_: None)
        client.add(core, [request("a-0"), request("a-1")])
        client.add(core, [request("b-0")])
        client.send(core, AbortRequests(["b-0"]))  # the adds before it leave first
        client.add(core, [request("c-0")])
        client.add(core, [request("d-0")])
        await asyncio.sleep(0.05)  # the turn ends: c and d leave together
        client.add(core, [request("e-0")])
        await asyncio.sleep(0.05)
        for task in client.tasks:
            task.cancel()

    try:
        asyncio.run(main())
        decoder = msgspec.msgpack.Decoder(CoreInput)
        got = []
        while router.poll(100):
            message = decoder.decode(router.recv_multipart()[1])
            got.append(
                [r.request_id for r in message.requests]
                if isinstance(message, AddRequests)
                else ("abort", message.request_ids)
            )
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()
    assert got == [["a-0", "a-1", "b-0"], ("abort", ["b-0"]), ["c-0", "d-0"], ["e-0"]]
