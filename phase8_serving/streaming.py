"""Streaming: text a client may see right away, and the one rule that holds the rest back.

Problem: a request's text grows every step, and a client streaming it must never see text that
is later taken back: when a stop string is found, the text is cut before it, so characters that
might be the start of a stop string ("Obs" while the stop string is "Observation:") cannot be
shown yet (unless the request keeps its stop string, vLLM's `include_stop_str_in_output`). A
character split across tokens is already held back by the incremental detokenizer.
Idea: `held_back_length`, the longest tail of the text so far that some stop string begins with.
While the request runs, that tail waits; once the tail stops matching, or the request finishes,
it goes out. It is the one hold-back rule of this phase: the output processor applies it
(output_processor.py, `RequestState.update`) to every request, streamed by the server or
generated offline by `LLM` (engine.py), which reads each step's deltas from it.

Invariant: the concatenated text deltas equal the final text, and every delta is a piece of it
(nothing shown is ever withdrawn); token deltas, likewise, concatenate to the final token ids.
"""

from collections.abc import Sequence
from typing import NamedTuple

from .logprobs import TokenLogprobs


class OutputDelta(NamedTuple):
    """Immutable like a frozen dataclass, and built 4x faster: a server makes one per request
    per engine step."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per new token id, if the request asked
    finish_reason: str | None  # set on the last delta only
    # vLLM's: the stop string, or the stop_token_ids entry, that ended the request (not EOS)
    stop_reason: int | str | None = None


# exercise 8.1: the tail a stream holds back
def held_back_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that a stop string starts with (a proper prefix)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
