"""Engine cores for the server tests, built inside the spawned engine core process.

A test cannot reach into another process to slow a step down or make one fail, so the requests
carry the instruction: a prompt that starts with `SLOW_MARK` makes every step it is part of
`SLOW_STEP_S` longer (a long request cannot finish before the test aborts it); a prompt that
starts with `FAULT_MARK` makes the first step it is part of raise. Both marks are special tokens
that no text prompt of these tests encodes to. Everything else runs the real engine.
`make_slow_test_llm` slows every step by `EVERY_STEP_S` (the dashboard's test watches a run).
"""

import time

from phase8_serving.engine import LLM
from phase8_serving.engine_core import EngineCoreSpec, build_llm

SLOW_MARK = [258, 256]  # <|endoftext|><|im_start|>
FAULT_MARK = [258, 257]  # <|endoftext|><|im_end|>
SLOW_STEP_S = 0.03
EVERY_STEP_S = 0.015


def make_test_llm(spec: EngineCoreSpec) -> LLM:
    llm = build_llm(spec)
    runner = llm.engine.runner
    launch = runner.launch

    def launch_with_marks(scheduled, previous=None):
        starts = [seq.token_ids[:2] for seq, _ in scheduled]
        if FAULT_MARK in starts:
            raise RuntimeError("injected fault")
        if SLOW_MARK in starts:
            time.sleep(SLOW_STEP_S)
        return launch(scheduled, previous)

    runner.launch = launch_with_marks
    return llm


def make_slow_test_llm(spec: EngineCoreSpec) -> LLM:
    """`make_test_llm`, each step `EVERY_STEP_S` longer: a run lasts long enough for a page that
    is refreshed a few times a second to see it mid-flight."""
    llm = make_test_llm(spec)
    runner = llm.engine.runner
    launch = runner.launch

    def launch_slowly(scheduled, previous=None):
        time.sleep(EVERY_STEP_S)
        return launch(scheduled, previous)

    runner.launch = launch_slowly
    return llm
