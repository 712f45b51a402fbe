"""OpenAI behaviours beyond the basics, as the API documents them and vLLM's entrypoint tests check.

- logprobs always hold the sampled token (completions: up to logprobs + 1 entries; chat: exactly
  top_logprobs, the sampled one among them);
- a stream's `text_offset` equals the whole response's while a stop string holds text back;
- `GET /v1/models/{id}` (with vLLM's `root` and `parent`), and vLLM's `/tokenize`,
  `/detokenize`, `/version`, SageMaker's `/invocations` and `/ping`, `prompt_logprobs` (and
  `echo` with `logprobs`), `continuous_usage_stats` and signed seeds;
- `logit_bias`, `min_tokens` (vLLM's rules for EOS, stop tokens and stop strings), `top_k` -1/0,
  `stop_reason`, `include_stop_str_in_output`, `echo`, `return_token_ids` and
  `return_tokens_as_token_ids`;
- every field the server does not implement is a 400 naming it, never silently ignored (a 400
  names every invalid field); the do-nothing values of those fields are accepted, and so is a
  reply appended to the history as the SDK dumps it;
- vLLM's request-level metric families, checked against the responses' usage.

Oracles: the tokenizer (which token a forced id is), the same request without the field, usage.
A logit bias of +100 forces a token under greedy decoding, so every test here is deterministic.
"""

import asyncio
import concurrent.futures
import json
import time
import uuid
from types import SimpleNamespace

import httpx
import openai
import pytest

from phase8_serving.api_server import LoadTrackingMiddleware, build_app
from phase8_serving.config import ServerConfig
from phase8_serving.metrics import RequestTiming, build_1_2_5_buckets, finished_request_stats
from phase8_serving.protocol import ChatCompletionRequest
from phase8_serving.serving_engine import OpenAIServing
from phase8_serving.tokenizer import Tokenizer
from tests import assets

from .conftest import ENGINE, MAX_MODEL_LEN, MODEL_NAME, assert_openai_error

GREEDY = {"temperature": 0.0}
MESSAGES = [{"role": "user", "content": "Hi!"}]
FORCE = 100  # the largest logit bias: greedy decoding then picks that token


@pytest.fixture
def token_id(live_server):
    """The id of a one-token string (the test tokenizer is byte-level)."""

    def find(text: str) -> int:
        (token,) = live_server.llm.tokenizer.encode(text, add_special_tokens=False)
        return token

    return find


@pytest.fixture
def eos_id(live_server) -> int:
    (eos,) = live_server.llm.tokenizer.eos_token_ids
    return eos


def complete(http: httpx.Client, **body) -> dict:
    body = {"prompt": "Compat:", "max_tokens": 6, "ignore_eos": True, **GREEDY, **body}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(http: httpx.Client, **body) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, **GREEDY, **body}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_still_serving(http: httpx.Client) -> None:
    out = complete(http, prompt="still there?", max_tokens=3)
    assert out["usage"]["completion_tokens"] == 3


# -- logprobs ------------------------------------------------------------------------------


def test_completion_logprobs_hold_the_sampled_token(http, token_id):
    bias = {str(token_id("Z")): FORCE}  # "Z" is sampled; its raw logprob is rarely a top one
    zero = complete(http, logprobs=0, logit_bias=bias)["choices"][0]
    assert zero["text"] == "Z" * 6
    lp = zero["logprobs"]
    assert lp["top_logprobs"] == [{"Z": v} for v in lp["token_logprobs"]]  # not {}
    two = complete(http, logprobs=2, logit_bias=bias)["choices"][0]["logprobs"]
    assert two["token_logprobs"] == lp["token_logprobs"]
    for chosen, top in zip(two["token_logprobs"], two["top_logprobs"], strict=True):
        # the top 2, plus the sampled token when it is not among them: up to logprobs + 1
        # (fewer keys when two byte tokens both decode to "\ufffd")
        assert top["Z"] == chosen and len(top) <= 3


def test_chat_logprobs_hold_the_sampled_token(http, token_id):
    bias = {str(token_id("Z")): FORCE}
    zero = chat(http, logprobs=True, top_logprobs=0, logit_bias=bias)["choices"][0]
    assert all(e["top_logprobs"] == [] for e in zero["logprobs"]["content"])  # as vLLM
    one = chat(http, logprobs=True, top_logprobs=1, logit_bias=bias)["choices"][0]
    for entry in one["logprobs"]["content"]:
        assert entry["token"] == "Z"
        assert [(e["token"], e["logprob"]) for e in entry["top_logprobs"]] == [
            ("Z", entry["logprob"])
        ]
    three = chat(http, logprobs=True, top_logprobs=3, logit_bias=bias)["choices"][0]
    for entry in three["logprobs"]["content"]:
        top = entry["top_logprobs"]
        assert len(top) == 3 and "Z" in [e["token"] for e in top]
        assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)


def test_streamed_text_offset_equals_the_whole_responses(http):
    """While the text ends with the beginning of a stop string, the output processor holds that
    tail back, so the stream's text lags its tokens. The stop string here is the second half of
    the greedy reply plus a character past its end: held back from the middle on, never found."""
    body = {"prompt": "Offsets:", "max_tokens": 12, "ignore_eos": True, "logprobs": 1, **GREEDY}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    body["stop"] = [plain[len(plain) // 2 :] + "@"]
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == plain and whole["finish_reason"] == "length"
    offsets, tokens, lagged = [], [], False
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: ") :])["choices"][0]
                lp = choice["logprobs"]
                offsets += lp["text_offset"]
                tokens += lp["tokens"]
                lagged |= len(choice["text"]) < sum(map(len, lp["tokens"]))
    assert lagged  # the case under test happened
    assert tokens == whole["logprobs"]["tokens"]
    assert offsets == whole["logprobs"]["text_offset"]
    lengths = [len(token) for token in tokens]  # each offset counts the tokens before it
    assert offsets == [sum(lengths[:i]) for i in range(len(tokens))]


# -- models --------------------------------------------------------------------------------


def test_get_one_model(http, client):
    card = http.get(f"/v1/models/{MODEL_NAME}").json()
    listed = http.get("/v1/models").json()["data"][0]
    assert {k: v for k, v in card.items() if k != "created"} == {
        k: v for k, v in listed.items() if k != "created"
    }
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert (card["root"], card["parent"]) == (MODEL_NAME, None)  # vLLM's fields: no path given
    for unknown in ("gpt-5", "org/name"):  # a hub id's slash still reaches the route
        error = assert_openai_error(http.get(f"/v1/models/{unknown}"), 404, "model")
        assert error["code"] == "model_not_found" and unknown in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert_still_serving(http)


def test_load_counts_the_generation_requests_in_progress(live_server, http):
    """vLLM's GET /load (with --enable-server-load-tracking; a 404 without): a generation
    request counts from its arrival until its response is sent, streamed or not, or fails."""
    assert http.get("/load").status_code == 404
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, enable_server_load_tracking=True)
    app = build_app(live_server.llm, config)
    with httpx.Client(base_url=live_server.host.serve(app), timeout=30) as tracked:
        assert tracked.get("/load").json() == {"server_load": 0}

        def load_once_answered() -> int:  # the client may read the end before the server
            deadline = time.monotonic() + 5  # has left the handler: a moment later, it has
            while (load := tracked.get("/load").json()["server_load"]) and (
                    time.monotonic() < deadline):  # fmt: skip
                time.sleep(0.01)
            return load

        for body in ({"stream": False}, {"stream": True}, {"max_tokens": 0}):
            response = tracked.post("/v1/completions", json={"prompt": "hi", **body})
            assert response.status_code in (200, 400) and load_once_answered() == 0
    # while one is in progress (an app that waits, behind the same middleware)
    seen = []

    async def drive(path: str):
        release = asyncio.Event()

        async def slow_app(scope, receive, send):
            seen.append(scope["app"].state.server_load)
            await release.wait()
            raise RuntimeError("the response failed")

        scope = {"type": "http", "path": path, "app": app}
        task = asyncio.create_task(LoadTrackingMiddleware(slow_app)(scope, None, None))
        await asyncio.sleep(0)
        other = {"type": "http", "path": "/metrics", "app": app}  # not a generation route
        await LoadTrackingMiddleware(lambda *a: asyncio.sleep(0))(other, None, None)
        during = app.state.server_load
        release.set()
        with pytest.raises(RuntimeError):
            await task
        return during

    for path in ("/v1/chat/completions", "/v1/responses"):
        assert asyncio.run(drive(path)) == 1 and app.state.server_load == 0
    assert seen == [1, 1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_give_every_chunk_its_choices_usage(http, endpoint):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): each chunk carries
    the usage of its choice so far; the last chunk the request's, as without it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"max_tokens": 5, "n": 2, "stream": True, "ignore_eos": True, "stream_options": options}
    response = post(http, endpoint, body)
    chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    *with_choices, last = chunks
    seen = {}
    for chunk in with_choices:
        usage, (choice,) = chunk["usage"], chunk["choices"]
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]  # one prompt
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen.get(choice["index"], 0)
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 5, 1: 5} and last["usage"]["completion_tokens"] == 10
    options["include_usage"] = False  # vLLM's rule: continuous only with include_usage
    plain = post(http, endpoint, {**body, "stream_options": options}).text
    assert '"usage"' not in plain


def test_any_signed_64_bit_seed_is_taken(http):
    """vLLM takes the whole signed 64-bit range (OpenAI says only "integer"); choice i of n
    uses seed + i, wrapped into the engine's [0, 2**64): still seeded, even at the ends."""
    for seed in (-1, -(2**63), 2**63 - 1):
        body = {"temperature": 1.0, "seed": seed, "n": 2}
        texts = [c["text"] for c in complete(http, **body)["choices"]]
        assert texts == [c["text"] for c in complete(http, **body)["choices"]]
    for seed, kind in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):
        error = assert_openai_error(post(http, "completions", {"seed": seed}), 400, "seed")
        assert f"[type={kind}]" in error["message"]  # pydantic's error type, as vLLM says it


# -- tokenize, detokenize, version (vLLM's) -------------------------------------------------


def test_tokenize_gives_what_a_request_would_send(http, live_server):
    tokenizer = live_server.llm.tokenizer
    got = http.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert got["tokens"] == tokenizer.encode("Hello there") and got["token_strs"] is None
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == MAX_MODEL_LEN
    strs = http.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}).json()
    assert strs["token_strs"] == [tokenizer.backend.id_to_token(t) for t in strs["tokens"]]
    # messages: the template's tokens, as many as the chat request's usage counts
    counted = http.post("/tokenize", json={"messages": MESSAGES, "model": MODEL_NAME}).json()
    assert counted["count"] == chat(http)["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"tokens": got["tokens"]}).json()
    assert text == {"prompt": "Hello there"}
    assert http.get("/version").json()["version"]


def test_prompt_logprobs_score_each_prompt_token(http):
    """vLLM's `prompt_logprobs` k: per prompt token, None for the first, then {id: {logprob,
    rank, decoded_token}} for the token and the k most likely there (a completion's per choice,
    a chat's at the top level; streamed, in a choice's first chunk); null when not asked; out of
    [0, 20], a 400. (Their values are checked against transformers offline:
    test_output_processor.py.)"""
    ids = http.post("/tokenize", json={"prompt": "Compat:"}).json()["tokens"]
    whole = complete(http, prompt_logprobs=2, n=2)
    scored = [c["prompt_logprobs"] for c in whole["choices"]]
    assert scored[0] == scored[1] and len(scored[0]) == len(ids) and scored[0][0] is None
    for token, entries in zip(ids[1:], scored[0][1:], strict=True):
        mine = entries[str(token)]  # the prompt's token, then the top 2 (it may be one of them)
        assert len(entries) in (2, 3) and mine["logprob"] <= 0 and mine["rank"] >= 1
        assert sorted(e["rank"] for t, e in entries.items() if t != str(token))[-1] <= 2
    assert complete(http)["choices"][0]["prompt_logprobs"] is None
    assert chat(http)["prompt_logprobs"] is None
    in_chat = chat(http, prompt_logprobs=0)
    assert len(in_chat["prompt_logprobs"]) == in_chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in in_chat["prompt_logprobs"][1:])  # the token alone
    body = {"prompt": "Compat:", "prompt_logprobs": 2, "max_tokens": 6, "ignore_eos": True}
    streamed = [c["choices"][0] for c in stream_chunks(http, "completions", body)]
    firsts = [c["prompt_logprobs"] for c in streamed if "prompt_logprobs" in c]
    assert len(firsts) == 1 and firsts[0] == whole["choices"][0]["prompt_logprobs"]
    for bad in (-1, 21, "1"):
        assert_openai_error(post(http, "chat", {"prompt_logprobs": bad}), 400, "prompt_logprobs")


def test_echo_with_logprobs_leads_with_the_prompts_tokens(http, live_server):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1): the
    prompt's tokens lead the logprobs, the first without any (None), each other given the
    tokens before it (prompt_logprobs' values); offsets count the echoed text; streamed, the
    same lists."""
    ids = http.post("/tokenize", json={"prompt": "Compat:"}).json()["tokens"]
    body = {"prompt": "Compat:", "echo": True, "logprobs": 1, "max_tokens": 2, "ignore_eos": True,
            **GREEDY}  # fmt: skip
    out = complete(http, **body)["choices"][0]
    lp, n = out["logprobs"], len(ids)
    assert out["text"].startswith("Compat:") and out["prompt_logprobs"] is None  # not asked
    tokenizer = live_server.llm.tokenizer
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids] and len(lp["tokens"]) == n + 2
    assert (lp["token_logprobs"][0], lp["top_logprobs"][0]) == (None, None)
    scored = complete(http, prompt="Compat:", prompt_logprobs=1, max_tokens=2)
    scored = scored["choices"][0]["prompt_logprobs"]
    assert lp["token_logprobs"][1:n] == [scored[i][str(ids[i])]["logprob"] for i in range(1, n)]
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    lengths = [len(token) for token in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(n + 2)]
    chunks = [c["choices"][0] for c in stream_chunks(http, "completions", {**body, "n": 2})]
    for index in (0, 1):  # each choice leads with the prompt's tokens
        mine = [c for c in chunks if c["index"] == index]
        joined = {key: [x for c in mine for x in c["logprobs"][key]] for key in lp}
        assert joined == lp and "".join(c["text"] for c in mine) == out["text"]


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),  # one or the other
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "gpt-5"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1"}, 400, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_bodies(http, route, body, status, param):
    assert_openai_error(http.post(route, json=body), status, param)
    assert_still_serving(http)


# -- logit_bias, min_tokens, top_k ---------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens(http, token_id):
    plain = complete(http)["choices"][0]["text"]
    forced = complete(http, logit_bias={str(token_id("Q")): FORCE})["choices"][0]["text"]
    assert forced == "Q" * 6
    first = plain[0]
    banned = complete(http, logit_bias={str(token_id(first)): -FORCE})["choices"][0]["text"]
    assert first not in banned
    in_chat = chat(http, logit_bias={str(token_id("Q")): FORCE})["choices"][0]
    assert in_chat["message"]["content"] == "Q" * 6


def test_min_tokens_holds_off_eos(http, eos_id):
    bias = {str(eos_id): FORCE}  # EOS wins every step it is allowed
    at_once = complete(http, logit_bias=bias, ignore_eos=False)
    assert at_once["usage"]["completion_tokens"] == 1
    assert at_once["choices"][0]["finish_reason"] == "stop"
    held = complete(http, logit_bias=bias, ignore_eos=False, min_tokens=4, logprobs=0)
    assert held["usage"]["completion_tokens"] == 5  # 4 tokens, then EOS
    assert held["choices"][0]["finish_reason"] == "stop"
    tokens = held["choices"][0]["logprobs"]["tokens"]
    assert "<|im_end|>" not in tokens[:4] and tokens[4] == "<|im_end|>"  # masked, not ignored
    in_chat = chat(http, logit_bias=bias, ignore_eos=False, min_tokens=3, max_tokens=10)
    assert in_chat["usage"]["completion_tokens"] == 4


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(http, token_id):
    z = token_id("Z")
    bias = {str(z): FORCE}
    stopped = complete(http, logit_bias=bias, stop_token_ids=[z], min_tokens=3)
    assert stopped["usage"]["completion_tokens"] == 4  # Z is masked for 3 tokens, then stops
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert "Z" not in stopped["choices"][0]["text"]
    # vLLM's rule: a stop string counts only if it ends in text of a token after min_tokens
    assert complete(http, logit_bias=bias, stop="Z")["choices"][0]["text"] == ""
    late = complete(http, logit_bias=bias, stop="Z", min_tokens=3)
    assert late["choices"][0]["text"] == "ZZZ"
    assert late["usage"]["completion_tokens"] == 4 and late["choices"][0]["finish_reason"] == "stop"


def stream_chunks(http: httpx.Client, endpoint: str, body: dict) -> list[dict]:
    response = post(http, endpoint, {**body, "stream": True})
    return [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
            if line.startswith("data: {")]  # fmt: skip


def test_stop_reason_names_what_ended_a_choice(http, token_id, eos_id):
    """vLLM's `stop_reason`: the stop string or the `stop_token_ids` entry that ended a choice,
    null for EOS and for a length, in whole responses and in a stream's finishing chunk;
    `include_stop_str_in_output` keeps the stop string in the text."""
    z = token_id("Z")
    force_z = {str(z): FORCE}
    by_token = complete(http, logit_bias=force_z, stop_token_ids=[z])["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", z)
    by_eos = complete(http, logit_bias={str(eos_id): FORCE}, ignore_eos=False)["choices"][0]
    assert (by_eos["finish_reason"], by_eos["stop_reason"]) == ("stop", None)
    assert complete(http)["choices"][0]["stop_reason"] is None  # a length
    for keep, text in ((False, ""), (True, "ZZ")):
        body = {"logit_bias": force_z, "stop": ["ZZ"], "include_stop_str_in_output": keep}
        whole = complete(http, **body)["choices"][0]
        assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (text, "stop", "ZZ")
        in_chat = chat(http, **body)["choices"][0]
        assert (in_chat["message"]["content"], in_chat["stop_reason"]) == (text, "ZZ")
        for endpoint in ("completions", "chat"):
            choices = [c["choices"][0] for c in stream_chunks(http, endpoint, body)]
            assert [c["stop_reason"] for c in choices if c["finish_reason"]] == ["ZZ"]
            assert all(c["stop_reason"] is None for c in choices if not c["finish_reason"])
            texts = [c["text"] if endpoint == "completions" else c["delta"].get("content", "")
                     for c in choices]  # fmt: skip
            assert "".join(texts) == text
    assert_openai_error(post(http, "completions", {"include_stop_str_in_output": 1}), 400,
                        "include_stop_str_in_output")  # fmt: skip


def test_echo_begins_each_choice_with_its_prompt(http, live_server):
    """`echo`: each choice's text is its prompt's, then the completion (a prompt of token ids
    decoded); streamed, the prompt comes in each choice's first chunk, with its first output
    (as in vLLM: with logprobs, the prompt's are known only then); usage is unchanged."""
    ids = live_server.llm.tokenizer.encode("Token ids.")
    by_ids = complete(http, prompt=ids, echo=True)["choices"][0]["text"]
    assert by_ids == "Token ids." + complete(http, prompt=ids)["choices"][0]["text"]
    prompts = ["Echo me:", "and me."]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4}
    plain = complete(http, **body)
    echoed = complete(http, **body, echo=True)
    assert [c["text"] for c in echoed["choices"]] == [
        prompts[c["index"] // 2] + c["text"] for c in plain["choices"]
    ]
    assert echoed["usage"] == plain["usage"]
    chunks = stream_chunks(http, "completions", {**body, **GREEDY, "ignore_eos": True,
                                                 "echo": True})  # fmt: skip
    texts = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts.setdefault(choice["index"], []).append(choice["text"])
    assert all(texts[i][0].startswith(prompts[i // 2]) for i in range(4))  # in the first chunk
    assert ["".join(texts[i]) for i in range(4)] == [c["text"] for c in echoed["choices"]]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_return_token_ids_gives_the_prompts_and_each_choices_ids(http, token_id, endpoint):
    """vLLM's `return_token_ids`: the prompt's ids (a completion's per choice, a chat's at the
    top level) and each choice's ids; streamed, the prompt's come in a choice's first chunk (a
    chat's role chunk) and each chunk brings its new ids, adding up to the whole's. Not asked,
    the whole response has the keys, null, and chunks do not."""
    chat_ = endpoint == "chat"
    prompt = {"messages": MESSAGES} if chat_ else {"prompt": "Compat:"}
    asked = {**prompt, "n": 2, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
             **GREEDY}  # fmt: skip
    prompt_ids = http.post("/tokenize", json=prompt).json()["tokens"]
    whole = post(http, endpoint, asked).json()
    body = whole if chat_ else whole["choices"][0]
    assert body["prompt_token_ids"] == prompt_ids
    ids = [c["token_ids"] for c in whole["choices"]]
    assert [len(i) for i in ids] == [6, 6] and ids[0] == ids[1]  # greedy
    plain = post(http, endpoint, {**asked, "return_token_ids": False}).json()
    assert (plain if chat_ else plain["choices"][0])["prompt_token_ids"] is None
    assert all(c["token_ids"] is None for c in plain["choices"])
    streamed, firsts = {0: [], 1: []}, {}
    for chunk in stream_chunks(http, endpoint, asked):
        (choice,) = chunk["choices"]
        where = chunk if chat_ else choice
        if choice["index"] not in firsts:
            firsts[choice["index"]] = where.get("prompt_token_ids")
        else:
            assert "prompt_token_ids" not in where
        streamed[choice["index"]] += choice["token_ids"]
    assert firsts == {0: prompt_ids, 1: prompt_ids} and list(streamed.values()) == ids
    # ids whose text is held back (it may begin the stop string) still come in their step
    held = {**asked, "logit_bias": {str(token_id("Z")): FORCE}, "stop": ["Z" * 10]}
    chunks = stream_chunks(http, endpoint, held)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 12
    unasked = post(http, endpoint, {**asked, "return_token_ids": None, "stream": True}).text
    assert "token_ids" not in unasked


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(http):
    """vLLM's `return_tokens_as_token_ids`: logprobs name tokens "token_id:ID" (a byte of a
    split character has no text of its own); text offsets still count the text."""
    body = {"logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}
    named = complete(http, **body)["choices"][0]
    texts = complete(http, logprobs=2)["choices"][0]["logprobs"]
    lp = named["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    assert (lp["token_logprobs"], lp["text_offset"]) == (texts["token_logprobs"],
                                                         texts["text_offset"])  # fmt: skip
    in_chat = chat(http, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = in_chat["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


def test_prompt_tokens_details_count_the_prefix_cache_hits(live_server, http):
    """--enable-prompt-tokens-details (vLLM's flag): usage's `prompt_tokens_details.cached_tokens`
    counts the prompt tokens found in the prefix cache (whole blocks of 8 here), whole and
    streamed, summed over prompts; off (the default), usage has no such key."""
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, enable_prompt_tokens_details=True)
    url = live_server.host.serve(build_app(live_server.llm, config))
    prompt = f"{uuid.uuid4().hex[:8]}: two blocks, cached"  # new to the cache
    body = {"prompt": prompt, "max_tokens": 2, **GREEDY}
    with httpx.Client(base_url=url, timeout=30) as details:
        first = details.post("/v1/completions", json=body).json()["usage"]
        again = details.post("/v1/completions", json=body).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["prompt_tokens_details"]["cached_tokens"] == 24  # of 29 prompt tokens
        both = details.post("/v1/completions", json={**body, "prompt": [prompt, prompt], "n": 2})
        assert both.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        response = details.post("/v1/completions", json=streamed)
        last = json.loads(response.text.split("data: ")[-2])  # the usage chunk, before [DONE]
        assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 24}
    assert "prompt_tokens_details" not in complete(http, prompt=prompt)["usage"]


def test_add_special_tokens_and_truncate_prompt_tokens(tiny_dir):
    """vLLM's `add_special_tokens` (None: a prompt gets the tokenizer's BOS, a chat's rendered
    template does not) and `truncate_prompt_tokens` (the prompt's last k tokens; -1: as many as
    the context holds; more than it, a 400), on a tokenizer whose post-processor adds a BOS."""
    from types import SimpleNamespace

    from tokenizers.processors import TemplateProcessing

    from phase8_serving.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequest
    from phase8_serving.serving_engine import OpenAIServing
    from phase8_serving.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_dir)
    bos = tokenizer.backend.token_to_id("<|endoftext|>")
    tokenizer.backend.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    serving = OpenAIServing(SimpleNamespace(tokenizer=tokenizer), ServerConfig("m", 24))
    text = tokenizer.encode("Hi there", add_special_tokens=False)
    ids = serving.prompt_token_ids  # the rule under test
    assert ids(CompletionRequest(prompt="Hi there")) == [[bos, *text]]
    assert ids(CompletionRequest(prompt="Hi there", add_special_tokens=False)) == [text]
    chat_ = {"messages": MESSAGES}
    assert ids(ChatCompletionRequest(**chat_))[0][0] != bos
    assert ids(ChatCompletionRequest(**chat_, add_special_tokens=True))[0][0] == bos
    assert ids(CompletionRequest(prompt="Hi there", truncate_prompt_tokens=3)) == [text[-3:]]
    long = ids(CompletionRequest(prompt="x" * 40, truncate_prompt_tokens=-1))
    assert long == [[*tokenizer.encode("x" * 40, add_special_tokens=False)][-24:]]
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        ids(CompletionRequest(prompt="Hi", truncate_prompt_tokens=25))


def test_truncate_prompt_tokens_through_the_server(http):
    out = complete(http, prompt="a long prompt, cut to its last four", truncate_prompt_tokens=4)
    assert out["usage"]["prompt_tokens"] == 4
    echoed = complete(http, prompt="cut to four", truncate_prompt_tokens=4, echo=True, max_tokens=1)
    assert echoed["choices"][0]["text"].startswith("four")  # the echo is what the model saw
    ids = list(range(60, 68))  # vLLM's truncation_side: which end is cut
    for side, kept in (("right", ids[:4]), ("left", ids[-4:]), (None, ids[-4:])):
        out = complete(http, prompt=ids, truncate_prompt_tokens=4, truncation_side=side,
                       return_token_ids=True)  # fmt: skip
        assert out["choices"][0]["prompt_token_ids"] == kept, side
    assert_openai_error(post(http, "completions", {"truncation_side": "middle"}), 400,
                        "truncation_side")  # fmt: skip
    assert_openai_error(post(http, "completions", {"truncate_prompt_tokens": -2}), 400,
                        "truncate_prompt_tokens")  # fmt: skip


def test_continue_final_message_and_chat_echo(http, live_server):
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`): the prompt ends
    inside the final message, so the reply goes on with it; `echo` begins the reply with that
    message's content when it is the assistant's (not a user's). Both true is a 400."""
    tokenizer = live_server.llm.tokenizer
    begun = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": begun, "add_generation_prompt": False, "continue_final_message": True}
    rendered = tokenizer.apply_chat_template(begun, add_generation_prompt=False)
    expected = rendered[: rendered.rindex("The answer is") + len("The answer is")]
    assert not expected.endswith("<|im_end|>\n") and rendered.startswith(expected)
    count = len(tokenizer.encode(expected, add_special_tokens=False))
    assert http.post("/tokenize", json=body).json()["count"] == count
    going_on = chat(http, **body)
    assert going_on["usage"]["prompt_tokens"] == count
    echoed = chat(http, **body, echo=True)["choices"][0]["message"]["content"]
    assert echoed == "The answer is" + going_on["choices"][0]["message"]["content"]
    assert chat(http, echo=True)["choices"][0]["message"] == chat(http)["choices"][0]["message"]
    streamed = stream_chunks(http, "chat", {**body, "echo": True, "max_tokens": 6,
                                            "ignore_eos": True, **GREEDY})  # fmt: skip
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == echoed
    for route in ("/v1/chat/completions", "/tokenize"):
        both = {"messages": begun, "continue_final_message": True}
        assert_openai_error(http.post(route, json=both), 400, None)


def test_allowed_token_ids_restrict_what_is_sampled(http, token_id, eos_id):
    """vLLM's `allowed_token_ids`: only they are sampled (at temperature 1 too, whatever the
    logit bias); out of the vocabulary or empty, a 400; allowing only EOS while min_tokens holds
    it off is a 400, not a request that could sample nothing."""
    a, b = token_id("a"), token_id("b")
    out = complete(http, temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=[a, b],
                   logit_bias={str(token_id("Q")): FORCE})["choices"][0]["text"]  # fmt: skip
    assert len(out) == 12 and set(out) <= {"a", "b"}
    in_chat = chat(http, allowed_token_ids=[a])["choices"][0]["message"]["content"]
    assert in_chat == "a" * 6
    for bad in ([], [-1], [100000]):
        error = assert_openai_error(post(http, "chat", {"allowed_token_ids": bad}), 400)
        assert "allowed_token_ids" in error["message"]
    error = assert_openai_error(post(http, "completions", {
        "allowed_token_ids": [eos_id], "min_tokens": 2}), 400)  # fmt: skip
    assert "only stop tokens" in error["message"]
    assert_still_serving(http)


def test_bad_words_are_never_completed(http, token_id):
    """vLLM's `bad_words`: a word may start but never be completed. Greedy and biased towards
    "b", then "a", the reply is "bbb..."; banning "bb" and "ab" it is "b" then only "a"s (each
    "b" would complete one); banning "b" there is no "b" at all; an empty or blank word is a 400
    that names the field."""
    a, b = token_id("a"), token_id("b")
    force = {"logit_bias": {str(a): FORCE - 1, str(b): FORCE}, "max_tokens": 12, "temperature": 0}
    assert complete(http, **force)["choices"][0]["text"] == "b" * 12
    assert complete(http, bad_words=["bb", "ab"], **force)["choices"][0]["text"] == "b" + "a" * 11
    in_chat = chat(http, bad_words=["b"], **force)["choices"][0]["message"]["content"]
    assert in_chat == "a" * 12
    for bad in ([""], [" "], ["b", "\t\n"], "b", [1], ["x"] * 1025):
        error = assert_openai_error(post(http, "chat", {"bad_words": bad}), 400, "bad_words")
        assert error["message"].startswith("bad_words")
    error = assert_openai_error(post(http, "completions", {
        "allowed_token_ids": [a, b], "bad_words": ["a", "b"]}), 400)  # fmt: skip
    assert "only bad words" in error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_minus_one_and_zero_mean_off(http, off):
    seeded = {"temperature": 1.0, "seed": 7}
    plain = complete(http, **seeded)["choices"][0]["text"]
    assert complete(http, top_k=off, **seeded)["choices"][0]["text"] == plain


# -- unsupported fields --------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD = {  # endpoint, extra body, the param the error names
    "functions": ("chat", {"functions": [TOOL["function"]]}, "functions"),
    "function_call": ("chat", {"function_call": "auto"}, "function_call"),
    "response_format xml": ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    "a json_schema without its schema object": (
        "completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    "suffix": ("completions", {"suffix": "end"}, "suffix"),
    "best_of > n": ("completions", {"best_of": 3}, "best_of"),
    "best_of < n": ("completions", {"best_of": 1, "n": 2}, "best_of"),
    "an unknown field": ("completions", {"guided_whitespace_pattern": " "},
                         "guided_whitespace_pattern"),
    "an unknown chat field": ("chat", {"logprobs_mode": "raw"}, "logprobs_mode"),
    "reasoning_effort": ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    "store true": ("chat", {"store": True}, "store"),
    "service_tier flex": ("chat", {"service_tier": "flex"}, "service_tier"),
    "audio output": ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    "predicted outputs": ("chat", {"prediction": {"type": "content", "content": "x"}},
                          "prediction"),
    "a message without a role": ("chat", {"messages": [{"content": "x"}]}, "messages"),
    "an image part": ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages"),
    "logit_bias key not an id": ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    "logit_bias key negative": ("completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    "logit_bias > 100": ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    "logit_bias not a number": ("completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    "min_tokens < 0": ("completions", {"min_tokens": -1}, "min_tokens"),
    "top_k < -1": ("completions", {"top_k": -2}, "top_k"),
}  # fmt: skip
# Checked by the front end against the engine's vocabulary (259 ids): the message names the field.
OUT_OF_VOCAB = {
    "logit_bias id out of vocab": ({"logit_bias": {"100000": 1}}, "logit_bias"),
    "stop_token_ids out of vocab": ({"stop_token_ids": [100000]}, "stop_token_ids"),
    "min_tokens > max_tokens": ({"min_tokens": 7, "max_tokens": 6}, "min_tokens"),
}


def post(http: httpx.Client, endpoint: str, extra: dict) -> httpx.Response:
    if endpoint == "chat":
        body = {"messages": MESSAGES, "max_tokens": 4, **extra}
        return http.post("/v1/chat/completions", json=body)
    return http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra})


@pytest.mark.parametrize("case", list(BAD))
def test_unsupported_or_invalid_fields_are_400s_that_name_them(http, case):
    endpoint, extra, param = BAD[case]
    error = assert_openai_error(post(http, endpoint, extra), 400, param)
    assert error["message"].startswith(param)
    if case == "an image part":  # named, not "content should be a string"
        assert "content part 1 of type 'image_url'" in error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("case", list(OUT_OF_VOCAB))
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_token_ids_outside_the_vocabulary_are_400s(http, case, endpoint):
    extra, field = OUT_OF_VOCAB[case]
    error = assert_openai_error(post(http, endpoint, extra), 400, None)
    assert field in error["message"]
    assert_still_serving(http)


def test_a_400_names_every_invalid_field_and_no_json_offset_as_one(http):
    """All of the body's errors in one message (the first's field as `param`), and a body that
    is no JSON at all names no field: pydantic locates that error at a character offset."""
    error = assert_openai_error(post(http, "chat", {"logit_bias": {"bad1": 5, "bad2": 2}}), 400,
                                "logit_bias")  # fmt: skip
    assert "bad1" in error["message"] and "bad2" in error["message"]
    error = assert_openai_error(post(http, "completions", {"max_tokens": "4", "n": 0}), 400)
    assert "max_tokens" in error["message"] and "n:" in error["message"]
    broken = http.post("/v1/completions", content=b'{"prompt": "hi",',
                       headers={"content-type": "application/json"})  # fmt: skip
    error = assert_openai_error(broken, 400, None)
    assert error["param"] is None and "JSON" in error["message"]
    error = assert_openai_error(post(http, "completions", {"prompt": [7, 100000]}), 400)
    assert "out of vocabulary" in error["message"] and "100000" in error["message"]
    assert_still_serving(http)


def test_do_nothing_values_of_unsupported_fields_are_accepted(http):
    plain = chat(http)["choices"][0]["message"]["content"]
    accepted = chat(http, tools=[], tool_choice="none", response_format={"type": "text"},
                    parallel_tool_calls=False, function_call="none", store=False,
                    service_tier="auto", metadata={"run": "7"}, prompt_cache_key="k",
                    prompt_cache_retention="in-memory", safety_identifier="u1",
                    verbosity="medium", modalities=["text"], reasoning_effort=None, audio=None,
                    prediction=None, web_search_options=None)  # fmt: skip
    assert accepted["choices"][0]["message"]["content"] == plain
    tool_reply = {"role": "tool", "content": "42", "tool_call_id": "call_1"}  # to the template
    assert chat(http, messages=[*MESSAGES, tool_reply])["usage"]["completion_tokens"] == 6
    plain = complete(http, n=2)["choices"][0]["text"]
    same = complete(http, n=2, best_of=2, echo=False, suffix=None,
                    response_format={"type": "text"})  # fmt: skip
    assert same["choices"][0]["text"] == plain


def test_a_reply_appended_as_the_sdk_dumps_it_goes_on_with_the_chat(client):
    """`message.model_dump()` of a reply holds refusal, annotations, audio, function_call and
    tool_calls, all null: the usual way to keep a history, so they are accepted as they are."""
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
                                           temperature=0.0)  # fmt: skip
    reply = first.choices[0].message.model_dump()
    assert {"refusal", "tool_calls", "function_call", "audio"} <= set(reply)
    history = [*MESSAGES, reply, {"role": "user", "content": "?"}]  # the tests' context: 48
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=1,
                                            temperature=0.0)  # fmt: skip
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_a_messages_other_keys_and_any_role_reach_the_template(http):
    """vLLM hands a message's other keys and any role to the chat template: Qwen3's reads an
    assistant turn's `reasoning_content` (a reply under --reasoning-parser carries it, so a
    history that keeps replies as they came sends it back), and a role is the template's to
    render. The tests' template writes each message's role and content."""
    tokenizer = Tokenizer.from_dir(assets.qwen3_tokenizer_dir())
    history = [*MESSAGES, {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}]
    body = ChatCompletionRequest(messages=history, add_generation_prompt=False)
    text = OpenAIServing._render_chat(SimpleNamespace(tokenizer=tokenizer), body)
    assert text.endswith("<think>\ngreet\n</think>\n\nHello.<|im_end|>\n")
    custom = [{"role": "critic", "content": "Hi!"}]
    as_parts = [{"role": "critic", "content": [{"type": "text", "text": "Hi!"}]}]
    ids = http.post("/tokenize", json={"messages": custom}).json()["tokens"]
    assert http.post("/tokenize", json={"messages": as_parts}).json()["tokens"] == ids
    assert (
        http.post("/detokenize", json={"tokens": ids})
        .json()["prompt"]
        .startswith("<|im_start|>critic\nHi!<|im_end|>")
    )
    assert chat(http, messages=custom)["usage"]["prompt_tokens"] == len(ids)
    extra = [{**MESSAGES[0], "extra_field": "0"}]  # vLLM's test: accepted, the template ignores it
    assert chat(http, messages=extra)["choices"][0]["message"]["content"] == chat(http)[
        "choices"][0]["message"]["content"]  # fmt: skip


# -- request-level metrics -----------------------------------------------------------------


def scrape(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, its labels) -> value."""
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            pairs = (p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
            samples[name, frozenset((k, v.strip('"')) for k, v in pairs)] = float(value)
    return samples


def test_request_level_metrics_match_the_usage(http, eos_id):
    before = scrape(http)
    by_length = complete(http, max_tokens=5)
    by_stop = complete(http, logit_bias={str(eos_id): FORCE}, ignore_eos=False, min_tokens=2)
    after = scrape(http)

    def delta(name: str, **labels) -> float:
        key = (name, frozenset({"model_name": MODEL_NAME, **labels}.items()))
        return after[key] - before.get(key, 0.0)

    usages = [by_length["usage"], by_stop["usage"]]
    total = lambda field: sum(u[field] for u in usages)  # noqa: E731
    assert by_stop["choices"][0]["finish_reason"] == "stop"
    assert delta("vllm:request_prompt_tokens_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == total("prompt_tokens")
    assert delta("vllm:request_generation_tokens_sum") == total("completion_tokens")
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    # vLLM's count per step: a prompt when its first token comes, then one per token
    assert delta("vllm:iteration_tokens_total_sum") == total("total_tokens")
    times = {k: delta(f"vllm:request_{k}_time_seconds_sum")
             for k in ("queue", "prefill", "decode", "inference")}  # fmt: skip
    for kind in times:
        assert delta(f"vllm:request_{kind}_time_seconds_count") == 2
        assert times[kind] >= 0
    assert times["inference"] == pytest.approx(times["prefill"] + times["decode"])
    e2e = delta("vllm:e2e_request_latency_seconds_sum")  # the front end's clock, around the core's
    assert times["queue"] + times["inference"] <= e2e
    info = {"block_size": str(ENGINE["block_size"]), "num_gpu_blocks": str(ENGINE["num_kv_blocks"]),
            "num_cpu_blocks": "0", "enable_prefix_caching": "True"}  # fmt: skip
    assert after["vllm:cache_config_info", frozenset(info.items())] == 1.0
    token_buckets = sorted(float(dict(labels)["le"]) for name, labels in after
                           if name == "vllm:request_prompt_tokens_bucket")  # fmt: skip
    assert token_buckets == [1, 2, 5, 10, 20, 50, 100, float("inf")]  # 1-2-5 up to the context


def test_finished_request_stats_are_vllms_intervals():
    # the engine core's clock (the front end's `arrival` is another process's)
    timing = RequestTiming(arrival=0.0, core_arrival=10.0, scheduled=10.5, first_token=11.25,
                           finished=13.0)  # fmt: skip
    stats = finished_request_stats(timing, "stop", num_prompt_tokens=7, num_generation_tokens=4)
    assert (stats.queue_time, stats.prefill_time, stats.decode_time, stats.inference_time) == (
        0.5, 0.75, 1.75, 2.5,
    )  # fmt: skip
    assert build_1_2_5_buckets(128) == [1, 2, 5, 10, 20, 50, 100]


def test_the_generation_config_fills_what_a_request_leaves_unset(live_server, sent_params):
    """`serve --generation-config auto` (vLLM's default): the model's recommended sampling is
    used for the fields a request does not send, on every generation endpoint; what it sends
    wins. A completion's max_tokens is OpenAI's 16 when unset, as in vLLM."""
    defaults = {"temperature": 0.0, "top_k": 20, "max_tokens": 3}
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, sampling_defaults=defaults)
    sent = sent_params
    url = live_server.host.serve(build_app(live_server.llm, config))
    bodies = [("/v1/chat/completions", {"messages": MESSAGES}),
              ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0.5, "top_k": -1,
                                        "max_tokens": 5}),
              ("/v1/completions", {"prompt": "Hi"}),
              ("/v1/responses", {"input": "Hi"})]  # fmt: skip
    with httpx.Client(base_url=url, timeout=30) as http:
        for route, body in bodies:
            assert http.post(route, json=body).status_code == 200
    assert [(p.temperature, p.top_k, p.max_tokens) for p in sent] == [
        (0.0, 20, 3), (0.5, None, 5), (0.0, 20, 16), (0.0, 20, 3)]  # fmt: skip


def test_more_served_model_names_and_no_docs(live_server):
    """`--served-model-name a b`: requests may name either, /v1/models lists both, replies carry
    the first (vLLM's); `--disable-fastapi-docs`: no /docs, /redoc or /openapi.json."""
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, model_aliases=("alias",),
                          disable_fastapi_docs=True)  # fmt: skip
    url = live_server.host.serve(build_app(live_server.llm, config))
    with httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post(
            "/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 1}
        )
        assert reply.status_code == 200 and reply.json()["model"] == MODEL_NAME
        listed = [card["id"] for card in http.get("/v1/models").json()["data"]]
        assert listed == [MODEL_NAME, "alias"] and http.get("/v1/models/alias").status_code == 200
        body = {"model": "other", "prompt": "hi"}
        assert_openai_error(http.post("/v1/completions", json=body), 404, "model")
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 404
    assert httpx.get(live_server.base_url + "/openapi.json").status_code == 200  # by default


def test_a_template_variable_named_tokenize_is_a_400(http):
    """`tokenize` is the renderer's own argument (text for the server, ids for `LLM.chat`): a
    client's chat_template_kwargs naming it gets a 400, not a 500."""
    body = {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"tokenize": True}}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "messages")
    assert "tokenize" in error["message"]


def test_a_client_names_its_request(live_server, http):
    """vLLM's request ids: the body's `request_id`, or an X-Request-Id header (which wins),
    names the response ("chatcmpl-<name>", "cmpl-<name>", the Responses API's "resp_<name>");
    two requests of one name at once both run; --enable-request-id-headers echoes the header,
    or makes one."""
    chat = {"messages": MESSAGES, "max_tokens": 2}
    assert "x-request-id" not in http.post("/v1/chat/completions", json=chat).headers  # off
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, enable_request_id_headers=True)
    url = live_server.host.serve(build_app(live_server.llm, config))
    with httpx.Client(base_url=url, timeout=30) as named:
        reply = named.post("/v1/chat/completions", json={**chat, "request_id": "abc"})
        assert reply.json()["id"] == "chatcmpl-abc" and reply.headers["x-request-id"]
        traced = named.post("/v1/chat/completions", json={**chat, "request_id": "abc"},
                            headers={"x-request-id": "trace-1"})  # fmt: skip
        assert traced.json()["id"] == "chatcmpl-trace-1"
        assert traced.headers["x-request-id"] == "trace-1"
        body = {"prompt": "hi", "max_tokens": 2, "request_id": "abc"}
        assert named.post("/v1/completions", json=body).json()["id"] == "cmpl-abc"
        response = named.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                     "request_id": "abc"})  # fmt: skip
        assert response.json()["id"] == "resp_abc"
        streamed = {**body, "max_tokens": 8, "stream": True, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one name, two requests at once
            replies = list(pool.map(lambda _: named.post("/v1/completions", json=streamed),
                                    range(2)))  # fmt: skip
        assert [r.status_code for r in replies] == [200, 200]
        assert all(r.text.endswith("data: [DONE]\n\n") for r in replies)
        assert_openai_error(named.post("/v1/completions", json={**body, "request_id": "a b"}),
                            400, "request_id")  # fmt: skip
        spaced = named.post("/v1/completions", json=body, headers={"x-request-id": "a b"})
        assert_openai_error(spaced, 400, "request_id")
