"""Phase 4: an engine with continuous batching, chunked prefill and preemption.

`LLM(model).generate(prompts, SamplingParams(...))`, vLLM's shape. Every step the scheduler packs
running decodes and chunks of new prompts into one flat batch under a token budget; finished
requests leave and waiting ones join at once; when the KV cache is full the newest request is
preempted and recomputed later.
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
