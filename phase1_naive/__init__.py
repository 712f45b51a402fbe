"""Phase 1: generating text with the naive loop.

TinyTransformer from phase 0, plus `generate()`: re-run the whole sequence for every new token.
Correct, and O(n^2): the benchmark shows per-token time growing with the sequence length.
"""

from .generate import generate, iter_tokens
from .model import ModelConfig, TinyTransformer
from .tokenizer import BPETokenizer

__all__ = ["BPETokenizer", "ModelConfig", "TinyTransformer", "generate", "iter_tokens"]
