"""Phase 5: PagedAttention's block manager, block tables, slot mapping and prefix caching.

The engine of phase 4, with KV memory in fixed-size blocks allocated on demand instead of one
contiguous max-length region per request, and full blocks shared between requests whose prompts
share a prefix (their prefill is skipped).
"""

from .block_manager import BlockManager
from .config import EngineConfig
from .engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from .model import ModelConfig, TinyTransformer
from .sampling import Sampler, SamplingParams
from .sequence import FinishReason, Sequence, SequenceStatus
from .tokenizer import BPETokenizer
from .trace import StepTrace

__all__ = [
    "LLM",
    "BPETokenizer",
    "BlockManager",
    "CompletionOutput",
    "EngineConfig",
    "FinishReason",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "StepTrace",
    "TinyTransformer",
]
