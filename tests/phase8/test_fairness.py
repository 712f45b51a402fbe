"""Fair share across client requests: one request's n choices cannot keep another's first token
waiting (scheduler.py).

A client asks for n=8 choices of a long reply; a second client arrives with a short chat while
they run. First come, first served per sequence makes the chat wait for whatever the choices hold:
every running slot (until they finish), the KV cache (until they finish), or the front of the
queue and the step's budget (until their prompts are in). With the choices sharing a `group_id`,
the chat's first token comes within a few steps in each case, and the choices' own tokens do not
change. With one sequence per request (workload W, the offline `generate`) the scheduler must be
phase 7's, step for step: fairness costs W nothing.
"""

import random

import pytest

import phase7_optim
import phase8_serving
from phase8_serving import SamplingParams

from .conftest import save_tiny_checkpoint

N = 8  # the choices of the big request
BIG_TOKENS = 60  # each choice's max_tokens: the big request runs ~60 steps
CHAT_TOKENS = 16
ARRIVAL_STEP = 3  # the chat arrives after this many steps of the big request
FIRST_TOKEN_STEPS = 3  # the chat's first token within this many steps of its arrival


@pytest.fixture(scope="module")
def spread_dir(tmp_path_factory):
    # test_cross_phase.py's checkpoint: spread-out logits, so greedy tokens have clear winners
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-spread-qwen3"),
        num_hidden_layers=2, initializer_range=0.2, tie_word_embeddings=False,
        max_position_embeddings=512,
    )  # fmt: skip


def make_engine(directory, module=phase8_serving, **config):
    return module.LLM(directory, dtype="float32", device="cpu", **config).engine


def add_big(
    engine, prompt_len: int, prompts: int = 1, group_id: str | None = "big", seeded: bool = False,
    priority: int = 0,
) -> None:  # fmt: skip
    """The big request: N sequences, choices of `prompts` different prompts (one group, as the
    server sends a request's prompts x n); greedy, or sampled with a seed per choice."""
    for i in range(N):
        sampling = dict(temperature=0.8, seed=i) if seeded else dict(temperature=0.0)
        params = SamplingParams(max_tokens=BIG_TOKENS, ignore_eos=True, **sampling)
        prompt = [(7 * j + i % prompts) % 250 + 1 for j in range(prompt_len)]
        engine.add_request(prompt, params, f"big-{i}", group_id=group_id, priority=priority)


def add_chat(engine, max_tokens: int = CHAT_TOKENS, priority: int = 0) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.add_request(list(range(30, 70)), params, "chat", priority=priority)  # alone


def run(
    engine, chat_at: int | None = ARRIVAL_STEP, chat_tokens: int = CHAT_TOKENS,
    chat_priority: int = 0, chat_yields: bool = False,
) -> tuple[int | None, dict[str, list[int]]]:  # fmt: skip
    """Steps until done (the chat added after `chat_at` steps); checks the invariants and that
    the chat is never preempted (unless it may yield). -> (steps from the chat's arrival to its
    first token, tokens)."""
    tokens: dict[str, list[int]] = {}
    steps, first_token = 0, None
    while engine.has_unfinished_requests() or steps <= (chat_at or 0):
        if steps == chat_at:
            arrival = steps
            add_chat(engine, chat_tokens, chat_priority)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "chat" and first_token is None:
                first_token = steps + 1 - arrival
        steps += 1
        engine.scheduler.check_invariants()
        if not chat_yields:
            assert "chat" not in [s.request_id for s in engine.last_schedule.preempted]
    return first_token, tokens


PREEMPTION = {"recompute": {}, "swap": dict(preemption_mode="swap", num_cpu_kv_blocks=16)}
# (engine config, the big request's prompt length and number of prompts, the chat's arrival step)
CONSTRAINTS = {
    # n fills the running cap: the chat got a slot when the choices finished (58 steps)
    "running_cap": (dict(max_num_seqs=N), 8, 1, ARRIVAL_STEP),
    # n x 68 tokens outgrow the KV cache (448 slots) from step ~40: the chat, arriving then, got
    # in behind the choices preempted by their growth, when the first of them finished (16)
    "kv_cache": (dict(num_kv_blocks=28, block_size=16), 8, 1, 45),
    # the same in swap mode: the swapped-out choices went back in before anyone was admitted
    "kv_cache_swap": (dict(num_kv_blocks=28, block_size=16, **PREEMPTION["swap"]), 8, 1, 45),
    # N different prompts of 120 tokens, a 64-token budget: the chat waited for all of them (14)
    "budget": (dict(max_num_batched_tokens=64), 120, N, ARRIVAL_STEP),
}


def constrained(directory, constraint: str, group_id: str | None) -> tuple[int | None, dict]:
    config, prompt_len, prompts, arrival = CONSTRAINTS[constraint]
    engine = make_engine(directory, **{"max_num_seqs": 32, "max_num_batched_tokens": 256, **config})
    add_big(engine, prompt_len, prompts, group_id)
    return run(engine, arrival)


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_a_request_of_n_choices_does_not_keep_another_waiting(spread_dir, constraint):
    first_token, tokens = constrained(spread_dir, constraint, "big")
    assert first_token is not None and first_token <= FIRST_TOKEN_STEPS, first_token
    assert len(tokens["chat"]) == CHAT_TOKENS
    assert all(len(tokens[f"big-{i}"]) == BIG_TOKENS for i in range(N))


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_sequences_of_their_own_are_served_first_come_first_served(spread_dir, constraint):
    """The same workload without groups (each choice a request of its own): the chat waits, as
    before fairness. This test shows that the one above measures the groups, not luck."""
    first_token, _ = constrained(spread_dir, constraint, None)
    assert first_token > 3 * FIRST_TOKEN_STEPS


def test_the_request_that_runs_the_most_gives_way_when_the_cache_runs_out(spread_dir):
    """A long chat, admitted last while the choices still fit, is not the one preempted when
    they outgrow the KV cache (at step ~40): the newest of the choices is. (Phase 7's LIFO took
    the newest sequence: the chat.)"""
    config, prompt_len, _, _ = CONSTRAINTS["kv_cache"]
    engine = make_engine(spread_dir, max_num_seqs=32, max_num_batched_tokens=256, **config)
    add_big(engine, prompt_len)
    _, tokens = run(engine, chat_at=15, chat_tokens=40)  # run() checks it is never preempted
    assert engine.num_preemptions > 0 and len(tokens["chat"]) == 40


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_choices_tokens_do_not_depend_on_the_chat(spread_dir, async_scheduling):
    """Giving way (preempted, then recomputed) changes when a choice runs, never what it says:
    seeded choices, with overlap scheduling (a choice gives way while its token is in flight)
    and without."""
    config = dict(max_num_seqs=N, max_num_batched_tokens=256, async_scheduling=async_scheduling)
    alone = make_engine(spread_dir, **config)
    add_big(alone, 8, seeded=True)
    _, expected = run(alone, chat_at=None)
    shared = make_engine(spread_dir, **config)
    add_big(shared, 8, seeded=True)
    _, tokens = run(shared)
    assert shared.num_preemptions > 0  # a choice gave way to the chat
    assert {k: v for k, v in tokens.items() if k != "chat"} == expected
    assert len({tuple(v) for v in expected.values()}) == N  # the seeds matter


def schedules(engine) -> list:
    """Every step's (scheduled (seq_id, num_new), preempted seq_ids, blocks swapped out),
    recorded as it runs."""
    recorded, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        scheduled = [(seq.seq_id, num_new) for seq, num_new in out.scheduled]
        preempted = [seq.seq_id for seq in out.preempted]
        recorded.append((scheduled, preempted, len(out.blocks_to_swap_out)))
        return out

    engine.scheduler.schedule = recording
    return recorded


W_LIKE = dict(max_num_seqs=6, max_num_batched_tokens=48, num_kv_blocks=24, block_size=8)


@pytest.mark.parametrize("preemption", list(PREEMPTION))
def test_one_sequence_per_request_is_scheduled_as_in_phase7(spread_dir, preemption):
    """Singleton groups (W, `generate`): the same steps as phase 7's scheduler, preemptions and
    chunks included, so fairness costs a workload of independent requests nothing."""
    runs = []
    for module in (phase7_optim, phase8_serving):
        engine = make_engine(spread_dir, module, **W_LIKE, **PREEMPTION[preemption])
        recorded = schedules(engine)
        for i in range(12):
            params = module.SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
            engine.add_request([(5 * i + j) % 250 + 1 for j in range(6 + 4 * i)], params)
        while engine.has_unfinished_requests():
            engine.step()
        runs.append(recorded)
    assert any(preempted for _, preempted, _ in runs[1])  # under pressure: the rules all apply
    assert any(swapped for _, _, swapped in runs[1]) == (preemption == "swap")
    assert runs[0] == runs[1]


def random_engine(directory, rng: random.Random):
    """A small engine under random pressure: cap, budget, KV cache, prefix caching, overlap,
    swap mode, whole prompts only."""
    config = dict(
        max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([16, 64]),
        num_kv_blocks=rng.choice([12, 20, 40]), block_size=4,
        enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.5,
    )  # fmt: skip
    if rng.random() < 0.3:
        config.update(preemption_mode="swap", num_cpu_kv_blocks=rng.choice([4, 16]))
    if rng.random() < 0.2:
        config.update(enable_chunked_prefill=False, max_num_batched_tokens=64)
    return make_engine(directory, **config)


def random_requests(rng: random.Random) -> list[tuple[int, str, str, list[int], int]]:
    """A few requests of 1 to 6 choices arriving at random steps: (step, id, group, prompt,
    max_tokens) per choice."""
    choices = []
    for g in range(rng.randint(2, 5)):
        at, prompt = rng.randint(0, 20), [rng.randint(1, 250) for _ in range(rng.randint(1, 20))]
        max_tokens, n = rng.randint(1, 12), rng.randint(1, 6)
        choices += [(at, f"g{g}-{i}", f"g{g}", prompt, max_tokens) for i in range(n)]
    return sorted(choices)


def run_arrivals(engine, choices, grouped: bool) -> dict[str, list[int]]:
    tokens, pending, steps = {}, list(choices), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            _, request_id, group_id, prompt, max_tokens = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(prompt, params, request_id, group_id=group_id if grouped else None)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < MAX_RANDOM_STEPS, "the engine stopped making progress"
    return tokens


MAX_RANDOM_STEPS = 1000  # each random workload takes under 100 steps


@pytest.mark.parametrize("seed", range(8))
def test_random_requests_under_pressure_finish_with_their_own_tokens(spread_dir, seed):
    """Requests of random sizes arriving at random steps, under random limits: the invariants
    hold after every step, nothing stalls, and every choice says what it says when each
    sequence is a request of its own (no fairness at all)."""
    choices = random_requests(random.Random(seed))
    grouped = run_arrivals(random_engine(spread_dir, random.Random(seed)), choices, True)
    alone = run_arrivals(random_engine(spread_dir, random.Random(seed)), choices, False)
    assert {c[1]: len(grouped[c[1]]) for c in choices} == {c[1]: c[4] for c in choices}
    assert grouped == alone
