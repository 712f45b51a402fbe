"""Beam search: the k most likely continuations of a prompt, not k samples (vLLM's
`LLM.beam_search` and the server's `use_beam_search`).

Problem: greedy decoding takes the likeliest token at each step, and the likeliest *sequence* may
begin with a token that was not. Searching every sequence is out of reach (V^n of them).
Idea: keep the k best partial sequences (beams). Each step asks the engine for every beam's 2k
most likely next tokens (its logprobs; one one-token request per beam, whose earlier tokens the
prefix cache already holds), scores the k x 2k extensions by their summed log-probabilities, and
keeps the best k; an extension that ends in EOS is set aside, complete. At the end the best k of
the complete and the running ones, by cumulative logprob / length ** length_penalty
(transformers' rule, as vLLM applies it: the length counts the prompt, not a final EOS).
Why 2k a beam (vLLM's choice): of the k x 2k candidates, those that end in EOS leave, and at
least k others remain unless EOS tokens crowd more than half of every beam's list.

Analogy: a hiking party at every fork sends scouts a little way down each path and keeps
following only the k most promising trails.

As vLLM does, the search drives the engine from outside, a batch of requests per step; the
engine itself knows nothing of beams. The scores are the model's log-probabilities (T = 1):
temperature, like the other sampling settings, has no part in them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from .sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for its 2k most likely next tokens
# |length_penalty| at most this: length ** penalty stays a float at any context (40,960 ** 10 is
# 1e46; transformers' usual values are 0.6 to 2)
MAX_ABS_LENGTH_PENALTY = 10


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names: `beam_width` beams, each `max_tokens` long at most."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False  # EOS is then a token like any other: every beam runs max_tokens
    length_penalty: float = 1.0  # > 1 favours longer sequences, < 1 shorter (score's exponent)

    def __post_init__(self):
        for name, low, high in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"BeamSearchParams.{name} must be an int, got {value!r}")
            if value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"BeamSearchParams.{name} must be {bound}, got {value}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"BeamSearchParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, int | float):
            raise TypeError(f"BeamSearchParams.length_penalty must be a number, got {penalty!r}")
        if not abs(penalty) <= MAX_ABS_LENGTH_PENALTY:  # NaN too
            raise ValueError(
                f"BeamSearchParams.length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY}, "
                f"{MAX_ABS_LENGTH_PENALTY}], got {penalty}"
            )

    def step_params(self) -> SamplingParams:
        """One step of one beam: a token, and the 2k likeliest with their logprobs (which
        token is sampled does not matter; greedy draws nothing)."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width,
                              ignore_eos=True)  # fmt: skip


@dataclass
class BeamSearchSequence:
    """A beam: the prompt's tokens and its own, and their summed log-probability."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # each generated token's
    finish_reason: str | None = None  # "stop" (EOS) or "length", once the search is done
    text: str | None = None  # the generated tokens decoded, once the search is done

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` sequences, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: `beams` to extend, `advance` with their candidates, then `result`."""

    def __init__(self, prompt: Sequence[int], params: BeamSearchParams, eos: Collection[int]):
        self.params = params
        self.eos = frozenset(eos)
        self.beams = [BeamSearchSequence(list(prompt), len(prompt))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps == self.params.max_tokens

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.finish_reason == "stop")  # a final EOS does not count
        return self.length_score(beam.cum_logprob, length)

    def length_score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / length**self.params.length_penalty

    # exercise 8.4: one step of beam search
    def advance(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        """`candidates`: per beam, in `beams` order, its likeliest next tokens and logprobs."""
        extended = []  # (score, beam, token, logprob): the k x 2k, copied only if kept
        for beam, options in zip(self.beams, candidates, strict=True):
            for token, logprob in options:
                if token in self.eos and not self.params.ignore_eos:
                    self.completed.append(extend(beam, token, logprob, "stop"))
                else:
                    score = self.length_score(beam.cum_logprob + logprob, len(beam.tokens) + 1)
                    extended.append((score, beam, token, logprob))
        extended.sort(key=lambda c: c[0], reverse=True)
        kept = extended[: self.params.beam_width]
        self.beams = [extend(beam, token, logprob) for _, beam, token, logprob in kept]
        self.num_steps += 1

    def result(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)
        best = best[: self.params.beam_width]
        for beam in best:
            beam.text = decode(beam.output_token_ids)
        return BeamSearchOutput(best)


def extend(
    beam: BeamSearchSequence, token: int, logprob: float, finish_reason: str | None = None
) -> BeamSearchSequence:
    """`beam` with one more token: a new sequence (beams share their prefixes' lists otherwise)."""
    return BeamSearchSequence(
        beam.tokens + [token], beam.num_prompt_tokens, beam.cum_logprob + logprob,
        beam.logprobs + [logprob], finish_reason,
    )  # fmt: skip
