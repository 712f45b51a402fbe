"""Phase 8: serving. An engine inside a Python object serves nobody.

Phase 7's engine behind an OpenAI-compatible HTTP server: the engine loop runs in a background
thread (`async_engine.AsyncLLM`), each request gets an async stream of outputs, and a FastAPI app
(`api_server.build_app`) speaks /v1/completions and /v1/chat/completions, streaming included, to
any OpenAI client. `mini-vllm serve|generate|chat|bench` (cli.py) is the command line. The engine
gains what clients ask for: presence/frequency/repetition penalties and logprobs.
The server's modules (which need fastapi, uvicorn, prometheus_client) are not imported here, so
the offline `LLM` works without them. Importing this package only defines things.
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
