"""Output processor: the engine core's token ids become text, stop strings and deltas, here.

Problem: the engine core sends token ids only (engine_core.py). Clients want text, cut before any
stop string they named, streamed as deltas that are never taken back, and a slow client must not
slow anyone else or pile up a queue of tiny chunks.
Idea (vLLM v1's `OutputProcessor` and `RequestOutputCollector`):
- each request keeps a `RequestState`: an incremental detokenizer (`tokenizers`' `DecodeStream`
  where it exists, else phase 6's two-offset one), the text it has not sent yet, its timing;
- `RequestState.update` turns one step's ids into an `OutputDelta`: new text, minus the tail that
  may still begin a stop string (held back here, once); a stop string ends the request, and the
  processor asks the caller to abort it in the core;
- deltas go into one `RequestOutputCollector` per HTTP request (all its choices): if the handler
  has not taken the previous delta of a choice yet, the new one is merged into it, so a lagging
  client gets fewer, larger chunks and the processor never waits.

Invariants: a choice's deltas, concatenated, are its final text and token ids; nothing sent is
ever withdrawn; `process` never blocks and never awaits; its cost per step grows with the
step's tokens only, not with how long the requests have run or how far a client lags (this is
the loop that bounds the server: the front-end ceiling in benchmarks/phase8_serving.py); a
request whose text cannot be made (a bug, a blank exercise) fails alone, with an error, and is
aborted in the core: it never leaves its client waiting.
"""

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .core_messages import EngineCoreOutput, StepOutputs
from .logprobs import TokenLogprobs
from .metrics import EngineMetrics, RequestTiming
from .sampling_params import SamplingParams
from .streaming import OutputDelta, held_back_length
from .tokenizer import (
    DETOKENIZE_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    find_stop_string,
)

try:  # tokenizers >= 0.21: one Rust call per token
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: phase 6's detokenizer
    DecodeStream = None


logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step failed inside the engine core, or a request's text could not be made from its
    tokens here; the requests it held were aborted."""


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s interface over `tokenizers.decoders.DecodeStream`.

    A prompt may end inside a character (token-id prompts can end anywhere). The stream then
    holds the prompt's unfinished tail, and its first piece of output text would begin with that
    tail's text: a U+FFFD, or the character the output completes. That text is the prompt's, so
    it is skipped: the output is the text of prompt + output after the text of the prompt, as
    the offline engine's detokenizer counts it (`IncrementalDetokenizer`).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:])  # context, then outputs
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.read_offset = 0  # ids up to here have shown all their text
        for i, token in enumerate(self.token_ids):  # the prompt's tail renders outputs in context
            if self.stream.step(tokenizer.backend, token) is not None:
                self.read_offset = i + 1
        # the prompt's unfinished tail, as the prompt's text renders it (U+FFFD for a split
        # character): the first characters the stream will give back, and not output
        self.num_prompt_chars = len(self._decode(self.token_ids[self.read_offset :]))

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        # one id per step is the usual case, and this runs for every request every step
        backend, token_ids, step = self.tokenizer.backend, self.token_ids, self.stream.step
        text = ""
        for token in new_ids:
            token_ids.append(token)
            piece = step(backend, token)
            if piece is not None:  # None: a character is still split
                text += piece
                self.read_offset = len(token_ids)
        return self._without_prompt_text(text) if self.num_prompt_chars else text

    def flush(self) -> str:
        """At the end of a request: what a split character held back, as U+FFFD."""
        if self.read_offset == len(self.token_ids):
            return ""
        start = max(0, self.read_offset - DETOKENIZE_CONTEXT_TOKENS)
        before = self._decode(self.token_ids[start : self.read_offset])
        self.read_offset = len(self.token_ids)
        return self._without_prompt_text(self._decode(self.token_ids[start:])[len(before) :])

    def _without_prompt_text(self, text: str) -> str:
        skip = min(self.num_prompt_chars, len(text))
        self.num_prompt_chars -= skip
        return text[skip:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)


class NoText:
    """The detokenizer of a request that wants token ids alone (`detokenize=False`)."""

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


NO_TEXT = NoText()


def make_detokenizer(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool,
    detokenize: bool = True,
):  # fmt: skip
    if not detokenize:
        return NO_TEXT
    if DecodeStream is None:
        return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return StreamDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


@dataclass
class PendingOutput:
    """One choice's deltas that its handler has not taken yet, merged in place as they come
    (vLLM's `RequestOutput.add`): a lagging client costs an append per step, not a copy of all
    it has not read, and one object per choice, not one per step, for the garbage collector."""

    texts: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None

    @classmethod
    def start(cls, delta: OutputDelta) -> "PendingOutput":
        logprobs = None if delta.logprobs is None else list(delta.logprobs)
        return cls([delta.text], list(delta.token_ids), logprobs, delta.finish_reason,
                   delta.stop_reason)  # fmt: skip

    def add(self, delta: OutputDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def delta(self) -> OutputDelta:
        """Everything added, as one delta."""
        return OutputDelta("".join(self.texts), self.token_ids, self.logprobs, self.finish_reason,
                           self.stop_reason)  # fmt: skip


def pending_delta(pending: OutputDelta | PendingOutput) -> OutputDelta:
    """What a collector holds for a choice, as one delta."""
    return pending.delta() if isinstance(pending, PendingOutput) else pending


class RequestOutputCollector:
    """One HTTP request's outputs, by choice index, waiting for its handler to take them.

    A choice's first delta waits as it is: a handler that keeps up takes every delta before
    the next one comes, and then nothing is copied or merged; a second delta turns it into a
    `PendingOutput`."""

    def __init__(self):
        self.pending: dict[int, OutputDelta | PendingOutput] = {}
        self.num_cached_tokens: dict[int, int] = {}  # by choice: its prompt's prefix cache hit
        self.prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}  # by choice, if asked
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, index: int, delta: OutputDelta) -> None:
        pending = self.pending.get(index)
        if pending is None:
            self.pending[index] = delta
        elif isinstance(pending, PendingOutput):
            pending.add(delta)
        else:
            merged = self.pending[index] = PendingOutput.start(pending)
            merged.add(delta)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def get_nowait(self) -> dict[int, OutputDelta]:
        """Everything produced since the last call, one delta per choice (none: {}); raises on
        failure."""
        self.ready.clear()
        if self.error is not None:
            raise self.error
        pending, self.pending = self.pending, {}
        return {index: pending_delta(p) for index, p in pending.items()}

    async def get(self) -> dict[int, OutputDelta]:
        """`get_nowait`, once there is something to get."""
        await self.ready.wait()
        return self.get_nowait()


@dataclass
class RequestState:
    """One engine request (one choice) as the front end follows it."""

    request_id: str
    index: int  # its choice index in the HTTP request
    collector: RequestOutputCollector
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | NoText
    stops: tuple[str, ...]
    core: int  # which engine core runs it
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int = 0  # no stop string ends the request before this many tokens (vLLM's rule)
    stop_token_ids: frozenset[int] = frozenset()  # those that are a stop_reason (EOS is not)
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the text keeps it
    timing: RequestTiming = field(default_factory=RequestTiming)
    unsent_text: str = ""  # made but not sent yet: a tail that may begin a stop string
    num_output_tokens: int = 0

    @classmethod
    def start(cls, request_id: str, index: int, collector: RequestOutputCollector,
              tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
              core: int = 0) -> "RequestState":  # fmt: skip
        """The state of a request about to be sent to engine core `core`."""
        detokenizer = make_detokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                       params.detokenize)  # fmt: skip
        # vLLM's rule: EOS ending a request is no stop_reason, even if stop_token_ids names it
        eos = frozenset() if params.ignore_eos else frozenset(tokenizer.eos_token_ids)
        return cls(request_id, index, collector, detokenizer, params.stop, core, len(prompt_ids),
                   params.max_tokens, params.min_tokens, frozenset(params.stop_token_ids) - eos,
                   params.include_stop_str_in_output)  # fmt: skip

    # exercise 8.3: the front end's half of a step (token ids to text, stop strings, hold-back)
    def update(self, output: EngineCoreOutput) -> OutputDelta:
        """One step's token ids as a delta of text that no later step will take back.

        A finish reason "stop" from the core means the last id is a stop token (EOS or one of
        stop_token_ids): it counts as a token but has no text, and is the stop_reason if it is
        one of `stop_token_ids`. A stop string found here ends the request with "stop", is its
        stop_reason, and the text is cut before it (after it, with `include_stop_str`). While
        the request runs, the longest tail of the text that begins some stop string is held back
        (with `include_stop_str` too: a match is searched in the unsent text only). Within
        `min_tokens`, stop strings are not searched: one counts only if it ends in text of a
        later token.

        Only the unsent text is kept, never the whole (the handler has what was sent): a stop
        string that ends in the new text cannot begin in text already sent, or that text's
        tail would have been held back. So the search and the hold-back read the unsent text
        and the new, and a step costs the same at the 1st token as at the 10,000th.
        """
        ids, reason = output.new_token_ids, output.finish_reason
        stop_reason = ids[-1] if reason == "stop" and ids[-1] in self.stop_token_ids else None
        new_text = self.detokenizer.add_tokens(ids[:-1] if reason == "stop" else ids)
        if reason is not None and reason != "stop":
            new_text += self.detokenizer.flush()  # a character split at max_tokens shows up
        self.num_output_tokens += len(ids)
        if not self.stops:  # nothing to search or hold back (most requests, every step)
            return OutputDelta(new_text, ids, output.new_logprobs, reason, stop_reason)
        text = self.unsent_text + new_text
        searched = new_text and self.num_output_tokens > self.min_tokens
        match = find_stop_string(text, self.stops, len(new_text)) if searched else None
        if match is not None:
            text = text[: match.index + (len(match.stop) if self.include_stop_str else 0)]
            reason, stop_reason = "stop", match.stop
        end = len(text) - (held_back_length(text, self.stops) if reason is None else 0)
        self.unsent_text = text[end:]
        return OutputDelta(text[:end], ids, output.new_logprobs, reason, stop_reason)


class OutputProcessor:
    """Every request in flight, keyed by engine request id; `process` handles one core message.
    The server's observes its metrics; the offline `LLM`'s (engine.py) has none."""

    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(state.num_prompt_tokens)

    def remove(self, request_ids: Sequence[str]) -> list[RequestState]:
        """Forgets requests (their client left); returns those that were still in flight."""
        return [s for i in request_ids if (s := self.states.pop(i, None)) is not None]

    def process(self, message: StepOutputs) -> tuple[list[RequestState], list[str]]:
        """Delivers one step's outputs. Returns the requests that finished and the ids the core
        must abort (a stop string ended them here while the core would go on)."""
        return self.process_outputs(message.outputs, message.timestamp)

    def process_outputs(
        self, outputs: Sequence[EngineCoreOutput], core_time: float
    ) -> tuple[list[RequestState], list[str]]:
        """`process` for outputs made at `core_time` (the core's clock: time.monotonic)."""
        now = time.monotonic()
        finished, to_abort = [], []
        num_new_tokens = 0
        num_step_tokens = 0  # vLLM's iteration tokens: new ids, plus a whole prompt at its first
        gaps: collections.Counter[float] = collections.Counter()  # inter-token latencies
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:  # aborted after the core sent this
                continue
            if output.finish_reason == "error":
                self.states.pop(output.request_id)
                finished.append(state)
                state.collector.fail(EngineStepError(output.error))
                continue
            first = state.num_output_tokens == 0
            if first and output.num_cached_tokens is not None:
                state.collector.num_cached_tokens[state.index] = output.num_cached_tokens
            if first and output.prompt_logprobs is not None:
                state.collector.prompt_logprobs[state.index] = output.prompt_logprobs
            try:
                delta = state.update(output)
            except Exception as error:  # a bug in one request's text: fail it, never hang it
                logger.exception("making request %s's text failed", output.request_id)
                del self.states[output.request_id]
                finished.append(state)
                to_abort.append(output.request_id)  # its engine request would go on generating
                state.collector.fail(EngineStepError(f"making the text failed: {error!r}"))
                continue
            num_new_tokens += len(output.new_token_ids)
            num_step_tokens += len(output.new_token_ids) + (state.num_prompt_tokens if first else 0)
            if self.metrics is not None:
                self._observe(state, output, core_time, now, gaps)
            if delta.finish_reason is not None:
                del self.states[output.request_id]
                finished.append(state)
                state.timing.finished = core_time
                if self.metrics is not None:
                    self.metrics.observe_finished(
                        state.timing, now, delta.finish_reason, state.num_prompt_tokens,
                        state.num_output_tokens,
                    )  # fmt: skip
                if output.finish_reason is None:
                    to_abort.append(output.request_id)
            state.collector.put(state.index, delta)
        if num_step_tokens and self.metrics is not None:
            self.metrics.observe_step(num_new_tokens, num_step_tokens, gaps)
        return finished, to_abort

    def fail_core(self, core: int, error: BaseException) -> list[RequestState]:
        """Fails every request of a core that died."""
        failed = [s for s in self.states.values() if s.core == core]
        for state in failed:
            del self.states[state.request_id]
            state.collector.fail(error)
        return failed

    def _observe(self, state: RequestState, output: EngineCoreOutput, core_time: float,
                 now: float, gaps: collections.Counter[float]) -> None:  # fmt: skip
        timing, m = state.timing, self.metrics
        if output.arrival_time is not None:  # the request's first output
            timing.core_arrival, timing.scheduled = output.arrival_time, output.scheduled_time
        if not output.new_token_ids:
            return
        if timing.last_token is None:
            m.time_to_first_token.observe(now - timing.arrival)
            timing.first_token = core_time
        else:
            gaps[now - timing.last_token] += 1  # observed once per step (observe_step)
        timing.last_token = now
