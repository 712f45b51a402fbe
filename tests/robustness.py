"""The check every robustness test of phases 4-6 ends with: after an error, the engine is as good
as new.

"As good as new" means: no request of the failed call is left queued or running (it would run
silently inside the next call), no KV memory is held, the scheduler's invariants hold, and the
next `generate` gives exactly the greedy tokens an engine that never failed gives (`expected`,
computed once per test module by a fresh engine).
"""

from collections.abc import Callable
from typing import Any


def assert_engine_recovered(
    llm: Any,
    prompts: list,
    params: Any,
    expected: list[list[int]],
    kv_in_use: Callable[[], int],
) -> None:
    """`llm` just raised. `kv_in_use` reads how much KV memory (slots or blocks) it holds."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "a request of the failed call is still queued"
    assert not engine.requests, "the engine still tracks a request of the failed call"
    engine.scheduler.check_invariants()
    assert kv_in_use() == 0, "KV memory leaked by the failed call"
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    engine.scheduler.check_invariants()
    assert kv_in_use() == 0 and not engine.requests
