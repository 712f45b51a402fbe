"""Every numerical tolerance and near-tie margin the tests use, in one place, with its reason.

Greedy decoding compares token ids, and argmax flips between two correct implementations only
where the top two logits nearly tie. So a greedy comparison is meaningful only along a path whose
every step is won by a margin well above how far the two implementations' logits may drift:
`assert_no_near_tie` certifies that before any ids are compared. Tolerances are as tight as the
effect a test exists to catch allows, never wider.
"""

import torch

# float32 on CPU, the same model run two ways (cached or not, packed or padded): reductions in a
# different order drift by ~1e-6.
SAME_MODEL_ATOL = 1e-5
# Phases 0-5 (TinyTransformer): the greedy path must be won by far more than that drift.
TINY_MIN_MARGIN = 1e-3
# Our model against Hugging Face transformers, float32 on CPU: the tiny random Qwen3 drifts by
# <= 1e-4, SmolLM2's 30 layers by <= 5e-4.
HF_TINY_ATOL = 1e-4
HF_SMOLLM2_ATOL = 5e-4
# A real checkpoint's greedy path must be won by more than its drift from transformers.
HF_MIN_MARGIN = 2e-3


def min_margin(logits: torch.Tensor) -> float:
    """The smallest top-1 minus top-2 logit over the rows of (T, V) logits."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min().item()


def assert_no_near_tie(logits: torch.Tensor, margin: float) -> None:
    """Every step of a greedy path (its (T, V) logits) is won by more than `margin`."""
    got = min_margin(logits)
    assert got > margin, f"near-tie (margin {got:.1e} <= {margin:.0e}): pick other prompts"
