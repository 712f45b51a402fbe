"""Tiny Qwen3.5 checkpoints (hybrid Gated DeltaNet + attention) built by transformers, for the
phases that claim the model (6-8), and transformers' own greedy continuations as the oracle.

The config exercises what the real 0.8B model has: layers L, L, L, F (DeltaNet three times, then
gated attention), 2 key heads serving 4 value heads (head repetition), partial RoPE, a conv of
width 4, tied embeddings, and the real Qwen3 vocabulary so the real tokenizer's ids are valid.
`layout="published"` writes the checkpoint as the hub's Qwen3.5 repositories hold it: a
vision-language config.json (`model_type` qwen3_5, the text model under `text_config`), tensors
under `model.language_model.*`, plus vision-tower and MTP tensors a text engine must skip.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QWEN3_VOCAB_SIZE = 151936
TINY_QWEN3_5 = dict(
    vocab_size=QWEN3_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    # rotary_dim 8 of head_dim 32, and not the default theta: a loader that ignores either fails.
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    initializer_range=0.2,  # logits spread out: greedy argmax has clear winners
    bos_token_id=151643,
    eos_token_id=151645,
)
SEED = 0


def tiny_qwen3_5(tied: bool = True, **overrides):
    """The transformers model (eval mode), seeded; norms get random gains (zero-centered: the
    checkpoint stores w for a gain of 1 + w) so a norm applied wrongly shows."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(SEED)
    config = Qwen3_5TextConfig(**{**TINY_QWEN3_5, "tie_word_embeddings": tied, **overrides})
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    return model


def save_tiny_qwen3_5(
    directory: Path, tokenizer_dir: Path, layout: str = "text", tied: bool = True
) -> Path:
    model = tiny_qwen3_5(tied)
    model.save_pretrained(directory, safe_serialization=True)
    if layout == "published":
        _as_published(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def _as_published(directory: Path) -> None:
    text_config = json.loads((directory / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": text_config.pop("tie_word_embeddings"),
        "text_config": {**text_config, "model_type": "qwen3_5_text"},
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
    }
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    renamed = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in tensors.items()
    }
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})


def greedy_continuations(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy tokens (no EOS stop), one prompt at a time: no padding."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False,
            )  # fmt: skip
            out.append(ids[0, len(prompt) :].tolist())
    return out


# Lengths around the chunk size (64) and the conv width (4), and a decode-length prompt.
PROMPT_LENGTHS = (1, 3, 63, 64, 65, 130)


def prompts_of_lengths(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [[(1000 + 37 * i + 11 * t) % 150000 for t in range(n)] for i, n in enumerate(lengths)]
