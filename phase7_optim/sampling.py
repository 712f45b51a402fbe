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

Phase 7: `Sampler` draws one row at a time with its own kernels and a host transfer per request;
at 256 requests a step that is hundreds of launches and syncs. `sample_batch` does the whole batch
in one pass with per-row parameter tensors (`SamplingBatch`) and returns a device tensor, so the
engine copies tokens to the host once per step. It follows vLLM's order, which differs from the
one above: temperature, then min-p, then top-k, then top-p on what top-k left. (min-p compares
ratios to the top token, which top-k keeps, so only top-p's nucleus can differ: computed after
min-p here, before it in `filtered_logits`.) It draws with the exponential race (Gumbel-max):
argmax(probs / E) with E ~ Exponential(1) picks token i with probability probs[i], without the
cumulative-sum search of `torch.multinomial`, and without any sort unless a row asks for top-k or
top-p. Greedy rows take the exact argmax of the logits. A seeded request draws its noise row from
its own generator, so its tokens do not depend on what shares its batch.
"""

from dataclasses import dataclass, field

import torch

TINY = torch.finfo(torch.float32).tiny  # noise floor: E == 0 would divide 0 / 0 for a dropped token


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
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None] * kept_mass, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits (R, V) -> token ids (R,) int64, on the device: no host sync."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
    for row, generator in batch.seeded:  # only seeded rows loop: one launch each
        noise[row].exponential_(generator=generator)
    noise.clamp_min_(TINY)
    if logits.is_cuda and not (batch.any_min_p or batch.any_top_k_top_p):
        # no filter needs the probabilities: one pass over logits and noise (kernels/sampling.py)
        from .kernels.sampling import exponential_race  # here: CPU-only installs may lack Triton

        return exponential_race(logits, noise, 1.0 / batch.temperature, batch.greedy)
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
