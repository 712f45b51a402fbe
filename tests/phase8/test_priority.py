"""Priority scheduling (vLLM's `scheduling_policy="priority"`, scheduler.py): a request of a better
(lower) priority goes first, and takes a running sequence's place when the running cap or the KV
cache keeps it out; among equal priorities the scheduler is the fair first-come one, step for
step. Without the policy a priority other than 0 is refused, offline and served.

The workload is test_fairness.py's: a big request of N long choices, then a chat. There each
choice was a request of its own (no group) and the chat waited for whatever they held; here the
chat's better priority brings its first token within a few steps under each constraint, and a
worse one leaves it waiting, so the test measures the priorities, not luck.
"""

import random

import httpx
import msgspec
import pytest

from phase8_serving import LLM, SamplingParams
from phase8_serving.config import ServerConfig
from phase8_serving.core_messages import AddRequests, EngineCoreRequest
from phase8_serving.engine_core import EngineCore

from .conftest import MAX_MODEL_LEN, MODEL_NAME, assert_openai_error, tiny_core_spec
from .test_fairness import (
    BIG_TOKENS,
    CHAT_TOKENS,
    CONSTRAINTS,
    FIRST_TOKEN_STEPS,
    W_LIKE,
    N,
    add_big,
    make_engine,
    random_engine,
    random_requests,
    run,
    run_arrivals,
    schedules,
    spread_dir,  # noqa: F401 (a fixture)
)

PRIORITY = {"scheduling_policy": "priority"}


def chat_first_token(
    directory, constraint: str, chat_priority: int, arrival: int | None = None,
    chat_tokens: int = CHAT_TOKENS,
) -> tuple[int | None, dict, int]:  # fmt: skip
    """The big request (N choices, each its own request, priority 1), then the chat at its
    arrival step (never preempted if its priority is better): -> (steps from its arrival to its
    first token, every request's tokens, the preemptions)."""
    config, prompt_len, prompts, arrives = CONSTRAINTS[constraint]
    engine = make_engine(directory, **{"max_num_seqs": 32, "max_num_batched_tokens": 256,
                                       **config, **PRIORITY})  # fmt: skip
    add_big(engine, prompt_len, prompts, group_id=None, priority=1)
    first_token, tokens = run(engine, arrives if arrival is None else arrival, chat_tokens,
                              chat_priority, chat_yields=chat_priority >= 1)  # fmt: skip
    return first_token, tokens, engine.num_preemptions


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_a_better_priority_goes_first(spread_dir, constraint):  # noqa: F811
    first_token, tokens, _ = chat_first_token(spread_dir, constraint, chat_priority=0)
    assert first_token is not None and first_token <= FIRST_TOKEN_STEPS, first_token
    assert len(tokens["chat"]) == CHAT_TOKENS
    assert all(len(tokens[f"big-{i}"]) == BIG_TOKENS for i in range(N))
    late, _, _ = chat_first_token(spread_dir, constraint, chat_priority=2)  # a worse one waits
    assert late > 3 * FIRST_TOKEN_STEPS


def test_a_better_priority_is_not_the_one_preempted(spread_dir):  # noqa: F811
    """A long chat of a better priority, admitted while the choices still fit, is not the one
    preempted when they outgrow the KV cache (from step ~40): `running` is in priority order,
    and preemption takes from its back (chat_first_token checks every step)."""
    _, tokens, preemptions = chat_first_token(spread_dir, "kv_cache", chat_priority=0,
                                              arrival=15, chat_tokens=40)  # fmt: skip
    assert preemptions > 0 and len(tokens["chat"]) == 40


def test_equal_priorities_are_scheduled_as_first_come(spread_dir):  # noqa: F811
    """All priorities 0 under the policy: the same steps as "fcfs", preemptions included."""
    runs = []
    for policy in ("fcfs", "priority"):
        engine = make_engine(spread_dir, **W_LIKE, scheduling_policy=policy)
        recorded = schedules(engine)
        for i in range(12):
            params = SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
            engine.add_request([(5 * i + j) % 250 + 1 for j in range(6 + 4 * i)], params)
        while engine.has_unfinished_requests():
            engine.step()
        runs.append(recorded)
    assert any(preempted for _, preempted, _ in runs[1]) and runs[0] == runs[1]


@pytest.mark.parametrize("seed", range(4))
def test_random_priorities_under_pressure_finish_with_their_own_tokens(spread_dir, seed):  # noqa: F811
    """Random requests of random priorities under random limits: the queues stay in priority
    order (check_invariants), nothing stalls, and every choice says what it says without
    priorities."""
    rng = random.Random(seed)
    choices = random_requests(rng)
    ranks = {group: rng.randint(-2, 2) for _, _, group, _, _ in choices}
    engine = random_engine(spread_dir, random.Random(seed))
    engine = make_engine(spread_dir, **{**_config_of(engine), **PRIORITY})
    add = engine.add_request
    engine.add_request = lambda prompt, params, request_id, group_id=None: add(
        prompt, params, request_id, group_id, priority=ranks[request_id.split("-")[0]]
    )
    prioritized = run_arrivals(engine, choices, True)
    plain = run_arrivals(random_engine(spread_dir, random.Random(seed)), choices, True)
    assert prioritized == plain


def _config_of(engine) -> dict:
    config = engine.config
    return {name: getattr(config, name) for name in (
        "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
        "enable_prefix_caching", "async_scheduling", "preemption_mode", "num_cpu_kv_blocks",
        "enable_chunked_prefill")}  # fmt: skip


def test_a_priority_needs_the_policy_offline(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="needs scheduling_policy 'priority'"):
        llm.generate(["a", "b"], params, priority=[0, 3])
    with pytest.raises(TypeError, match="priority must be an int"):
        llm.add_request("a", params, priority=True)
    with pytest.raises(ValueError, match="one int per prompt"):
        llm.generate(["a", "b"], params, priority=[0])
    assert not llm.has_unfinished_requests()
    assert len(llm.generate(["a", "b"], params, priority=[0, 0], use_tqdm=False)) == 2
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(tiny_dir, scheduling_policy="lifo")


def test_the_server_passes_a_priority_and_refuses_one_without_the_policy(live_server,
                                                                         monkeypatch):  # fmt: skip
    """A request's `priority` reaches the engine core's request; under "fcfs" (the live
    server's core) one other than 0 is a 400 naming it, before anything is tokenized."""
    sent, add = [], live_server.llm.client.add

    def spy(core, requests):
        sent.extend(r.priority for r in requests)
        add(core, [msgspec.structs.replace(r, priority=0) for r in requests])  # the core's fcfs

    with httpx.Client(base_url=live_server.base_url, timeout=30) as http:
        body = {"prompt": "hi", "max_tokens": 2, "priority": 3}
        assert_openai_error(http.post("/v1/completions", json=body), 400, "priority")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
        assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, "priority")
        assert_openai_error(http.post("/v1/responses", json={"input": "hi", "priority": 2}), 400,
                            "priority")  # fmt: skip
        assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
        core = live_server.llm.client.cores[0]
        monkeypatch.setattr(live_server.llm.client, "add", spy)
        monkeypatch.setattr(
            core, "info", msgspec.structs.replace(core.info, scheduling_policy="priority")
        )
        for route, request in (("/v1/completions", body), ("/v1/chat/completions", chat),
                               ("/v1/responses", {"input": "hi", "priority": 2})):  # fmt: skip
            assert http.post(route, json=request).status_code == 200
    assert sent == [3, -1, 2]
    live_server.wait_until_idle(timeout=2.0)
    ServerConfig(MODEL_NAME, MAX_MODEL_LEN)  # the policy is the engine's, not the server's


def test_the_engine_core_queues_a_request_at_its_priority(tiny_dir):
    spec = tiny_core_spec(tiny_dir, **PRIORITY)
    engine = LLM(tiny_dir, dtype="float32", device="cpu", **PRIORITY).engine
    core = EngineCore(engine, spec, socket=None)
    params = SamplingParams(max_tokens=2)
    core._handle(AddRequests([EngineCoreRequest(f"r{p}", [5, 6], params, None, p)
                              for p in (4, -1, 2)]))  # fmt: skip
    assert [seq.priority for seq in engine.scheduler.waiting] == [-1, 2, 4]
