"""Phase 6: real checkpoints (Qwen3 and the Llama family), real tokenizer and chat template.

Work in progress: the model, loader, tokenizer and embedded default model exist standalone; the
phase-5 engine is merged in next, and then this file exports `LLM` and `SamplingParams`.
"""
