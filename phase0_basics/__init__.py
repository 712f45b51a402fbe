"""Phase 0: the building blocks of a decoder-only transformer.

A byte-level BPE tokenizer, a token embedding, RoPE, RMSNorm, grouped-query causal attention,
a SwiGLU MLP, a pre-norm decoder layer, and TinyTransformer that stacks them. Nothing generates text
yet: that is phase 1.
"""

from .model import ModelConfig, TinyTransformer
from .tokenizer import BPETokenizer

__all__ = ["BPETokenizer", "ModelConfig", "TinyTransformer"]
