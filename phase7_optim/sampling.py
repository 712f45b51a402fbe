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
"""

import math
from dataclasses import dataclass, field

import torch

TINY = torch.finfo(torch.float32).tiny  # noise floor: E == 0 would divide 0 / 0 for a dropped token

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
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want fixed lengths)
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the request, like EOS
    stop: tuple[str, ...] = ()  # strings that end the request; the text is cut before them
    skip_special_tokens: bool = True  # leave <|im_end|> and friends out of the text

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
