"""The OpenAI-compatible server, through the official `openai` client and raw HTTP.

Oracles: the tokenizer and chat template (usage counts), the offline engine path for the same
greedy request (text), the SSE format OpenAI documents (framing, `[DONE]`, the usage chunk).
"""

import json

import httpx
import openai
import pytest

from .conftest import MAX_MODEL_LEN, MODEL_NAME

GREEDY = {"temperature": 0.0}
MESSAGES = [{"role": "user", "content": "Hi!"}]  # 22 tokens with the template: room for 20 more


@pytest.fixture
def client(live_server):
    with openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="none", max_retries=0) as c:
        yield c
    live_server.wait_until_idle(timeout=1.0)  # every test leaves every KV block free


@pytest.fixture(scope="module")
def offline_llm(tiny_dir):
    from phase8_serving import LLM

    return LLM(tiny_dir, dtype="float32", device="cpu")


@pytest.fixture
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=30) as c:
        yield c


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response; asserts the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.read().decode()
    assert raw.endswith("\n\n")
    events = raw[: -len("\n\n")].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
    return [e[len("data: ") :] for e in events]


def test_completion_usage_counts_the_tokenizer(client, live_server):
    tokenizer = live_server.llm.tokenizer
    prompt = "The quick brown fox"
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_completion_equals_the_offline_engine(client, offline_llm):
    from phase8_serving import SamplingParams

    prompt = "Once upon a time"
    served = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
    offline = offline_llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )[0]
    assert served.choices[0].text == offline.outputs[0].text
    assert served.usage.completion_tokens == len(offline.outputs[0].token_ids)


@pytest.mark.parametrize("max_tokens", [1, 6])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_ending_inside_a_character_equals_the_offline_engine(
    client, live_server, offline_llm, stream, max_tokens
):
    """Token ids can end a prompt inside a character: its text is the prompt's, so the reply
    starts with neither a U+FFFD nor that character, exactly as offline, streamed or not."""
    from phase8_serving import SamplingParams

    tokenizer = live_server.llm.tokenizer
    for text in ("Hi é", "Hi 😀", "😀😀"):
        prompt = tokenizer.encode(text)[:-1]  # the last character loses its last byte
        offline = offline_llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
        )[0].outputs[0]
        served = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, stream=stream, **GREEDY
        )
        served_text = "".join(c.choices[0].text for c in served if c.choices) if stream else (
            served.choices[0].text
        )  # fmt: skip
        assert served_text == offline.text, (text, prompt)


def test_chat_usage_counts_the_chat_template(client, live_server):
    tokenizer = live_server.llm.tokenizer
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, **GREEDY
    )
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert out.usage.completion_tokens <= 5
    assert out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_equals_non_streaming(client, endpoint):
    if endpoint == "chat":
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, **GREEDY)
        create = client.chat.completions.create
        text_of = lambda c: c.message.content  # noqa: E731
        delta_of = lambda c: c.delta.content or ""  # noqa: E731
    else:
        kwargs = dict(model=MODEL_NAME, prompt="Streaming test:", max_tokens=20, **GREEDY)
        create = client.completions.create
        text_of = delta_of = lambda c: c.text  # noqa: E731
    whole = create(**kwargs)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    streamed = "".join(delta_of(c.choices[0]) for c in chunks[:-1])
    assert streamed == text_of(whole.choices[0])
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    if endpoint == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"


def test_raw_sse_framing(http):
    body = {"prompt": "abc", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def test_n_choices_and_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt="Pick a word:", max_tokens=8, n=3, seed=1234)
    kwargs["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(temperature=1.0, **kwargs)
    second = client.completions.create(temperature=1.0, **kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded
    assert len({c.text for c in first.choices}) > 1  # choice i uses seed + i
    assert first.usage.completion_tokens == 3 * 8
    streamed = list(client.completions.create(temperature=1.0, stream=True, **kwargs))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
             for i in range(3)]  # fmt: skip
    assert texts == [c.text for c in first.choices]


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="Log", max_tokens=6, logprobs=3, **GREEDY
    )
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    assert "".join(lp.tokens) == out.choices[0].text or out.choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_strings_cut_streamed_and_whole_text(client):
    kwargs = dict(model=MODEL_NAME, prompt="Stops:", max_tokens=20, **GREEDY)
    kwargs["extra_body"] = {"ignore_eos": True}
    text = client.completions.create(**kwargs).choices[0].text
    stop = next(text[i : i + 2] for i in range(1, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    for stream in (False, True):
        out = client.completions.create(stop=[stop], stream=stream, **kwargs)
        got = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert got == text[: text.index(stop)]


def test_stop_token_ids(client, offline_llm):
    from phase8_serving import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = offline_llm.generate(["Stop ids:"], params, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[4]
    out = client.completions.create(
        model=MODEL_NAME, prompt="Stop ids:", max_tokens=12, **GREEDY,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == ids.index(stop_id) + 1  # the stop token counts


def test_models_health_openapi(http):
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"} <= set(paths)


def test_metrics_count_what_was_served(http, client):
    def scrape() -> dict[str, float]:
        text = http.get("/metrics").text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    before = scrape()
    out = client.completions.create(
        model=MODEL_NAME, prompt="Count me", max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = scrape()
    delta = lambda name: after[name] - before[name]  # noqa: E731
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:prefix_cache_queries_total") == out.usage.prompt_tokens
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert name in after
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


@pytest.mark.slow  # loads the embedded SmolLM2 (~5 s) and generates on 30 float32 layers
def test_embedded_default_answers_through_the_openai_client():
    """The README's main job: `mini-vllm serve` with no model, asked through `openai`."""
    from phase8_serving.api_server import build_app
    from phase8_serving.async_engine import AsyncLLM
    from phase8_serving.config import ServerConfig
    from phase8_serving.default_model import MODEL_NAME as DEFAULT_NAME
    from phase8_serving.default_model import default_model_dir
    from phase8_serving.engine_core import EngineCoreSpec

    from .conftest import ServerHost

    llm = AsyncLLM.spawn(EngineCoreSpec(str(default_model_dir()), "float32", "cpu"), DEFAULT_NAME)
    host = ServerHost()
    try:
        url = host.serve(build_app(llm, ServerConfig(DEFAULT_NAME, 2048)))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        stream = client.chat.completions.create(
            model=DEFAULT_NAME, messages=question, max_tokens=12, temperature=0, stream=True
        )
        reply = "".join(c.choices[0].delta.content or "" for c in stream)
        assert "Paris" in reply
    finally:
        host.close()
        llm.shutdown()


def test_a_running_app_keeps_its_start_up_heap_out_of_the_collectors_passes(live_server):
    """Started, the app freezes what is alive (gc.freeze: full collections stop walking torch
    and the tokenizer); stopped, it unfreezes it."""
    import gc

    from fastapi.testclient import TestClient

    from phase8_serving.api_server import build_app

    gc.unfreeze()  # the live server's own start froze the heap already
    app = build_app(live_server.llm, live_server.config)
    with TestClient(app):  # runs the app's lifespan
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
