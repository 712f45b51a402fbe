"""Phase 3: a per-request KV cache and static batching.

Prefill runs the prompt once; each decode step feeds one token and reads earlier keys/values from
the cache, so per-token time stays flat. Several prompts decode together, left-padded into one
batch, until the longest is done.
"""

from .generate import BatchOutput, generate, generate_batch, iter_tokens
from .kv_cache import KVCache
from .model import ModelConfig, TinyTransformer
from .sampling import Sampler, SamplingParams
from .tokenizer import BPETokenizer

__all__ = [
    "BPETokenizer",
    "BatchOutput",
    "KVCache",
    "ModelConfig",
    "Sampler",
    "SamplingParams",
    "TinyTransformer",
    "generate",
    "generate_batch",
    "iter_tokens",
]
