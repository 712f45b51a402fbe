"""Generation with a KV cache, one request or a statically batched group of them.

Problem: phases 1-2 re-run the model over the whole history for every token: O(n^2) work.
Idea: prefill the prompt once into a KV cache, then feed only the newest token each step
(kv_cache.py). Several prompts can share the same forward passes by stacking them into one batch:
the rows are left-padded to the longest prompt (so every row's newest token sits in the same last
column), each row gets its own positions (0 at its first real token) and its own `Sampler`.

The price of static batching, measured by `BatchOutput.wasted_fraction`: padding slots in the
prefill, and rows that already finished but keep riding along until the longest row is done.
Phase 4 replaces the fixed batch with continuous batching.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .model import TinyTransformer
from .sampling import Sampler, SamplingParams


@dataclass
class BatchOutput:
    token_ids: list[list[int]]  # new tokens per prompt, EOS included if produced
    num_slots: int  # token positions the batch computed (rows x columns, prefill + decode)
    num_wasted_slots: int  # of those, padding or rows that had already finished

    @property
    def wasted_fraction(self) -> float:
        return self.num_wasted_slots / self.num_slots


def _check(model: TinyTransformer, prompts: list[list[int]], params: list[SamplingParams]):
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    limit = model.config.max_position_embeddings
    for p, sp in zip(prompts, params, strict=True):
        if len(p) + sp.max_tokens > limit:
            raise ValueError(
                f"prompt of {len(p)} tokens + max_tokens={sp.max_tokens} exceeds "
                f"max_position_embeddings ({limit})"
            )


@torch.no_grad()
def iter_steps(
    model: TinyTransformer,
    prompts: list[list[int]],
    params: list[SamplingParams],
    eos_token_id: int | None = None,
) -> Iterator[list[int | None]]:
    """Yields, per step, each row's new token (None once a row has finished)."""
    _check(model, prompts, params)
    device = next(model.parameters()).device
    B, longest = len(prompts), max(len(p) for p in prompts)
    max_new = max(sp.max_tokens for sp in params)
    cfg = model.config
    cache = KVCache(
        cfg.num_layers, B, longest + max_new, cfg.num_kv_heads, cfg.head_dim,
        model.lm_head.weight.dtype, device,
    )  # fmt: skip
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    columns = torch.arange(longest + max_new, device=device)
    padding_mask = columns[None, :] < pads[:, None]  # (B, S_max): True on left padding
    positions = (torch.arange(longest, device=device)[None, :] - pads[:, None]).clamp(min=0)
    samplers = [Sampler(sp, device) for sp in params]
    done = [False] * B
    generated = [0] * B
    for _ in range(max_new):
        S = cache.length + input_ids.shape[1]
        logits = model(input_ids, positions, cache, padding_mask[:, :S])[:, -1]  # (B, V)
        step: list[int | None] = [None] * B
        for row in range(B):
            if done[row]:
                continue
            token = samplers[row](logits[row])
            step[row], generated[row] = token, generated[row] + 1
            done[row] = token == eos_token_id or generated[row] == params[row].max_tokens
        yield step
        if all(done):
            return
        # Finished rows still compute (static batching): feed them a dummy token.
        input_ids = torch.tensor([[t if t is not None else 0] for t in step], device=device)
        positions = positions[:, -1:] + 1


def generate_batch(
    model: TinyTransformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eos_token_id: int | None = None,
) -> BatchOutput:
    """Decodes all prompts together until the last one finishes."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    steps = 0
    for step in iter_steps(model, prompts, params, eos_token_id):
        steps += 1
        for row, token in enumerate(step):
            if token is not None:
                outputs[row].append(token)
    longest = max(len(p) for p in prompts)
    useful = sum(len(p) for p in prompts) + sum(len(o) - 1 for o in outputs)
    num_slots = len(prompts) * (longest + steps - 1)  # the last sampled token is never fed
    return BatchOutput(outputs, num_slots, num_slots - useful)


def iter_tokens(
    model: TinyTransformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None = None,
) -> Iterator[int]:
    """Yields one request's tokens as they are sampled (a batch of one)."""
    for step in iter_steps(model, [prompt_ids], [params], eos_token_id):
        yield step[0]


def generate(
    model: TinyTransformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None = None,
) -> list[int]:
    """Sampled continuation of `prompt_ids` (new tokens only, EOS included if produced)."""
    return list(iter_tokens(model, prompt_ids, params, eos_token_id))
