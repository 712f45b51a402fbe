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

Phase 8 (what a server's clients ask for, as the OpenAI API names it):
- penalties, applied to the logits before temperature, batched over the rows of a step
  (`apply_penalties`; vLLM's definitions): repetition_penalty r divides a positive logit by r and
  multiplies a negative one by r, for every token seen in the prompt or the output;
  frequency_penalty subtracts f times the token's count in the output; presence_penalty
  subtracts p once for every token that occurs in the output;
- `logprobs`: the log-probability of each sampled token under the model's raw distribution
  (before penalties, temperature and filters), plus the `logprobs` most likely alternatives.

Every request owns a `torch.Generator`: with `seed` set, the same request gives the same text no
matter what else runs beside it (that matters once requests share a batch, phase 3 onwards).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (the OpenAI API's limit)
MAX_ABS_PENALTY = 2.0  # presence/frequency penalties live in [-2, 2] (the OpenAI API's range)
# Beyond these, penalized or temperature-scaled logits overflow float32 and softmax gives NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MIN_TEMPERATURE = 0.01  # a smaller positive temperature samples as this one (vLLM's clamp)


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k's

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> torch.Tensor:
    """logits (R, V), one row per request -> penalized logits (R, V), float32, one batched pass."""
    R, V = logits.shape
    device = logits.device
    logits = logits.float()
    output_counts = torch.zeros(R, V, device=device)  # (R, V): occurrences in the output
    seen = torch.zeros(R, V, dtype=torch.bool, device=device)  # in the prompt or the output
    for row, (prompt, output) in enumerate(zip(prompt_token_ids, output_token_ids, strict=True)):
        out_ids = torch.tensor(output, dtype=torch.long, device=device)
        output_counts[row].index_add_(0, out_ids, torch.ones(len(output), device=device))
        seen[row, torch.tensor(prompt, dtype=torch.long, device=device)] = True
    seen |= output_counts > 0
    column = lambda name: torch.tensor(  # noqa: E731
        [getattr(p, name) for p in params], dtype=torch.float32, device=device
    )[:, None]  # (R, 1)
    repetition = column("repetition_penalty")
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits -= column("frequency_penalty") * output_counts
    logits -= column("presence_penalty") * (output_counts > 0)
    return logits


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled position: the chosen token's log-probability and the most likely tokens'."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], ks: list[int]
) -> list[TokenLogprobs]:
    """logits (R, V) raw; per row, its sampled token's logprob and its top ks[row] alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0]
    top = logprobs.topk(max(ks), dim=-1) if max(ks) > 0 else None
    result = []
    for row, (token_id, k) in enumerate(zip(token_ids, ks, strict=True)):
        alternatives = ()
        if k > 0:
            ids, values = top.indices[row, :k].tolist(), top.values[row, :k].tolist()
            alternatives = tuple(zip(ids, values, strict=True))
        result.append(TokenLogprobs(token_id, float(chosen[row]), alternatives))
    return result


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """True where a token falls outside the k largest logits. logits: (..., V)."""
    kth_largest = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits < kth_largest


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """True where a token falls outside the nucleus: the smallest top set with mass >= p."""
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    drop_sorted = mass_before >= p  # the nucleus was already complete without this token
    drop_sorted[..., 0] = False  # the most likely token stays, even when p rounds to 0 in fp32
    return drop_sorted.scatter(-1, order, drop_sorted)


def min_p_mask(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """True where a token's probability is below min_p times the top token's."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs < min_p * probs.max(dim=-1, keepdim=True).values


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits the sampler draws from: temperature-scaled, filtered tokens set to -inf."""
    logits = logits.float() / max(params.temperature, MIN_TEMPERATURE)
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

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (V,) -> the chosen token id."""
        if self.params.greedy:
            return int(logits.argmax())
        probs = torch.softmax(filtered_logits(logits, self.params), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
