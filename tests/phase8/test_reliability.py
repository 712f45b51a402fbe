"""What a server must survive: bad input, many clients at once, clients that leave, a failing step.

Every bad request must get a 4xx in the OpenAI error shape and change nothing: the next good
request is answered correctly. Blocks are the evidence that aborts happen: after every scenario
every KV block is free again (`wait_until_idle`).
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from phase8_serving.api_server import build_app
from phase8_serving.config import ServerConfig

from .conftest import MAX_MODEL_LEN, MODEL_NAME, assert_openai_error
from .engine_cores import FAULT_MARK, SLOW_MARK

NUM_CONCURRENT_CLIENTS = 64
SCHEMATHESIS_MIN_REQUESTS = 1000
LONG_MAX_TOKENS = 40  # at SLOW_STEP_S per token: 1.2 s, longer than the 1 s abort deadline
# a request whose every step is SLOW_STEP_S longer (engine_cores.py), so it cannot finish before
# the abort
LONG = {"prompt": [*SLOW_MARK, *b"long"], "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}

BAD_BODIES = {
    "wrong type": ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    "bool is not an int": ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    "max_tokens < 1": ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "temperature < 0": ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    "top_p = 0": ({"prompt": "hi", "top_p": 0.0}, 400, "top_p"),
    "top_p > 1": ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "logprobs > 20": ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    "logprobs < 0": ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    "empty prompt": ({"prompt": ""}, 400, "prompt"),
    "empty token list": ({"prompt": []}, 400, "prompt"),
    "token id out of vocab": ({"prompt": [10**6]}, 400, None),
    "prompt longer than the context": ({"prompt": "x" * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
    "prompt + max_tokens > context": ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400,
                                      "max_tokens"),
    "unknown model": ({"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    "stream_options without stream": ({"prompt": "hi", "stream_options": {}}, 400, None),
    "n = 0": ({"prompt": "hi", "n": 0}, 400, "n"),
    "presence_penalty > 2": ({"prompt": "hi", "presence_penalty": 3.0}, 400, "presence_penalty"),
    "not an object": ([1, 2, 3], 400, None),
}  # fmt: skip
BAD_CHAT_BODIES = {
    "no messages": ({"messages": []}, 400, "messages"),
    "an empty role": ({"messages": [{"role": "", "content": "hi"}]}, 400, None),
    "top_logprobs without logprobs": (
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, None),
    "top_logprobs > 20": (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400, "top_logprobs"),
    "template kwargs that break the template": (
        {"messages": [{"role": "user", "content": "hi"}],
         "chat_template_kwargs": {"add_generation_prompt": 1}}, 400, "messages"),
}  # fmt: skip


def assert_still_serving(http: httpx.Client) -> None:
    body = {"prompt": "still there?", "max_tokens": 3, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_completion_requests_get_openai_errors(http, case):
    body, status, param = BAD_BODIES[case]
    assert_openai_error(http.post("/v1/completions", json=body), status, param)
    assert_still_serving(http)


@pytest.mark.parametrize("case", list(BAD_CHAT_BODIES))
def test_bad_chat_requests_get_openai_errors(http, case):
    body, status, param = BAD_CHAT_BODIES[case]
    assert_openai_error(http.post("/v1/chat/completions", json=body), status, param)
    assert_still_serving(http)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b'{"prompt": "hi"', '{"prompt": NaN}'])
def test_malformed_json(http, raw):
    headers = {"content-type": "application/json"}
    assert_openai_error(http.post("/v1/completions", content=raw, headers=headers), 400, None)
    assert_still_serving(http)


def test_unknown_route_and_method_are_openai_errors(http):
    assert_openai_error(http.get("/v1/nothing"), 404, None)
    assert_openai_error(http.get("/v1/completions"), 405, None)


def test_openai_client_raises_typed_errors(live_server):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_api_key(live_server):
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, api_key="sekret")
    url = live_server.host.serve(build_app(live_server.llm, config))
    body = {"prompt": "hi", "max_tokens": 2}
    assert_openai_error(httpx.post(url + "/v1/completions", json=body), 401, None)
    wrong = {"authorization": "Bearer wrong"}
    assert_openai_error(httpx.post(url + "/v1/completions", json=body, headers=wrong), 401, None)
    assert httpx.get(url + "/health").status_code == 200  # open without the key
    assert httpx.get(url + "/version").status_code == 200
    assert httpx.get(url + "/ping").status_code == httpx.post(url + "/ping").status_code == 200
    for route in ("/tokenize", "/detokenize", "/invocations"):  # they spend the server's work
        assert_openai_error(httpx.post(url + route, json={"tokens": [1]}), 401, None)
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
    # behind a proxy's prefix (--root-path): the same routes, open or not
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, api_key="sekret", root_path="/llm")
    url = live_server.host.serve(build_app(live_server.llm, config))
    for prefix in ("", "/llm"):
        assert httpx.get(f"{url}{prefix}/health").status_code == 200
        assert_openai_error(httpx.post(f"{url}{prefix}/v1/completions", json=body), 401, None)
        client = openai.OpenAI(base_url=f"{url}{prefix}/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
    assert httpx.get(f"{url}/llmx/health").status_code == 401  # not the prefix: a path it guards
    for bad in ("llm", "/llm/"):
        with pytest.raises(ValueError, match="root_path must look like /prefix"):
            ServerConfig(MODEL_NAME, MAX_MODEL_LEN, root_path=bad)


async def _stream_one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None, bool]:
    body = {"prompt": f"client {i}:", "max_tokens": 8, "stream": True, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    text, reason, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                continue
            choice = json.loads(payload)["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason, done


def test_a_browser_page_on_another_origin_may_call_the_api(live_server):
    """CORS, vLLM's defaults: a preflight needs no API key; answers, streams and errors (a 401)
    carry the allow header, so the page can read them; `allowed_origins` narrows who may, and
    none turns CORS off."""
    page, body = {"origin": "https://ui.example"}, {"prompt": "hi", "max_tokens": 2}
    asks = {"access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    keyed = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, api_key="sekret")
    url = live_server.host.serve(build_app(live_server.llm, keyed))
    preflight = httpx.options(url + "/v1/chat/completions", headers={**page, **asks})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    denied = httpx.post(url + "/v1/completions", json=body, headers=page)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    allowed = {**page, "authorization": "Bearer sekret"}
    streamed = {**body, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=streamed, headers=allowed) as r:
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.read().endswith(b"data: [DONE]\n\n")
    narrow = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, allowed_origins=("https://ui.example",))
    url = live_server.host.serve(build_app(live_server.llm, narrow))
    other = {"origin": "https://elsewhere.example"}
    assert httpx.options(url + "/v1/completions", headers={**other, **asks}).status_code == 400
    answer = httpx.post(url + "/v1/completions", json=body, headers=other)
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    answer = httpx.post(url + "/v1/completions", json=body, headers=page)
    assert answer.headers["access-control-allow-origin"] == "https://ui.example"
    off = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, allowed_origins=())
    url = live_server.host.serve(build_app(live_server.llm, off))
    assert httpx.options(url + "/v1/completions", headers={**page, **asks}).status_code == 405
    with pytest.raises(ValueError, match="allowed_origins must be a list of strings"):
        ServerConfig(MODEL_NAME, MAX_MODEL_LEN, allowed_origins="*")


def test_64_concurrent_streaming_clients_all_complete(live_server):
    async def main():
        limits = httpx.Limits(max_connections=NUM_CONCURRENT_CLIENTS)
        async with httpx.AsyncClient(base_url=live_server.base_url, limits=limits,
                                     timeout=120) as client:  # fmt: skip
            return await asyncio.gather(
                *(_stream_one(client, i) for i in range(NUM_CONCURRENT_CLIENTS))
            )

    results = asyncio.run(main())
    assert all(done and reason == "length" for _, reason, done in results)
    # The same greedy prompt alone gives the same text: batching changed nothing.
    body = {"prompt": "client 7:", "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    alone = httpx.post(live_server.base_url + "/v1/completions", json=body, timeout=30).json()
    assert results[7][0] == alone["choices"][0]["text"]
    live_server.wait_until_idle(timeout=1.0)


@pytest.fixture
def slow_engine(live_server):
    yield live_server
    live_server.wait_until_idle(timeout=5.0)


def generated_tokens(live_server) -> float:
    return live_server.llm.metrics.generation_tokens._value.get()


def test_client_that_disconnects_mid_stream_frees_its_blocks(slow_engine):
    body = {**LONG, "stream": True}
    before = generated_tokens(slow_engine)
    with httpx.Client(base_url=slow_engine.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            state = slow_engine.engine_state()
            assert state.num_free_blocks < state.num_blocks
        # leaving both blocks closes the connection mid-stream
    hung_up = time.perf_counter()
    slow_engine.wait_until_idle(timeout=1.0)
    assert time.perf_counter() - hung_up < 1.0
    assert generated_tokens(slow_engine) - before < LONG_MAX_TOKENS  # aborted, not finished


def test_non_streaming_client_that_gives_up_frees_its_blocks(slow_engine, caplog):
    before = generated_tokens(slow_engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_engine.base_url + "/v1/completions", json=LONG, timeout=0.3)
    slow_engine.wait_until_idle(timeout=1.0)
    assert generated_tokens(slow_engine) - before < LONG_MAX_TOKENS


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=30) as http:
        body = {"prompt": [*FAULT_MARK, *b"boom"], "max_tokens": 4}
        response = http.post("/v1/completions", json=body)
        assert_openai_error(response, 500, None)  # a server fault, not the client's
        message = response.json()["error"]["message"]
        assert message.startswith("Internal server error") and "injected fault" in message
        streamed = http.post("/v1/completions", json={**body, "stream": True}).text
        *_, error, done = [line for line in streamed.splitlines() if line]
        assert done == "data: [DONE]"  # the error event, then the end: never a hang
        message = json.loads(error.removeprefix("data: "))["error"]["message"]
        assert message.startswith("Internal server error") and "injected fault" in message
        assert_still_serving(http)
    live_server.wait_until_idle(timeout=1.0)


@pytest.mark.slow  # ~1 min on 2 quiet cores, mostly hypothesis generating the bodies
def test_schemathesis_finds_no_server_error(live_server):
    """Random valid and invalid requests from /openapi.json: never a 5xx, the engine survives."""
    schema = schemathesis.openapi.from_url(live_server.base_url + "/openapi.json")
    statuses: list[int] = []
    per_mode = SCHEMATHESIS_MIN_REQUESTS // 2
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        # generate only: no shrinking (the failing case is in the assertion message), ~25% faster
        @settings(max_examples=per_mode, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=schema.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=live_server.base_url, timeout=30)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.path, case.body, response.text)

        check()
    assert len(statuses) >= SCHEMATHESIS_MIN_REQUESTS
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
    live_server.wait_until_idle(timeout=1.0)
    with httpx.Client(base_url=live_server.base_url, timeout=30) as http:
        assert_still_serving(http)


def test_disconnect_while_blocked_in_send_frees_the_blocks(slow_engine):
    """The client vanishes while the server waits to write (a full socket buffer): the response
    is cancelled inside `send`, outside the event generator, and must still abort its request."""
    app = build_app(slow_engine.llm, slow_engine.config)
    body = {**LONG, "stream": True}
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "scheme": "http",
             "server": ("test", 80), "client": ("test", 1)}  # fmt: skip

    async def main():
        first_chunk, gone = asyncio.Event(), asyncio.Event()
        requests = iter([{"type": "http.request", "body": json.dumps(body).encode()}])

        async def receive():
            message = next(requests, None)
            if message is None:
                await gone.wait()
                return {"type": "http.disconnect"}
            return message

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk.set()
                await asyncio.Event().wait()  # the socket buffer never drains

        task = asyncio.create_task(app(scope, receive, send))
        await first_chunk.wait()
        gone.set()
        await asyncio.wait_for(task, timeout=1.0)

    slow_engine.host.run(main())  # on the loop the server's AsyncLLM lives on
    slow_engine.wait_until_idle(timeout=1.0)
