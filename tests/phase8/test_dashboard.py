"""Phase 8 dashboard: /dashboard in a real browser while requests run, and `mini-vllm replay`.

The browser is headless Chromium (Debian's package; `.ci/setup --dev` installs it), driven
through the DevTools protocol (tests/chromium.py): it runs the page's own JavaScript against a
live server (a spawned engine core, as `mini-vllm serve` runs) with an API key, and the test
reads the DOM while requests run: the running requests appear in the table, the KV block map
changes (blocks held, shared by a common prompt prefix, freed), and the numbers on the page
equal what /metrics says. The engine core's steps are slowed (engine_cores.make_slow_test_llm)
so that a run lasts long enough for a page refreshed a few times a second to see it mid-flight.
Without Chromium the browser tests skip, except in CI (CI=true), where they fail: CI must run
them. The core's side (snapshots only while watched, spaced by their cost) is tested here too.
"""

import json
import os
import re
import threading
import time
from dataclasses import replace

import httpx
import pytest
import torch
from starlette.responses import Response

import phase4_scheduler as p4
import phase5_paged as p5
from phase8_serving import LLM
from phase8_serving.api_server import build_app
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.cli import main as cli_main
from phase8_serving.config import ServerConfig
from phase8_serving.core_messages import AbortRequests, WatchEngine
from phase8_serving.engine_core import MAX_SNAPSHOT_DUTY, EngineCore
from phase8_serving.replay import build_replay_app, load_frames
from phase8_serving.snapshot import MAX_MAP_CELLS, engine_snapshot
from tests.chromium import Chromium, find_chromium

from .conftest import MODEL_NAME, ServerHost, tiny_core_spec
from .engine_cores import make_slow_test_llm

KEY = "sekret"
AUTH = {"authorization": f"Bearer {KEY}"}
# A KV cache too small for all eight requests at once: they preempt one another.
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=40, block_size=8)
MAX_MODEL_LEN = 128
SHARED_PREFIX = "You are a helpful assistant; answer briefly. "  # 45 byte tokens: 5 blocks
NUM_REQUESTS, MAX_TOKENS = 8, 40
LOADED_S = 60  # an 8-token reply takes well under a second, unless the machine is loaded


@pytest.fixture(scope="module")
def dashboard_server(tiny_dir):
    spec = replace(tiny_core_spec(tiny_dir, **ENGINE), make_llm=make_slow_test_llm)
    llm = AsyncLLM.spawn(spec, MODEL_NAME)
    host = ServerHost()
    try:
        config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, api_key=KEY)
        yield host.serve(build_app(llm, config)), llm, host
    finally:
        host.close()
        llm.shutdown()


@pytest.fixture(scope="module")
def offline_engine(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", **ENGINE)
    yield llm.engine
    llm.shutdown()


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    if executable is None:
        message = "no chromium: `.ci/setup --dev` installs it as root (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with Chromium(executable) as chromium:
        yield chromium


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=LOADED_S).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([\w:]+)\{[^}]*\} (\S+)$", text, re.M)}


def send_requests(url: str) -> list[threading.Thread]:
    """Eight requests with one prompt prefix; the first runs alone for a moment, so the others
    find its prefix blocks in the cache."""

    def one(i: int) -> None:
        body = {"prompt": f"{SHARED_PREFIX}Question {i}?", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0.0}  # fmt: skip
        reply = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        assert reply.status_code == 200, reply.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    threads[0].start()
    time.sleep(0.3)
    for t in threads[1:]:
        t.start()
    return threads


LEGEND = "Object.fromEntries([...document.querySelectorAll('#kv-legend [data-kind]')]" \
         ".map(e => [e.dataset.kind, Number(e.dataset.count)]))"  # fmt: skip
RUNNING_ROWS = "document.querySelectorAll('#requests tr[data-status=running]').length"
VALUE = "document.getElementById('{}').dataset.value"


def test_the_page_shows_the_running_engine_and_the_numbers_of_metrics(dashboard_server, browser):
    url, *_ = dashboard_server
    before = metrics(url)  # the page's minute starts when it connects: from these totals on
    with browser.open(f"{url}/dashboard?key={KEY}") as page:  # a browser sends no header
        watch_a_run(page, url, before)


def watch_a_run(page, url: str, before: dict[str, float]) -> None:
    page.wait_for("document.getElementById('status').textContent === 'live'")
    assert page.evaluate("location.search") == "", "the key stays in the address bar"
    threads = send_requests(url)
    running, legends, batches = [], [], set()
    while any(t.is_alive() for t in threads):
        running.append(page.evaluate(RUNNING_ROWS))
        legends.append(page.evaluate(LEGEND))
        bar = page.evaluate("JSON.stringify(document.getElementById('budget-bar').dataset)")
        batches.add(bar)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert max(running) >= 2, f"the running requests never showed: {running}"
    states = {json.dumps(legend, sort_keys=True) for legend in legends}
    assert len(states) >= 3, f"the block map did not change: {states}"
    assert max(legend.get("held", 0) for legend in legends) > 0
    assert max(legend.get("shared", 0) for legend in legends) > 0, "no shared prefix block shown"
    assert len(batches) >= 2

    after = metrics(url)
    generated = after["vllm:generation_tokens_total"]
    assert generated - before["vllm:generation_tokens_total"] == NUM_REQUESTS * MAX_TOKENS
    # The page catches up within a frame or two once the engine is idle.
    page.wait_for(f"{VALUE.format('generated')} === '{int(generated)}' && "
                  f"{VALUE.format('num-running')} === '0'")  # fmt: skip
    page_value = lambda name: float(page.evaluate(VALUE.format(name)))  # noqa: E731
    assert page_value("preemptions") == after["vllm:num_preemptions_total"] > 0
    assert page_value("num-waiting") == after["vllm:num_requests_waiting"] == 0
    assert page_value("kv-usage") == after["vllm:kv_cache_usage_perc"] == 0
    hits = after["vllm:prefix_cache_hits_total"] / after["vllm:prefix_cache_queries_total"]
    assert hits > 0 and page_value("prefix-hits") == pytest.approx(hits)
    mean = lambda name: (  # noqa: E731
        (after[name + "_sum"] - before[name + "_sum"])
        / (after[name + "_count"] - before[name + "_count"])
    )
    assert page_value("ttft") == pytest.approx(mean("vllm:time_to_first_token_seconds"))
    assert page_value("tpot") == pytest.approx(mean("vllm:inter_token_latency_seconds"))
    log = page.evaluate("document.getElementById('preemption-log').textContent")
    assert "preempted" in log
    assert page.evaluate(LEGEND).get("held", 0) == 0, "every block is free again"


def test_the_dashboard_needs_the_api_key(dashboard_server):
    url, *_ = dashboard_server
    for path in ("/dashboard", "/dashboard/events", "/dashboard/info"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, params={"key": "wrong"}).status_code == 401
    assert httpx.get(url + "/dashboard/info", headers=AUTH).status_code == 200
    page = httpx.get(url + "/dashboard", params={"key": KEY})
    assert page.status_code == 200 and "dashboard.js" in page.text
    cookie = page.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "Path=/dashboard" in cookie
    cookies = {"mini_vllm_dashboard_key": KEY}
    assert httpx.get(url + "/dashboard/info", cookies=cookies).json()["mode"] == "live"
    # The key is good for the dashboard only: the API still wants the header.
    body = {"prompt": "hi", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body, cookies=cookies).status_code == 401
    assert httpx.post(url + "/v1/completions", params={"key": KEY}, json=body).status_code == 401


def test_the_dashboard_behind_a_proxy_prefix(dashboard_server, browser):
    """--root-path /llm: the page, its script, info and events answer under the prefix, the
    key's cookie is the prefixed path's, and in a browser the page goes live there: its own
    requests go to where it came from, not to /dashboard."""
    _, llm, host = dashboard_server
    config = ServerConfig(MODEL_NAME, MAX_MODEL_LEN, api_key=KEY, root_path="/llm")
    app = build_app(llm, config)

    async def proxy(scope, receive, send):  # forwards only what is under its prefix
        if scope["type"] == "http" and not scope["path"].startswith("/llm/"):
            return await Response("not forwarded", 404)(scope, receive, send)
        await app(scope, receive, send)

    url = host.serve(proxy) + "/llm"
    page = httpx.get(url + "/dashboard", params={"key": KEY})
    assert page.status_code == 200 and "Path=/llm/dashboard" in page.headers["set-cookie"]
    script = re.search(r'<script src="([^"]+)"', page.text).group(1)
    assert httpx.get(httpx.URL(url + "/dashboard").join(script), headers=AUTH).status_code == 200
    cookies = {"mini_vllm_dashboard_key": KEY}
    assert httpx.get(url + "/dashboard/info", cookies=cookies).json()["mode"] == "live"
    assert httpx.get(url + "/dashboard/info").status_code == 401
    with browser.open(f"{url}/dashboard?key={KEY}") as tab:
        tab.wait_for("document.getElementById('status').textContent === 'live'")


def next_frame(lines) -> dict:
    return json.loads(next(line for line in lines if line)[len("data: ") :])


def test_no_page_open_no_snapshot(dashboard_server):
    """The core sends every snapshot it takes, so counting them in the front end counts them."""
    url, llm, _ = dashboard_server
    time.sleep(0.3)  # the pages of earlier tests are gone
    received = []
    llm.on_engine_stats(lambda core, snapshot: received.append(snapshot))
    body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    assert (
        httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=LOADED_S).status_code
        == 200
    )
    assert received == [], "snapshots were taken with nobody watching"
    with httpx.stream("GET", url + "/dashboard/events", headers=AUTH, timeout=10) as events:
        frame = next_frame(events.iter_lines())  # the idle engine's state, sent at once
        assert frame["kv"]["num_blocks"] == ENGINE["num_kv_blocks"]
        assert frame["num_running"] == 0 and frame["cost_s"] > 0
    time.sleep(2.0)  # the server notices the page left (seconds, on a loaded 2-core machine)
    count = len(received)
    assert (
        httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=LOADED_S).status_code
        == 200
    )
    time.sleep(0.3)
    assert count > 0 and len(received) == count, "snapshots went on after the page closed"


def test_the_engine_is_watched_while_any_page_is_open(dashboard_server):
    url, *_ = dashboard_server
    body = {"prompt": "two pages", "max_tokens": 8, "ignore_eos": True}
    with (
        httpx.stream("GET", url + "/dashboard/events", headers=AUTH, timeout=10) as first,
        httpx.stream("GET", url + "/dashboard/events", headers=AUTH, timeout=10) as second,
    ):
        step = next_frame(first.iter_lines())["step"]
        lines = second.iter_lines()
        assert next_frame(lines)["step"] == step
        first.close()
        time.sleep(0.3)  # the server notices the first page left
        assert (
            httpx.post(
                url + "/v1/completions", json=body, headers=AUTH, timeout=LOADED_S
            ).status_code
            == 200
        )
        assert next_frame(lines)["step"] > step, "the second page got no more frames"


def test_a_costly_snapshot_is_taken_less_often(tiny_dir, offline_engine):
    spec = tiny_core_spec(tiny_dir)
    core = EngineCore(offline_engine, spec, socket=None)  # no front end yet: it sends nothing
    change = AbortRequests([])  # a message that may change the engine, as a step may
    now = time.monotonic()
    core._handle(change)
    assert core._snapshot(now) is None, "unwatched"
    core._handle(WatchEngine(True))
    snapshot = core._snapshot(now)
    assert snapshot is not None and core._snapshot(now) is None  # nothing changed since
    core._handle(change)
    wait = max(spec.snapshot_interval_s, snapshot["cost_s"] / MAX_SNAPSHOT_DUTY)
    assert core._snapshot(now + 0.99 * wait) is None
    assert core._snapshot(now + wait) is not None
    core._handle(WatchEngine(False))
    core._handle(change)
    assert core._snapshot(now + 100 * wait) is None, "unwatched again"


def test_a_snapshot_descheduled_midway_costs_only_its_cpu_time(tiny_dir, offline_engine):
    """A core that waits 50 ms for the host's CPU inside a snapshot (a busy 2-core machine) is
    charged the snapshot's CPU time: at 0.25 % duty, wall time would hold the next frame back 20 s,
    and a page would stay on one state for the rest of a run."""

    def descheduled(engine):
        time.sleep(0.05)
        return engine_snapshot(engine)

    spec = replace(tiny_core_spec(tiny_dir), snapshot=descheduled)
    core = EngineCore(offline_engine, spec, socket=None)
    core._handle(WatchEngine(True))
    now = time.monotonic()
    snapshot = core._snapshot(now)
    assert snapshot["cost_s"] < 0.025  # not the 50 ms asleep (a garbage collection may count)
    core._handle(AbortRequests([]))
    due = now + max(spec.snapshot_interval_s, snapshot["cost_s"] / MAX_SNAPSHOT_DUTY)  # < 10 s
    assert core._snapshot(due) is not None


def test_disable_dashboard(dashboard_server):
    _, llm, _ = dashboard_server
    app = build_app(llm, ServerConfig(MODEL_NAME, MAX_MODEL_LEN, enable_dashboard=False))
    assert not any(getattr(r, "path", "").startswith("/dashboard") for r in app.routes)


def test_snapshot_is_bounded(offline_engine):
    snapshot = engine_snapshot(offline_engine)
    cells = sum(count for count, *_ in snapshot["kv"]["runs"])
    assert cells == ENGINE["num_kv_blocks"] <= MAX_MAP_CELLS and snapshot["kv"]["stride"] == 1
    json.dumps(snapshot)  # plain data only


# -- replay --------------------------------------------------------------------------------

TINY = dict(vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=16, intermediate_size=64, max_position_embeddings=256)  # fmt: skip


def record_trace(mod, path, **engine_kwargs) -> list:
    """A small run of phase 4 or 5 with a shared prompt prefix, written as trace JSON."""
    torch.manual_seed(0)
    trace = mod.StepTrace()
    model = mod.TinyTransformer(mod.ModelConfig(**TINY)).eval()
    llm = mod.LLM(model, trace=trace, max_num_seqs=4, max_num_batched_tokens=32, **engine_kwargs)
    prompts = [list(range(1, 33)) + [i] * (3 + i) for i in range(6)]
    params = [mod.SamplingParams(temperature=0.0, max_tokens=6 + 4 * i) for i in range(6)]
    llm.generate(prompts, params, use_tqdm=False)
    trace.to_chrome(path)
    return trace.steps


def test_replay_frames_follow_the_trace(tmp_path):
    steps = record_trace(p5, tmp_path / "p5.json", num_kv_blocks=24, block_size=8)
    frames = load_frames(tmp_path / "p5.json")
    assert [f["step"] for f in frames] == [r.step for r in steps]
    for frame, record in zip(frames, steps, strict=True):
        runs = frame["kv"]["runs"]
        assert sum(count for count, *_ in runs) == 24
        # every block-table entry is one reference: sum of kv_held = sum of ref_cnt
        held = sum(r["kv_held"] for r in frame["requests"])
        assert held == sum(count * ref_cnt for count, _, ref_cnt, _ in runs)
        assert frame["batch"]["prefill_tokens"] == sum(record.prefill.values())
        assert frame["batch"]["decode_tokens"] == len(record.decode)
    assert any(ref_cnt > 1 for f in frames for _, _, ref_cnt, _ in f["kv"]["runs"])
    steps4 = record_trace(p4, tmp_path / "p4.json", num_kv_slots=160)
    frames4 = load_frames(tmp_path / "p4.json")
    assert len(frames4) == len(steps4)
    for frame, record in zip(frames4, steps4, strict=True):
        regions = frame["kv"]["regions"]
        assert sum(capacity for _, _, capacity, _ in regions) == record.kv_reserved
        assert sum(used for *_, used in regions) == record.kv_used


def test_replay_refuses_what_is_not_a_trace(tmp_path, capsys):
    (tmp_path / "old.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "x"}]}))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="no scheduler states"):
        load_frames(tmp_path / "old.json")
    for name in ("junk.json", "missing.json"):
        with pytest.raises(SystemExit, match="not a Chrome trace"):
            cli_main(["replay", str(tmp_path / name)])


def test_replay_page_has_a_step_slider(tmp_path, browser):
    record_trace(p4, tmp_path / "p4.json", num_kv_slots=160)
    host = ServerHost()
    try:
        url = host.serve(build_replay_app(tmp_path / "p4.json"))
        with browser.open(f"{url}/dashboard?step=5") as page:
            check_the_slider(page)
    finally:
        host.close()


def check_the_slider(page) -> None:
    label = page.wait_for("document.getElementById('slider-label').textContent")
    assert label.startswith("step 5 of ")
    assert page.evaluate(LEGEND)["used"] > 0  # phase 4's map: slots in regions
    page.evaluate("const s = document.getElementById('slider'); s.value = s.max;"
                  "s.dispatchEvent(new Event('input')); 0")  # fmt: skip
    assert page.evaluate(LEGEND).get("used", 0) == 0, "the last step leaves no region"
    assert page.evaluate(RUNNING_ROWS) == 0
