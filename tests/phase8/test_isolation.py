"""Nothing one client sends stalls the others, and a step's news leaves in one write.

Each hostile request is sent while another client streams; the test ends with "that stream was
never delayed by more than MAX_STALL_S" and "the engine is idle again" (no request, every KV block
free, asked of the engine core itself).
"""

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from phase8_serving.api_server import build_app
from phase8_serving.config import ServerConfig
from phase8_serving.core_messages import AddRequests

from .conftest import MAX_MODEL_LEN, MODEL_NAME, assert_openai_error
from .engine_cores import SLOW_MARK

MAX_STALL_S = 1.0  # the longest gap between two chunks of the bystander's stream
BODY_LIMIT = 4096
CHOICE_LIMIT = 4
HUGE_PROMPT = "x" * 2_000_000  # 2 MB: seconds of tokenizing, then a 400 (longer than the context)


class Bystander:
    """Another client streaming slow requests back to back in a thread until `join`; records
    every wait for a chunk (the first one counted from the request's start)."""

    def __init__(self, base_url: str):
        body = {"prompt": [*SLOW_MARK, *b"calm"], "max_tokens": 40, "ignore_eos": True,
                "stream": True}  # fmt: skip
        self.gaps: list[float] = []
        self.started, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(base_url, body))
        self.thread.start()
        assert self.started.wait(30), "the bystander's stream did not start"

    def _run(self, base_url: str, body: dict) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not self.done.is_set():
                last = time.perf_counter()
                with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            now = time.perf_counter()
                            self.gaps.append(now - last)
                            last = now
                            self.started.set()

    def __enter__(self) -> "Bystander":
        return self

    def __exit__(self, *exc_info) -> None:
        """Stops after the current stream, whatever happened in the block."""
        self.done.set()
        self.thread.join(60)

    @property
    def longest_wait(self) -> float:
        assert not self.thread.is_alive() and self.gaps
        return max(self.gaps)


@pytest.fixture(scope="module")
def strict_url(live_server):
    """The same engine behind a server with small limits."""
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, max_request_body_bytes=BODY_LIMIT,
                          max_choices_per_request=CHOICE_LIMIT)  # fmt: skip
    return live_server.host.serve(build_app(live_server.llm, config))


def test_a_huge_prompt_is_tokenized_off_the_event_loop(live_server):
    with Bystander(live_server.base_url) as bystander:
        start = time.perf_counter()
        response = httpx.post(live_server.base_url + "/v1/completions", timeout=120,
                              json={"prompt": HUGE_PROMPT, "max_tokens": 2})  # fmt: skip
        assert_openai_error(response, 400, "prompt")
        health = httpx.get(live_server.base_url + "/health", timeout=5)
        assert health.status_code == 200
        took = time.perf_counter() - start
    assert bystander.longest_wait < MAX_STALL_S, f"tokenizing took {took:.1f} s"
    live_server.wait_until_idle(timeout=2.0)


def test_a_body_over_the_limit_is_a_413(live_server, strict_url):
    big = {"prompt": "y" * BODY_LIMIT, "max_tokens": 2}
    assert_openai_error(httpx.post(strict_url + "/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit is counted while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 100 + 1):
            yield b"z" * 100
        yield b'"}'

    chunked = httpx.post(strict_url + "/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"})  # fmt: skip
    assert_openai_error(chunked, 413)
    small = httpx.post(strict_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert small.status_code == 200
    live_server.wait_until_idle(timeout=2.0)


def test_prompts_times_n_over_the_cap_is_a_400(live_server, strict_url):
    many = {"prompt": ["a"] * 3, "n": 2, "max_tokens": 2}  # 6 > CHOICE_LIMIT
    error = assert_openai_error(httpx.post(strict_url + "/v1/completions", json=many), 400)
    assert "6 completions" in error["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "n": CHOICE_LIMIT + 1}
    assert_openai_error(httpx.post(strict_url + "/v1/chat/completions", json=chat), 400, "n")
    live_server.wait_until_idle(timeout=2.0)


def test_a_batched_request_enters_in_one_message_and_leaves_together(live_server, monkeypatch):
    client = live_server.llm.client
    sent = []  # every message to the core, as it is encoded to leave
    encoder = client.encoder

    class Recording:
        def encode(self, message):
            sent.append(message)
            return encoder.encode(message)

    monkeypatch.setattr(client, "encoder", Recording())
    prompts = [[*SLOW_MARK, *f"prompt {i}".encode()] for i in range(8)]
    body = {"prompt": prompts, "n": 2, "max_tokens": 30, "ignore_eos": True}
    with Bystander(live_server.base_url) as bystander:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up: all 16 must go at once
            httpx.post(live_server.base_url + "/v1/completions", json=body, timeout=0.5)
    live_server.wait_until_idle(timeout=2.0)
    adds = [[r.request_id.rsplit("-", 1)[0] for r in m.requests] for m in sent
            if isinstance(m, AddRequests)]  # fmt: skip
    (batched,) = {i for ids in adds for i in ids if ids.count(i) == 16}
    assert sum(ids.count(batched) for ids in adds) == 16  # all 16 in that one message
    aborts = [m for m in sent if type(m).__name__ == "AbortRequests" and len(m.request_ids) > 1]
    assert [len(m.request_ids) for m in aborts] == [16]
    assert bystander.longest_wait < MAX_STALL_S


BIG_TOKENS = 24  # each choice's; every step of the big request is slowed (SLOW_MARK)
FAIR_FIRST_TOKEN_STEPS = 6  # the chat's answer within this many of the big request's steps


def test_n_long_choices_do_not_hold_off_another_clients_answer(live_server):
    """A request whose n=16 choices fill all 16 running slots of the engine for BIG_TOKENS slowed
    steps: another client's chat, sent once they stream, is answered within a few of those steps
    (the scheduler's fair share across requests). First come, first served per sequence answered
    it after the last of them."""
    url = live_server.base_url
    big = {"prompt": [*SLOW_MARK, *b"long"], "n": 16, "max_tokens": BIG_TOKENS,
           "ignore_eos": True, "stream": True, "logprobs": 0}  # fmt: skip
    steps = []  # the big request's steps: its choice 0's tokens, as they arrive
    started = threading.Event()

    def stream_big() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=big, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice["index"] == 0:  # logprobs: one entry per token, text held back or not
                    steps.extend([time.perf_counter()] * len(choice["logprobs"]["tokens"]))
                    started.set()

    thread = threading.Thread(target=stream_big)
    thread.start()
    try:
        assert started.wait(30), "the big request did not start"
        before = len(steps)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        response = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        during = len(steps) - before
    finally:
        thread.join(60)
    assert response.status_code == 200, response.text
    assert len(steps) == BIG_TOKENS  # the big request ran to its end, one chunk a step
    assert during <= FAIR_FIRST_TOKEN_STEPS, f"answered after {during} of its steps"
    live_server.wait_until_idle(timeout=2.0)


def test_a_huge_stop_list_is_a_400(live_server):
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["s"] * 1_000_000}  # ~5 MB of stops
    with Bystander(live_server.base_url) as bystander:
        response = httpx.post(live_server.base_url + "/v1/completions", json=body, timeout=60)
        assert_openai_error(response, 400, "stop")
    assert bystander.longest_wait < MAX_STALL_S
    live_server.wait_until_idle(timeout=2.0)


@pytest.mark.parametrize("where", ["content", "model", "stop", "name", "template_kwargs"])
def test_a_lone_surrogate_anywhere_is_a_400(live_server, where):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = json.dumps(body)
    bad = {
        "content": raw.replace('"hi"', '"a\\ud800"'),
        "model": raw[:-1] + ', "model": "m\\udfff"}',
        "stop": raw[:-1] + ', "stop": ["\\ud800"]}',
        "name": raw.replace('"content"', '"name": "\\udc00x", "content"'),
        "template_kwargs": raw[:-1] + ', "chat_template_kwargs": {"\\ud800": 1}}',
    }[where]
    response = httpx.post(live_server.base_url + "/v1/chat/completions", content=bad,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert_openai_error(response, 400)
    pair = raw.replace('"hi"', '"\\ud83d\\ude00"')  # a valid pair is an emoji, not an error
    ok = httpx.post(live_server.base_url + "/v1/chat/completions", content=pair,
                    headers={"content-type": "application/json"})  # fmt: skip
    assert ok.status_code == 200, ok.text
    live_server.wait_until_idle(timeout=2.0)


def test_one_write_per_step_for_all_choices(live_server):
    """n=3 streamed: every write but the last carries one chunk of each of the 3 choices
    (logprobs asked, so every step's delta is worth a chunk even when its text is held back).
    Slow steps (SLOW_MARK): a reader that keeps up writes each step alone, even on a loaded
    machine (with the tiny model's steps, a busy CI machine saw five steps merged into one)."""
    app = build_app(live_server.llm, live_server.config)
    body = {"prompt": [*SLOW_MARK, *b"abc"], "n": 3, "max_tokens": 5, "ignore_eos": True,
            "stream": True, "temperature": 1.0, "seed": 3, "logprobs": 1}  # fmt: skip
    writes = live_server.host.run(_asgi_writes(app, body))
    assert writes[-1].endswith(b"data: [DONE]\n\n")
    for write in writes[:-1]:
        events = [json.loads(e[len(b"data: ") :]) for e in write.split(b"\n\n") if e]
        assert sorted(e["choices"][0]["index"] for e in events) == [0, 1, 2], write
    assert len(writes) >= 5  # one per step (a lagging reader would see them merged instead)
    live_server.wait_until_idle(timeout=2.0)


async def _asgi_writes(app, body: dict) -> list[bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "scheme": "http",
             "server": ("test", 80), "client": ("test", 1)}  # fmt: skip
    requests = iter([{"type": "http.request", "body": json.dumps(body).encode()}])
    writes: list[bytes] = []

    async def receive():
        message = next(requests, None)
        if message is None:
            await asyncio.Event().wait()  # the client stays
        return message

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])

    await app(scope, receive, send)
    return writes


def test_a_client_hang_up_is_one_log_line(live_server, caplog):
    caplog.set_level(logging.INFO)
    body = {"prompt": [*SLOW_MARK, *b"bye"], "max_tokens": 40, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/completions", json=body, timeout=0.3)
    with httpx.Client(base_url=live_server.base_url) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            next(r.iter_lines())
    live_server.wait_until_idle(timeout=2.0)
    left = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(left) == 2, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_the_gauges_show_an_engine_idle_after_hang_ups(live_server):
    """vLLM's test_abort_metrics_reset: clients hang up, the engine goes idle through the
    aborts alone (no step after them), and /metrics says so: nothing running, no KV block in
    use, not the last step's numbers."""
    body = {"prompt": [*SLOW_MARK, *b"bye"], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live_server.base_url) as client:
        for _ in range(2):
            with client.stream("POST", "/v1/completions", json=body) as r:
                next(r.iter_lines())
        live_server.wait_until_idle(timeout=2.0)
        deadline = time.monotonic() + 2.0
        while True:
            gauges = {}
            for line in client.get("/metrics").text.splitlines():
                name, value = line.partition("{")[0], line.rsplit(" ", 1)[-1]
                if name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                    gauges[name] = float(value)
            if set(gauges.values()) == {0.0} or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert gauges == {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}


# -- what admitting a long token-id prompt costs ----------------------------------------------


LONG_IDS = list(range(5000))


def test_a_token_id_prompt_is_validated_as_token_ids_only():
    """The prompt's shape is read from its first item and validated as that shape alone: a bad
    id in 5,000 is one error, not the 5,000 of a failed try as a list of strings (the cost of a
    W prompt's validation, three quarters of it, before)."""
    from pydantic import ValidationError

    from phase8_serving.protocol import CompletionRequest

    assert CompletionRequest.model_validate({"prompt": LONG_IDS}).prompts() == [LONG_IDS]
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate({"prompt": [*LONG_IDS, "x"]})
    assert [e["loc"] for e in error.value.errors()] == [("prompt", "ids", 5000)]
    for prompt in ("hi", ["a", "b"], [[1], [2, 3]]):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_a_token_id_prompt_is_not_walked_for_lone_surrogates(monkeypatch):
    """Token ids hold no text: the surrogate check neither copies nor walks 5,000 of them; the
    body's strings are still looked at."""
    from phase8_serving import serving_engine
    from phase8_serving.protocol import CompletionRequest, InvalidRequest

    walked = []

    def spy(value, path):
        walked.append(value)
        return unspied(value, path)

    unspied = serving_engine._lone_surrogate
    monkeypatch.setattr(serving_engine, "_lone_surrogate", spy)
    serving_engine.check_no_lone_surrogate(CompletionRequest(prompt=LONG_IDS, user="u"))
    assert "prompt" not in walked[0] and "u" in walked
    for body in ({"prompt": LONG_IDS, "user": "\udc00"}, {"prompt": "hi", "model": "m\ud800"}):
        with pytest.raises(InvalidRequest, match="lone surrogate"):
            serving_engine.check_no_lone_surrogate(CompletionRequest(**body))


def test_only_text_goes_through_the_tokenizer_pool(live_server, monkeypatch):
    """Token ids need no tokenizing: such a prompt is admitted without the hop to a pool thread
    and back (~55 us of CPU here, a thirtieth of a W request's admission); text still goes."""
    hops = []
    pool = live_server.llm.run_in_tokenizer_pool

    async def counted(fn, *args):
        hops.append(fn.__name__)
        return await pool(fn, *args)

    monkeypatch.setattr(live_server.llm, "run_in_tokenizer_pool", counted)
    for prompt in ([72, 105], [[72], [105]], "Hi"):
        body = {"prompt": prompt, "max_tokens": 2}
        response = httpx.post(live_server.base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
    assert hops == ["prompt_token_ids"]  # the text prompt's alone
    live_server.wait_until_idle(timeout=2.0)
