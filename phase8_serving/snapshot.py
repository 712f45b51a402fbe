"""Engine snapshots: the engine's state after a step, small and plain, for the dashboard.

Problem: a person watching the server wants the scheduler's queues, what the last step batched,
and where the KV cache's blocks went, live. That state lives where the engine steps (the engine
core's process), is large (an H200 holds 40,000 blocks) and changes every few milliseconds.
Idea: `engine_snapshot(engine)` runs where the engine runs, between two steps, and returns a dict
of plain ints, floats, strs, lists and None (JSON or msgpack as it is), whose size does not grow
with the load: at most `MAX_LISTED_REQUESTS` requests are listed (the counts stay exact), and the
block map is run-length encoded over at most `MAX_MAP_CELLS` cells (a larger pool is sampled
every stride-th block). It is the engine core's `EngineCoreSpec.snapshot`: the core takes one
only while a dashboard page is open, at a bounded rate, and sends it with the step's outputs
(engine_core.py).

The same dict describes a replayed trace's steps (replay.py), so one page draws both:
- `step`, `time` (seconds; wall clock live), `cost_s` (what taking the snapshot cost: the core
  measures it and adds it, with `step_num_tokens`);
- `requests`: dicts with `id`, `seq_id`, `status` (running/swapped/waiting), `prompt_tokens`,
  `computed_tokens`, `output_tokens`, `max_tokens`, `kv_held` (blocks);
  `num_running`, `num_swapped`, `num_waiting`: the exact counts;
- `batch`: the last step's `prefill_tokens`, `decode_tokens`, `num_seqs` and `token_budget`;
- `preempted`: request ids preempted by the last step; `num_preemptions`: since start;
- `kv`: trace.py's `kv_map` (runs of [count, owner seq_id, ref_cnt, cached]);
  `kv_usage` (fraction of blocks referenced), `prefix_cache` (`queries`, `hits`: tokens);
- `state_slots`: a hybrid model's state pool, `held` and `total` slots (null for other models).

Invariant: a snapshot reads the engine and changes nothing in it.
"""

import itertools
import time

from .engine import LLMEngine
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .trace import kv_map

MAX_LISTED_REQUESTS = 64  # a browser table, not a database: running first, then swapped, waiting
MAX_MAP_CELLS = 2048  # cells of the block map; a larger pool is sampled every stride-th block


def engine_snapshot(engine: LLMEngine) -> dict:
    """The engine's state now (call it between steps, where the engine runs)."""
    scheduler, bm = engine.scheduler, engine.block_manager
    queues = (scheduler.running, scheduler.swapped, scheduler.waiting)
    listed = list(itertools.islice(itertools.chain(*queues), MAX_LISTED_REQUESTS))
    stride = -(-len(bm.blocks) // MAX_MAP_CELLS)  # ceil: 1 up to MAX_MAP_CELLS blocks
    return {
        "step": engine.num_steps,
        "time": time.time(),
        "requests": [request_state(seq, bm) for seq in listed],
        "num_running": len(scheduler.running),
        "num_swapped": len(scheduler.swapped),
        "num_waiting": len(scheduler.waiting),
        "batch": batch_split(engine.last_schedule, engine.config.max_num_batched_tokens),
        "preempted": [seq.request_id for seq in engine.last_schedule.preempted],
        "num_preemptions": engine.num_preemptions,
        "kv": kv_map(bm, stride),
        "kv_usage": bm.num_used_blocks / len(bm.blocks),
        "prefix_cache": {"queries": bm.num_queried_tokens, "hits": bm.num_hit_tokens},
        "state_slots": state_slots(engine),
    }


def state_slots(engine: LLMEngine) -> dict | None:
    """A hybrid model's state pool (state_pool.py): slots held and in all; None without one."""
    pool = engine.runner.state_pool
    return None if pool is None else {"held": len(pool.slots), "total": pool.num_slots}


def request_state(seq: Sequence, block_manager) -> dict:
    return {
        "id": seq.request_id,
        "seq_id": seq.seq_id,
        "status": seq.status.value,
        "prompt_tokens": seq.num_prompt_tokens,
        "computed_tokens": seq.num_computed_tokens,
        "output_tokens": seq.num_output_tokens,
        "max_tokens": seq.params.max_tokens,
        "kv_held": len(block_manager.block_tables.get(seq.seq_id, ())),
    }


def batch_split(out: SchedulerOutput, token_budget: int) -> dict:
    """The step's tokens as prefill and decode, by trace.py's rule (read after the step): a
    sequence's single new token is decode once it has caught up with its prompt."""
    decode = sum(
        1 for seq, n in out.scheduled if n == 1 and seq.num_computed_tokens > seq.num_prompt_tokens
    )
    return {
        "prefill_tokens": out.num_batched_tokens - decode,
        "decode_tokens": decode,
        "num_seqs": len(out.scheduled),
        "token_budget": token_budget,
    }
