"""Logprobs: the log-probability of each sampled token, and of its most likely alternatives.

Problem: a client asking for `logprobs` wants each token's log-probability under the model's raw
distribution (before logit bias, penalties, temperature and filters) and the `logprobs` most
likely tokens beside it. Computed on the host, every step would copy the whole (R, V) logits back.
Idea: only the rows that ask pay, on the device, right after sampling (`token_logprobs`): a
log-softmax of those rows, a gather of the sampled ids and one top-k, queued without a sync; the
results go to pinned host memory (`LogprobsTensors.to_host`) and are read when the sampled tokens
are (`LogprobsTensors.tolists`), so overlap scheduling never waits for them. Split from
sampling.py in phase 8 (the server's responses, the streaming deltas and the output processor
need `TokenLogprobs`, not the sampler).

A prompt's logprobs (vLLM's `prompt_logprobs`; the server's `echo` with `logprobs` needs them):
each prompt token's log-probability given the tokens before it, and its rank, scored from the
hidden states of the prompt positions before it, in the step that computes them
(`prompt_token_logprobs`, `PROMPT_ROWS_PER_PASS` positions at a time: a prompt of 16k tokens
would otherwise make (16k, V) logits, 10 GB at Qwen3's vocabulary).
"""

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Logprob(NamedTuple):
    """vLLM's entry for one token at one position."""

    logprob: float
    rank: int | None = None  # 1: the most likely token
    decoded_token: str | None = None  # not filled here: the tokenizer decodes the id


@dataclass(frozen=True)
class TokenLogprobs(Mapping):
    """One sampled position: the chosen token's log-probability and the most likely tokens'.

    It also reads as vLLM's `dict[int, Logprob]` for the position (`position[token_id].logprob`,
    the chosen token first, then the others most likely first), so code written against vLLM's
    `CompletionOutput.logprobs` runs on it."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first
    rank: int | None = None  # 1: the most likely token; computed for prompt tokens only

    def _entries(self) -> dict[int, Logprob]:
        entries = {t: Logprob(v, i) for i, (t, v) in enumerate(self.top_logprobs, start=1)}
        chosen_rank = self.rank if self.rank is not None else getattr(
            entries.get(self.token_id), "rank", None)  # fmt: skip
        return {self.token_id: Logprob(self.logprob, chosen_rank), **entries}

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


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


PROMPT_ROWS_PER_PASS = 512  # prompt positions scored at once: (512, V) float32 logits, 311 MB


@dataclass
class PromptLogprobsTensors:
    """The prompt positions a step scored, in schedule order: sequence `seq_ids[i]` owns the
    next `counts[i]` rows, `targets` are the tokens scored (each position's next prompt token)."""

    seq_ids: list[int]
    counts: list[int]
    targets: list[int]
    logprobs: LogprobsTensors  # row r: targets[r]'s logprob, then its sequence's top k
    ranks: torch.Tensor  # (P,) int64

    def to_host(self) -> "PromptLogprobsTensors":
        """Queued copies into pinned host memory, as `LogprobsTensors.to_host`."""
        ranks = torch.empty(self.ranks.shape, dtype=torch.long, pin_memory=True)
        ranks.copy_(self.ranks, non_blocking=True)
        return PromptLogprobsTensors(self.seq_ids, self.counts, self.targets,
                                     self.logprobs.to_host(), ranks)  # fmt: skip

    def tolists(self) -> dict[int, list[TokenLogprobs]]:
        """Each sequence's scored prompt tokens, in prompt order, with their ranks."""
        entries = self.logprobs.tolists(self.targets)
        ranks = self.ranks.tolist()
        result, start = {}, 0
        for seq_id, count in zip(self.seq_ids, self.counts, strict=True):
            result[seq_id] = [
                TokenLogprobs(e.token_id, e.logprob, e.top_logprobs, rank)
                for e, rank in zip(entries[start : start + count], ranks[start : start + count],
                                   strict=True)
            ]  # fmt: skip
            start += count
        return result


def prompt_token_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seq_ids: list[int],
    counts: list[int],
    targets: list[int],
    ks: list[int],
) -> PromptLogprobsTensors:
    """hidden (P, C): the final hidden states of the prompt positions to score, on the device;
    targets: the token after each; ks: the alternatives each row's sequence asked for. The
    logits are made `PROMPT_ROWS_PER_PASS` rows at a time and reduced at once to each target's
    logprob and rank and the top k. Queued on the device: no sync."""
    device = hidden.device
    target_ids = torch.tensor(targets, dtype=torch.long).to(device, non_blocking=True)
    k = max(ks)
    values, top_ids, ranks = [], [], []
    for start in range(0, len(targets), PROMPT_ROWS_PER_PASS):
        rows = slice(start, start + PROMPT_ROWS_PER_PASS)
        logits = compute_logits(hidden[rows]).float()  # (p, V)
        # logprob = logit - logsumexp: ranks and the top k read the logits, and no (p, V)
        # log-softmax is written
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # (p, 1)
        chosen = logits.gather(1, target_ids[rows, None])  # (p, 1)
        ranks.append((logits > chosen).sum(dim=-1) + 1)
        top = logits.topk(min(k, logits.shape[-1]), dim=-1)
        values.append(torch.cat([chosen, top.values], dim=1) - norm)
        top_ids.append(top.indices)
    tensors = LogprobsTensors(list(range(len(targets))), ks, torch.cat(values), torch.cat(top_ids))
    return PromptLogprobsTensors(seq_ids, counts, targets, tensors, torch.cat(ranks))
