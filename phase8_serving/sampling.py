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

From phase 4 the engine also reads `ignore_eos` and `stop_token_ids` from here; from phase 6
`stop` strings and `skip_special_tokens`. Phase 6 also samples a whole batch in one pass
(`sample_batch`): the same filters with per-row parameter tensors, and one device-to-host copy of
the chosen ids per step instead of one per row.

Invariant: a `SamplingParams` that exists is valid. Every field is checked with its type when it is
built (a bool is not a token count, 2.5 is not one either, NaN is not a temperature, a seed fits in
64 bits), with an error naming the field: a bad request fails where it is made, never inside a
later batch it shares with good ones.

Phase 7: `sample_batch` stays on the device. Phase 6's batched pass still copies per-row
parameters each step, sorts every row for top-k and draws with `torch.multinomial` row by row;
here one step's parameters are per-row tensors (`SamplingBatch`), rows that need no filter skip
the sort, and the draw is the exponential race (Gumbel-max): argmax(probs / E) with
E ~ Exponential(1) picks token i with probability probs[i], with no cumulative-sum search. With no
filter at all it is one Triton pass over the logits (`kernels/sampling.py`) that draws the noise
itself (Philox), so the (R, V) fp32 noise tensor, twice the bf16 logits' bytes, is never written
to memory and read back; the torch path (filters, CPU) still materializes it. Greedy rows take the
exact argmax of the logits; a seeded request draws its noise row from its own generator on either
path, so its tokens do not depend on what shares its batch. The result is a device tensor: the
engine copies tokens to the host once per step.

Phase 8 (what a server's clients ask for, as the OpenAI API names it):
- penalties, applied to the logits before `sample_batch`, as batched tensor ops over the rows of
  a step, and only in steps where some row has one (`apply_penalties`; vLLM's definitions):
  repetition_penalty r divides a positive logit by r and multiplies a negative one by r, for every
  token seen in the prompt or the output; frequency_penalty subtracts f times the token's count in
  the output; presence_penalty subtracts p once for every token that occurs in the output;
- `logit_bias` (token id -> a bias in [-100, 100] added to its logit) and `min_tokens` (EOS and
  the stop tokens are impossible until that many tokens exist: their logits are -inf), applied
  before the penalties, as vLLM applies its logits processors, by one batched scatter-add in
  steps where some row has either (`apply_logit_bias`);
- `logprobs`: the log-probability of each sampled token under the model's raw distribution
  (before bias, penalties, temperature and filters), plus the `logprobs` most likely
  alternatives, computed only for the rows that ask, on the device right after sampling
  (`token_logprobs`), and read when the sampled token is (`LogprobsTensors.tolists`).
`top_k` -1 or 0 means no top-k filter, as in vLLM (stored as None).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

TINY = torch.finfo(torch.float32).tiny  # noise floor: E == 0 would divide 0 / 0 for a dropped token

# The smallest positive temperature: 1/T multiplies the logits, and float32 overflows to inf (then
# softmax gives NaN) once T nears 1e-38. 1e-5 keeps that far away for any logit below 1e33, and is
# the threshold below which vLLM (_SAMPLING_EPS) treats a temperature as greedy. Use 0 for greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)
MAX_LOGPROBS = 20  # the most alternatives a request may ask for (the OpenAI API's limit)
MAX_ABS_PENALTY = 2.0  # presence/frequency penalties live in [-2, 2] (the OpenAI API's range)
# Beyond these, a penalized logit overflows float32 and softmax gives NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_ABS_LOGIT_BIAS = 100.0  # the OpenAI API's range for logit_bias values
TOP_K_OFF = (-1, 0)  # vLLM's spellings of "no top-k filter"; stored as None


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
    top_k: int | None = None  # None (or -1, 0, as in vLLM): no top-k filter
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
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the request before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]

    def __post_init__(self):
        # Accept vLLM users' habits (a list) but store tuples: params are frozen.
        if not isinstance(self.stop_token_ids, list | tuple):
            raise TypeError(
                f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # one string is one stop, as in vLLM
        if not isinstance(self.stop, list | tuple):
            raise TypeError(
                f"SamplingParams.stop must be a str or a list of str, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(self.stop))
        _check_real("temperature", self.temperature)
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if type(self.top_k) is int and self.top_k in TOP_K_OFF:
            object.__setattr__(self, "top_k", None)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=1)  # None (or -1, 0) disables it
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
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, minimum=0)
        for stop in self.stop:
            if not isinstance(stop, str):
                raise TypeError(f"SamplingParams.stop must hold strings, got {stop!r}")
            if not stop:
                raise ValueError("SamplingParams.stop must not hold an empty string")
        if not isinstance(self.skip_special_tokens, bool):
            raise TypeError(
                "SamplingParams.skip_special_tokens must be a bool, "
                f"got {self.skip_special_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"SamplingParams.{name} must be in [{-MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], "
                    f"got {getattr(self, name)}"
                )
        _check_real("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(
                    f"SamplingParams.logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}"
                )
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )
        if self.logit_bias is not None:
            self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"SamplingParams.logit_bias must be a dict, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # the caller's stays theirs
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token, minimum=0)
            _check_real("logit_bias", bias)
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"SamplingParams.logit_bias values must be in [{-MAX_ABS_LOGIT_BIAS}, "
                    f"{MAX_ABS_LOGIT_BIAS}], got {bias} for token {token}"
                )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError unless every token id these params name is in [0, vocab_size): an
        id past the LM head would index out of range inside a batch shared with others."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ())):  # fmt: skip
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(
                    f"SamplingParams.{name} holds token ids outside the vocabulary "
                    f"[0, {vocab_size}): {outside[:5]}"
                )

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


@dataclass
class SamplingBatch:
    """One step's sampling parameters as per-row tensors (R rows, on the logits' device)."""

    temperature: torch.Tensor  # (R,) float32; 1.0 on greedy rows (never divides by 0)
    min_p: torch.Tensor  # (R,) float32; 0.0 = off
    top_k: torch.Tensor  # (R,) int64; vocab_size = off
    top_p: torch.Tensor  # (R,) float32; 1.0 = off
    greedy: torch.Tensor  # (R,) bool
    # host-side summaries, so whole passes no row needs are skipped without a device sync
    all_greedy: bool
    any_min_p: bool
    any_top_k_top_p: bool
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)  # (row, generator)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],  # per row: the request's own, or None
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        top_k = [vocab_size if p.top_k is None else min(p.top_k, vocab_size) for p in params]
        to = lambda xs, dtype: torch.tensor(xs, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
        return cls(
            temperature=to([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            min_p=to([p.min_p for p in params], torch.float32),
            top_k=to(top_k, torch.int64),
            top_p=to([p.top_p for p in params], torch.float32),
            greedy=to(greedy, torch.bool),
            all_greedy=all(greedy),
            any_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
            any_top_k_top_p=any(
                not p.greedy and (p.top_k is not None or p.top_p < 1.0) for p in params
            ),
            seeded=[(i, g) for i, g in enumerate(generators) if g is not None],
        )


def top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zeroes what per-row top-k, then top-p on the top-k survivors, drop. probs: (R, V), rows
    need not sum to 1 (min-p may have zeroed some)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(rank[None, :] >= top_k[:, None], 0.0)
    kept_mass = sorted_probs.sum(dim=-1, keepdim=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # strictly more likely tokens
    outside = mass_before >= top_p[:, None] * kept_mass
    outside[:, 0] = False  # the top token stays even if top_p * kept_mass rounds to 0
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (R, V) -> token ids (R,) int64, on the device: no host sync."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda and not (batch.any_min_p or batch.any_top_k_top_p):
        return sample_by_race(logits, batch)  # no filter needs the probabilities
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
    for row, generator in batch.seeded:  # only seeded rows loop: one launch each
        noise[row].exponential_(generator=generator)
    noise.clamp_min_(TINY)
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    probs = torch.softmax(logits / batch.temperature[:, None], dim=-1)
    if batch.any_min_p:
        threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if batch.any_top_k_top_p:
        probs = top_k_top_p(probs, batch.top_k, batch.top_p)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_tokens, sampled)


def sample_by_race(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (R, V) -> token ids (R,) int64: the exponential race in one Triton pass
    (kernels/sampling.py), which draws the noise of unseeded rows itself. A seeded row's noise is
    drawn here, from its request's generator, exactly as the torch path draws it (V values in one
    call): the generator advances as it always has, and the row's token is what that noise
    dictates, whatever shares the batch."""
    # imported here: CPU-only installs may lack Triton
    from .kernels.sampling import NO_NOISE_ROW, PHILOX_SEED_LIMIT, exponential_race

    rows, vocab_size = logits.shape
    noise = torch.empty(len(batch.seeded), vocab_size, dtype=torch.float32, device=logits.device)
    noise_rows = [NO_NOISE_ROW] * rows
    for i, (row, generator) in enumerate(batch.seeded):
        noise[i].exponential_(generator=generator)
        noise_rows[row] = i
    noise_rows = torch.tensor(noise_rows, dtype=torch.int32).to(logits.device, non_blocking=True)
    # from torch's CPU generator: no device sync, and torch.manual_seed replays unseeded runs
    seed = int(torch.randint(PHILOX_SEED_LIMIT, ()))
    return exponential_race(logits, 1.0 / batch.temperature, batch.greedy, seed, noise_rows, noise)


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float]]) -> torch.Tensor:
    """logits (R, V) -> logits (R, V) float32, a new tensor, with biases[r][t] added at (r, t).

    One scatter-add for the whole batch (every row's entries go to the device in one flat list).
    A bias of -inf makes a token impossible (min_tokens); an empty dict leaves its row alone.
    """
    device = logits.device
    rows = [r for r, bias in enumerate(biases) for _ in bias]
    ids = [t for bias in biases for t in bias]
    values = [v for bias in biases for v in bias.values()]
    to = lambda xs, dtype: torch.tensor(xs, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
    biased = logits.to(torch.float32, copy=True)  # the caller's logits stay raw (logprobs)
    biased.index_put_((to(rows, torch.long), to(ids, torch.long)), to(values, torch.float32),
                      accumulate=True)  # fmt: skip
    return biased


# exercise 8.2: presence, frequency and repetition penalties, batched
def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    placeholders: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """logits (R, V), one row per request -> penalized logits (R, V), float32, a new tensor.

    Batched: every row's token ids go to the device in one flat list, and the penalties are a
    few whole-batch tensor ops. A row without penalties (r = 1, f = p = 0) comes out unchanged.
    `placeholders` (rows (F,), token ids (F,), on the device): one more output token for each of
    those rows, sampled by the step before and not yet read by the host (overlap scheduling),
    counted where it is.
    """
    R, V = logits.shape
    device = logits.device
    to = lambda xs: torch.tensor(xs, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
    flat = lambda lists: (  # noqa: E731
        to([row for row, ids in enumerate(lists) for _ in ids]),
        to([t for ids in lists for t in ids]),
    )  # (row index, token id) per token
    out_rows, out_ids = flat(output_token_ids)
    if placeholders is not None:
        rows, ids = placeholders
        out_rows, out_ids = torch.cat([out_rows, rows]), torch.cat([out_ids, ids])
    output_counts = torch.zeros(R, V, device=device)  # (R, V): occurrences in the output
    output_counts.index_put_(
        (out_rows, out_ids), torch.ones(len(out_ids), device=device), accumulate=True
    )
    seen = output_counts > 0  # (R, V): in the prompt or the output
    # the value as a device tensor: a Python True would be copied from the host, a sync
    seen.index_put_(flat(prompt_token_ids), torch.ones((), dtype=torch.bool, device=device))
    column = lambda name: torch.tensor(  # noqa: E731
        [getattr(p, name) for p in params], dtype=torch.float32
    ).to(device, non_blocking=True)[:, None]  # (R, 1)
    logits = logits.float()
    repetition = column("repetition_penalty")
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)  # a new tensor: the caller's stays raw
    logits -= column("frequency_penalty") * output_counts
    logits -= column("presence_penalty") * (output_counts > 0)
    return logits


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled position: the chosen token's log-probability and the most likely tokens'."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclass
class LogprobsTensors:
    """The logprobs of a step's sampling rows that asked for them (vLLM's name), computed on the
    device right after sampling; `tolists` reads them once the step is done."""

    rows: list[int]  # the sampling rows that asked
    ks: list[int]  # how many alternatives each asked for
    values: torch.Tensor  # (W, 1 + K): the sampled token's logprob, then the K most likely's
    top_ids: torch.Tensor  # (W, K) int64: the K most likely tokens, most likely first

    def to_host(self) -> "LogprobsTensors":
        """Copies into pinned host memory, queued without blocking: complete once an event
        recorded after this call has fired."""
        values = torch.empty(self.values.shape, pin_memory=True)
        top_ids = torch.empty(self.top_ids.shape, dtype=torch.long, pin_memory=True)
        values.copy_(self.values, non_blocking=True)
        top_ids.copy_(self.top_ids, non_blocking=True)
        return LogprobsTensors(self.rows, self.ks, values, top_ids)

    def tolists(self, token_ids: list[int]) -> list[TokenLogprobs | None]:
        """Per sampling row (`token_ids`: what each sampled), its logprobs or None. Two reads
        for the whole batch (values, then ids), none per row."""
        result: list[TokenLogprobs | None] = [None] * len(token_ids)
        values, ids = self.values.tolist(), self.top_ids.tolist()
        for row, k, row_values, row_ids in zip(self.rows, self.ks, values, ids, strict=True):
            top_k = tuple(zip(row_ids[:k], row_values[1 : k + 1], strict=True))
            result[row] = TokenLogprobs(token_ids[row], row_values[0], top_k)
        return result


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int], ks: list[int]
) -> LogprobsTensors:
    """logits (R, V) raw, token_ids (R,) sampled, both on the device -> the logprobs of `rows`
    (row rows[i] asks for ks[i] alternatives). Queued on the device: no sync, nothing read."""
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # (W, V)
    chosen = token_ids.index_select(0, index)[:, None]  # (W, 1)
    top = logprobs.topk(min(max(ks), logits.shape[-1]), dim=-1)  # (W, K); K = 0: empty
    values = torch.cat([logprobs.gather(1, chosen), top.values], dim=1)
    return LogprobsTensors(rows, ks, values, top.indices)
