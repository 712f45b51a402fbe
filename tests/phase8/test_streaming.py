"""The hold-back rule (`held_back_length`): what a stream shows is never taken back, and
everything is shown in the end.

The oracle is a simulation of a request's text (grows by a few characters per step; at a stop
string it is cut before it and the request finishes), driven by hypothesis over a two-letter
alphabet so that stop strings, overlaps and partial matches are frequent; and, for the rule
itself, the definition checked by brute force. The output processor applies the rule to real
token ids (test_output_processor.py).
"""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from phase8_serving.streaming import held_back_length
from phase8_serving.tokenizer import find_stop_string

texts = st.text(alphabet="ab", min_size=1, max_size=30)
stop_lists = st.lists(st.text(alphabet="ab", min_size=1, max_size=4), max_size=3)


def texts_so_far(text: str, stops: list[str], steps: list[int]):
    """(the text so far, finished) after each step, cut before a stop string as it is found."""
    so_far, position = "", 0
    for i, size in enumerate(steps):
        new = text[position : position + size]
        position += size
        so_far += new
        match = find_stop_string(so_far, stops, len(new))
        if match is not None:
            so_far = so_far[: match.index]
        last = match is not None or position >= len(text) or i == len(steps) - 1
        yield so_far, last
        if last:
            return


@given(texts, stop_lists, st.lists(st.integers(1, 3), min_size=1, max_size=40))
def test_deltas_never_show_what_a_stop_string_removes(text, stops, steps):
    """While the request runs, the text less its held-back tail is shown; it always begins
    the final text."""
    shown = []
    for so_far, finished in texts_so_far(text, stops, steps):
        shown.append(
            so_far if finished else so_far[: len(so_far) - held_back_length(so_far, stops)]
        )
    assert all(so_far.startswith(s) for s in shown)  # nothing shown was taken back
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))  # it only grows


@given(texts, stop_lists)
def test_held_back_length_is_the_longest_tail_a_stop_string_starts_with(text, stops):
    longest = max(
        (n for stop in stops for n in range(1, min(len(stop), len(text) + 1))
         if text.endswith(stop[:n])),
        default=0,
    )  # fmt: skip
    assert held_back_length(text, stops) == longest


def test_held_back_length():
    assert held_back_length("hello Obs", ["Observation:"]) == 3
    assert held_back_length("hello", ["Observation:"]) == 0
    assert held_back_length("aab", ["abc", "aabx"]) == 3
    assert held_back_length("x", []) == 0
    assert held_back_length("STOP", ["STOP"]) == 0  # a whole stop string is found, not held


def test_a_stop_string_split_over_steps_is_never_shown():
    shown = ""
    for text in ("Hello S", "Hello ST", "Hello STO"):
        shown = text[: len(text) - held_back_length(text, ["STOP"])]
        assert "S" not in shown
    assert shown == "Hello "
