"""Naive autoregressive generation: the simplest loop that produces text, and why it is slow.

Problem: a language model only predicts the next token; text needs many of them.
Idea: feed the whole sequence, take the argmax of the last position's logits, append it, repeat
until EOS or `max_new_tokens`. This is nanoGPT's `generate()`.

The cost is the lesson: step t re-runs the model over all `len(prompt) + t` tokens, recomputing
keys and values that did not change, so one token costs O(n) work and the whole answer O(n^2).
Phase 3 keeps those keys and values in a cache instead.
"""

from collections.abc import Iterator

import torch

from .model import TinyTransformer


# exercise 1.1: the naive generation loop
@torch.no_grad()
def iter_tokens(
    model: TinyTransformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> Iterator[int]:
    """Yields greedy tokens one at a time (so a caller can time or stream each step)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must contain at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)  # (1, T)
    for _ in range(max_new_tokens):
        logits = model(ids)  # (1, T, V): the whole history again, every step
        next_id = int(logits[0, -1].argmax())
        yield next_id
        if next_id == eos_token_id:
            return
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)


# exercise 1.2: generate, the loop's tokens as a list
def generate(
    model: TinyTransformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy continuation of `prompt_ids` (new tokens only, EOS included if produced)."""
    return list(iter_tokens(model, prompt_ids, max_new_tokens, eos_token_id))
