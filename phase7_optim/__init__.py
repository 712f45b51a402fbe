"""Phase 7: the fast engine. Attention is bandwidth-bound, the CPU launches too slowly, one GPU is
not enough.

Phase 6's engine with Triton kernels for attention on CUDA (`kernels/`: the KV store, varlen
FlashAttention prefill over the paged cache, paged decode), CUDA graphs for decode steps, batched
sampling on the GPU and tensor parallelism. On CPU the same engine runs a readable torch path.
Importing this package only defines things.
"""

from .block_manager import BlockManager
from .config import EngineConfig
from .engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from .loader import CheckpointError, load_model
from .model import ModelConfig, Qwen3ForCausalLM
from .sampling import SamplingParams
from .sequence import FinishReason, Sequence, SequenceStatus
from .tokenizer import Tokenizer
from .trace import StepTrace

__all__ = [
    "LLM",
    "BlockManager",
    "CheckpointError",
    "CompletionOutput",
    "EngineConfig",
    "FinishReason",
    "LLMEngine",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "StepTrace",
    "Tokenizer",
    "load_model",
]
