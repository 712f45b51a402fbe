"""Sampling: choosing the next token from the logits, not always the most likely one.

Problem: greedy decoding (argmax) is deterministic, dull and falls into loops ("the the the").
Idea: treat the logits as a distribution and draw from it, after reshaping it:
- temperature T divides the logits: T < 1 sharpens, T > 1 flattens, T = 0 means greedy;
- min_p keeps tokens whose probability is at least min_p times the most likely token's;
- top_k keeps the k most likely tokens;
- top_p (nucleus) keeps the smallest set of most likely tokens whose probability reaches p.
They apply in vLLM's order (temperature, min-p, top-k, top-p), each to what the previous one left,
so top-p's nucleus is measured on the temperature-scaled, min-p-filtered distribution. The most
likely token always survives every filter, so there is always something to sample.

Every request owns a `torch.Generator`: with `seed` set, the same request gives the same text no
matter what else runs beside it (that matters once requests share a batch, phase 3 onwards).

Invariant: a `SamplingParams` that exists is valid. Every field is checked with its type when it is
built (a bool is not a token count, 2.5 is not one either, NaN is not a temperature, a seed fits in
64 bits), with an error naming the field: a bad request fails where it is made, never inside a
later batch it shares with good ones.
"""

import math
from dataclasses import dataclass

import torch

# The smallest positive temperature: 1/T multiplies the logits, and float32 overflows to inf (then
# softmax gives NaN) once T nears 1e-38. 1e-5 keeps that far away for any logit below 1e33, and is
# the threshold below which vLLM (_SAMPLING_EPS) treats a temperature as greedy. Use 0 for greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)


def _check_int(name: str, value: object, minimum: int) -> None:
    """Raises unless `value` is an int (not a bool: True is not a token count) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"SamplingParams.{name} must be >= {minimum}, got {value}")


def _check_real(name: str, value: object) -> None:
    """Raises unless `value` is a finite int or float (not a bool, not NaN, not inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None  # None: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None

    def __post_init__(self):
        _check_real("temperature", self.temperature)
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=1)  # None disables it
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= SEED_LIMIT:
                raise ValueError(f"SamplingParams.seed must be < 2**64, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """True where a token falls outside the k largest logits. logits: (..., V)."""
    kth_largest = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits < kth_largest


# exercise 2.1: the top-p (nucleus) filter
def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """True where a token falls outside the nucleus: the smallest top set with mass >= p."""
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    drop_sorted = mass_before >= p  # the nucleus was already complete without this token
    drop_sorted[..., 0] = False  # the top token stays even if p rounds to 0 in float32
    return drop_sorted.scatter(-1, order, drop_sorted)


def min_p_mask(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """True where a token's probability is below min_p times the top token's."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs < min_p * probs.max(dim=-1, keepdim=True).values


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits the sampler draws from: temperature-scaled, then min-p, top-k, top-p filtered
    (vLLM's order); filtered tokens are set to -inf."""
    logits = logits.float() / params.temperature
    if params.min_p > 0.0:
        logits = logits.masked_fill(min_p_mask(logits, params.min_p), float("-inf"))
    if params.top_k is not None:
        logits = logits.masked_fill(top_k_mask(logits, params.top_k), float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(top_p_mask(logits, params.top_p), float("-inf"))
    return logits


class Sampler:
    """Draws tokens for one request with its own random stream."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()  # a fresh nondeterministic seed, not torch's fixed default
        else:
            self.generator.manual_seed(params.seed)

    # exercise 2.2: drawing a token with the request's own generator
    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (V,) -> the chosen token id."""
        if self.params.greedy:
            return int(logits.argmax())
        probs = torch.softmax(filtered_logits(logits, self.params), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
