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

With `seed` set, the same request gives the same text no matter what else runs beside it (that
matters once requests share a batch, phase 3 onwards).

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
exact argmax of the logits.

A seeded request no longer owns a `torch.Generator`: a generator is a stream with a state, so a
batch with S seeded rows made S draws of V values, one launch each (1.2-1.7 ms of host time a
step at 64 rows on an H100). Its noise is Philox keyed by the seed, counted by the index of the
token being drawn (`philox4x32`): a pure function of (seed, index, token), which the race computes
in its pass for every row at once, and the torch path computes here, the same numbers. The
request's tokens still depend on nothing but its seed, not on what shares its batch, nor on
whether it was preempted and recomputed.
"""

import math
from dataclasses import dataclass, field

import numpy as np
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


# Philox-4x32-10's constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011),
# as kernels/sampling.py's
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # the key's increments between rounds
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF
# an unseeded row's counter is this + its row: never a seeded row's, the index of a token it draws
UNSEEDED_COUNTER = 1 << 32
STEP_KEYS = (-(2**63), 2**63 - 1)  # a step's key for its unseeded rows: any int64


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, ...]) -> tuple:
    """Philox-4x32-10 on numpy uint64 arrays holding uint32 words (broadcast together): the host
    twin of kernels/sampling.py's `_philox4x32`, the same four words out (a product of two
    32-bit words fits 64 bits: its high word is the kernel's umulhi, its low word the product)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        p0, p2 = c0 * PHILOX_M0, c2 * PHILOX_M1
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def philox_exponential(keys: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys, counters (S,) int64 (64-bit patterns) -> E ~ Exponential(1), (S, V) fp32 on their
    device: token t of row s is word t % 4 of Philox(counter (t // 4, the counter's low and high
    halves, 0), key), u = (2k + 1) / 2**24 from its top 23 bits, E = -log(u). What the race draws,
    computed on the host."""
    halves = lambda x: (x & MASK32, x >> 32)  # noqa: E731
    as_words = lambda x: halves(x.cpu().numpy().astype(np.uint64)[:, None])  # noqa: E731
    (c1, c2), key = as_words(counters), as_words(keys)
    quads = np.arange((vocab_size + 3) // 4, dtype=np.uint64)[None, :]
    zero = np.zeros_like(quads)
    words = philox4x32((quads, zero + c1, zero + c2, zero), key)
    words = np.stack(words, axis=-1).reshape(len(keys), -1)[:, :vocab_size]
    u = ((words >> 9) * 2 + 1).astype(np.float32) * np.float32(2.0**-24)  # never 0, never 1
    return torch.from_numpy(-np.log(u)).to(keys.device)


@dataclass
class SamplingBatch:
    """One step's sampling parameters as per-row tensors (R rows, on the logits' device)."""

    temperature: torch.Tensor  # (R,) float32; 1.0 on greedy rows (never divides by 0)
    min_p: torch.Tensor  # (R,) float32; 0.0 = off
    top_k: torch.Tensor  # (R,) int64; vocab_size = off
    top_p: torch.Tensor  # (R,) float32; 1.0 = off
    greedy: torch.Tensor  # (R,) bool
    # each row's Philox key and counter (int64 bit patterns): a seeded row's seed and the index of
    # the token it draws; the others the step's random key and UNSEEDED_COUNTER + row
    noise_keys: torch.Tensor  # (R,) int64
    noise_counters: torch.Tensor  # (R,) int64
    # host-side summaries, so whole passes no row needs are skipped without a device sync
    all_greedy: bool
    any_min_p: bool
    any_top_k_top_p: bool
    seeded: list[int] = field(default_factory=list)  # rows keyed by their request's seed
    seeded_rows: torch.Tensor | None = None  # (S,) int64 on the device: `seeded`, if any

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        draws: list[int],  # per row: the index of the token it draws now (its output so far)
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        top_k = [vocab_size if p.top_k is None else min(p.top_k, vocab_size) for p in params]
        to = lambda xs, dtype: torch.tensor(xs, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
        seeded = [r for r, p in enumerate(params) if p.seed is not None and not p.greedy]
        # from torch's CPU generator: no device sync, and torch.manual_seed replays unseeded runs
        drawn = sum(not p.greedy for p in params) > len(seeded)  # some row draws from the step
        step_key = int(torch.randint(*STEP_KEYS, ())) if drawn else 0
        keys = [step_key] * len(params)
        counters = [UNSEEDED_COUNTER + r for r in range(len(params))]
        for r in seeded:
            seed = params[r].seed
            keys[r] = seed - 2**64 if seed >= 2**63 else seed  # the same 64 bits, as an int64
            counters[r] = draws[r]
        noise = to([keys, counters], torch.int64)  # one copy for both
        return cls(
            temperature=to([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            min_p=to([p.min_p for p in params], torch.float32),
            top_k=to(top_k, torch.int64),
            top_p=to([p.top_p for p in params], torch.float32),
            greedy=to(greedy, torch.bool),
            noise_keys=noise[0],
            noise_counters=noise[1],
            all_greedy=all(greedy),
            any_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
            any_top_k_top_p=any(
                not p.greedy and (p.top_k is not None or p.top_p < 1.0) for p in params
            ),
            seeded=seeded,
            seeded_rows=to(seeded, torch.int64) if seeded else None,
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


def seeded_noise(batch: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """The seeded rows' noise (S, V) fp32, as the race draws it: one Triton launch on CUDA."""
    # rows as a device tensor: indexing by a host list would copy it and wait for the device
    keys = batch.noise_keys.index_select(0, batch.seeded_rows)
    counters = batch.noise_counters.index_select(0, batch.seeded_rows)
    if keys.is_cuda:
        from .kernels.sampling import exponential_noise  # CPU-only installs may lack Triton

        return exponential_noise(keys, counters, vocab_size)
    return philox_exponential(keys, counters, vocab_size)


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (R, V) -> token ids (R,) int64, on the device: no host sync."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda and not (batch.any_min_p or batch.any_top_k_top_p):
        return sample_by_race(logits, batch)  # no filter needs the probabilities
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
    if batch.seeded:
        noise.index_copy_(0, batch.seeded_rows, seeded_noise(batch, logits.shape[-1]))
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
    (kernels/sampling.py), which draws every row's noise itself from the row's key and counter:
    a seeded row's token is what the torch path would pick from `philox_exponential`'s noise."""
    from .kernels.sampling import exponential_race  # CPU-only installs may lack Triton

    return exponential_race(
        logits, 1.0 / batch.temperature, batch.greedy, batch.noise_keys, batch.noise_counters
    )
