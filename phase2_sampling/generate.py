"""Autoregressive generation with sampling: the naive loop of phase 1, now drawing tokens.

Problem: phase 1 always takes the argmax, so a prompt has exactly one continuation.
Idea: the loop is unchanged (it still re-runs the whole sequence every step: phase 3 fixes that);
the choice of the next token moves into a `Sampler` configured by `SamplingParams`.
With temperature 0 the result is token-for-token phase 1's.
"""

from collections.abc import Iterator

import torch

from .model import TinyTransformer
from .sampling import Sampler, SamplingParams


@torch.no_grad()
def iter_tokens(
    model: TinyTransformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None = None,
) -> Iterator[int]:
    """Yields sampled tokens one at a time (so a caller can time or stream each step)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must contain at least one token")
    device = next(model.parameters()).device
    sampler = Sampler(params, device)
    ids = torch.tensor([prompt_ids], device=device)  # (1, T)
    for _ in range(params.max_tokens):
        logits = model(ids)  # (1, T, V): the whole history again, every step
        next_id = sampler(logits[0, -1])
        yield next_id
        if next_id == eos_token_id:
            return
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)


def generate(
    model: TinyTransformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None = None,
) -> list[int]:
    """Sampled continuation of `prompt_ids` (new tokens only, EOS included if produced)."""
    return list(iter_tokens(model, prompt_ids, params, eos_token_id))
