"""Phase 8: serving. An engine inside a Python object serves nobody.

Phase 7's engine behind an OpenAI-compatible HTTP server: the engine steps in engine core
processes (`engine_core.py`, token ids only), the server's process keeps the text
(`async_engine.AsyncLLM`: tokenizing, detokenizing, stop strings, one async stream of deltas per
request), and a FastAPI app (`api_server.build_app`) speaks /v1/completions,
/v1/chat/completions and /v1/responses, streaming included, to any OpenAI client. `mini-vllm
serve|engine-core|generate|chat|bench` (cli.py) is the command line. The engine gains what clients
ask for: presence/frequency/repetition penalties and logprobs. The offline `LLM` is the same two
halves in one process: the engine (token ids only) and the server's output processor (text, stop
strings), vLLM v1's shape. The HTTP server's modules (which need fastapi, uvicorn, pydantic) are
not imported here, so the offline `LLM` works without them. Importing this package only defines
things, and loads nothing
heavy: the names below are imported from their modules on first use (a module `__getattr__`, PEP
562), so that the `mini-vllm` command can set OpenMP's wait policy before torch loads (cli.py).
"""

import importlib
import typing

# public name -> the module of this package that defines it
_EXPORTS = {
    "LLM": "engine",
    "BeamSearchParams": "beam_search",
    "BlockManager": "block_manager",
    "CheckpointError": "loader",
    "CompletionOutput": "engine",
    "EngineConfig": "config",
    "FinishReason": "sequence",
    "LLMEngine": "engine",
    "ModelConfig": "model",
    "Qwen3ForCausalLM": "model",
    "RequestOutput": "engine",
    "SamplingParams": "sampling",
    "Sequence": "sequence",
    "SequenceStatus": "sequence",
    "StepTrace": "trace",
    "StructuredOutputsParams": "sampling_params",
    "TextPrompt": "engine",
    "TokensPrompt": "engine",
    "Tokenizer": "tokenizer",
    "load_model": "loader",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> typing.Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
