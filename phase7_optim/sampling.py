"""Sampling: choosing the next token from the logits, not always the most likely one.

Problem: greedy decoding (argmax) is deterministic, dull and falls into loops ("the the the").
Idea: treat the logits as a distribution and draw from it, after reshaping it:
- temperature T divides the logits: T < 1 sharpens, T > 1 flattens, T = 0 means greedy;
- top_k keeps the k most likely tokens;
- top_p (nucleus) keeps the smallest set of most likely tokens whose probability reaches p;
- min_p keeps tokens whose probability is at least min_p times the most likely token's.
They apply in that order, each to what the previous one left. The most likely token always
survives every filter, so there is always something to sample.

From phase 4 the engine also reads `ignore_eos` and `stop_token_ids` from here; from phase 6
`stop` strings and `skip_special_tokens`.

Every request owns a `torch.Generator`: with `seed` set, the same request gives the same text no
matter what else runs beside it (that matters once requests share a batch, phase 3 onwards).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None  # None: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want fixed lengths)
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the request, like EOS
    stop: tuple[str, ...] = ()  # strings that end the request; the text is cut before them
    skip_special_tokens: bool = True  # leave <|im_end|> and friends out of the text

    def __post_init__(self):
        # Accept vLLM users' habits (a list, or one string) but store tuples: params are frozen.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, or None to disable it; got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

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
    return drop_sorted.scatter(-1, order, drop_sorted)


def min_p_mask(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """True where a token's probability is below min_p times the top token's."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs < min_p * probs.max(dim=-1, keepdim=True).values


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits the sampler draws from: temperature-scaled, filtered tokens set to -inf."""
    logits = logits.float() / params.temperature
    if params.top_k is not None:
        logits = logits.masked_fill(top_k_mask(logits, params.top_k), float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(top_p_mask(logits, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        logits = logits.masked_fill(min_p_mask(logits, params.min_p), float("-inf"))
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
