"""Streaming deltas: nothing shown is ever taken back, and everything is shown in the end.

The oracle is a simulation of the engine's text (grows by a few characters per step; at a stop
string it is cut before it and the request finishes), driven by hypothesis over a two-letter
alphabet so that stop strings, overlaps and partial matches are frequent.
"""

from hypothesis import given
from hypothesis import strategies as st

from phase8_serving.engine import CompletionOutput
from phase8_serving.sampling import TokenLogprobs
from phase8_serving.streaming import DeltaTracker, held_back_length
from phase8_serving.tokenizer import find_stop_string

texts = st.text(alphabet="ab", min_size=1, max_size=30)
stop_lists = st.lists(st.text(alphabet="ab", min_size=1, max_size=4), max_size=3)


def engine_outputs(text: str, stops: list[str], steps: list[int]):
    """(CompletionOutput, finished) after each step, as the engine reports them."""
    shown, position = "", 0
    for i, size in enumerate(steps):
        new = text[position : position + size]
        position += size
        shown += new
        match = find_stop_string(shown, stops, len(new))
        last = match is not None or position >= len(text) or i == len(steps) - 1
        if match is not None:
            shown = shown[: match.index]
        ids = list(range(position))
        yield (
            CompletionOutput(0, shown, ids, ("stop" if match else "length") if last else None),
            last,
        )
        if last:
            return


@given(texts, stop_lists, st.lists(st.integers(1, 3), min_size=1, max_size=40))
def test_deltas_never_show_what_a_stop_string_removes(text, stops, steps):
    tracker = DeltaTracker(stops)
    sent, sent_ids, snapshots = "", [], []
    for output, finished in engine_outputs(text, stops, steps):
        delta = tracker.update(output, finished)
        sent += delta.text
        sent_ids += delta.token_ids
        snapshots.append(sent)
        final = output
    assert all(final.text.startswith(s) for s in snapshots)  # nothing shown was taken back
    assert sent == final.text
    assert sent_ids == final.token_ids
    assert delta.finish_reason == final.finish_reason


def test_held_back_length():
    assert held_back_length("hello Obs", ["Observation:"]) == 3
    assert held_back_length("hello", ["Observation:"]) == 0
    assert held_back_length("aab", ["abc", "aabx"]) == 3
    assert held_back_length("x", []) == 0


def test_a_stop_string_split_over_steps_is_never_shown():
    tracker = DeltaTracker(["STOP"])
    steps = [("Hello S", False), ("Hello ST", False), ("Hello STO", False), ("Hello ", True)]
    shown = ""
    for i, (text, finished) in enumerate(steps):
        out = CompletionOutput(0, text, list(range(i + 1)), "stop" if finished else None)
        shown += tracker.update(out, finished).text
        assert "S" not in shown
    assert shown == "Hello "


def test_each_delta_carries_the_logprobs_of_its_own_tokens():
    tracker = DeltaTracker([])
    logprobs = [TokenLogprobs(t, -float(t), ()) for t in range(5)]
    shown = []
    for n, finished in ((2, False), (2, False), (5, True)):
        reason = "length" if finished else None
        out = CompletionOutput(0, "x" * n, list(range(n)), reason, logprobs=logprobs[:n])
        delta = tracker.update(out, finished)
        assert [lp.token_id for lp in delta.logprobs] == delta.token_ids
        shown += delta.logprobs
    assert shown == logprobs
