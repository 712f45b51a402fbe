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
"""

from dataclasses import dataclass

import torch


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
