"""Phase 2: sampling with temperature, top-k, top-p and min-p, seeded per request.

The naive loop of phase 1 with a `Sampler` choosing each token. Temperature 0 is greedy and gives
exactly phase 1's tokens.
"""

from .generate import generate, iter_tokens
from .model import ModelConfig, TinyTransformer
from .sampling import Sampler, SamplingParams
from .tokenizer import BPETokenizer

__all__ = [
    "BPETokenizer",
    "ModelConfig",
    "Sampler",
    "SamplingParams",
    "TinyTransformer",
    "generate",
    "iter_tokens",
]
