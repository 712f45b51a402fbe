"""Loading a Hugging Face checkpoint (a local directory or a hub id) into Qwen3ForCausalLM.

Problem: real weights live in `*.safetensors` files (one, or several shards listed in
`model.safetensors.index.json`) next to a `config.json`; a model of billions of parameters must
not be built twice (random init, then overwritten) and must never be unpickled from a `.bin`.
Idea: read config.json into a `ModelConfig`, build the model on the `meta` device (shapes only,
no memory, no random init), give it uninitialized storage on the target device, then copy every
tensor from the safetensors files by name: our module names are the checkpoint keys (model.py).
Everything is checked before a single weight is copied, so a bad checkpoint fails fast with a
message naming the file and the key.

Invariants:
- after `load_model`, every parameter holds a checkpoint tensor: missing keys are an error, except
  `lm_head.weight` of a tied model, which IS `model.embed_tokens.weight`;
- no pickle is ever read: safetensors only;
- RoPE tables are not in checkpoints; they are recomputed in float32 whatever the weight dtype.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .model import ModelConfig, Qwen3ForCausalLM
from .rope import RotaryEmbedding

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# What snapshot_download fetches: no `.bin`/`.pt` pickles, no framework-specific duplicates.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Old Llama exports store RoPE's inverse frequencies; we compute them instead.
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file or the key."""


@dataclass(frozen=True)
class LoadedModel:
    model: Qwen3ForCausalLM
    config: ModelConfig
    model_dir: Path  # where config.json lives; tokenizer files are read from here too


def load_model(
    path_or_id: str | os.PathLike,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load a checkpoint for inference (eval mode, no gradients).

    dtype "auto" means bfloat16 on a CUDA device that supports it and float32 elsewhere: on a
    2-core CPU, bf16 matmuls are not faster and round every activation, which would make
    comparisons against transformers' float32 logits loose for nothing.
    """
    model_dir = resolve_model_dir(path_or_id)
    device = torch.device(device)
    config = ModelConfig.from_hf(read_hf_config(model_dir))
    model = _build_empty(config, resolve_dtype(dtype, device), device)
    load_weights(model, weight_files(model_dir))
    return LoadedModel(model.eval().requires_grad_(False), config, model_dir)


def resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    """A local directory as is; else something shaped like `org/name` via the hub (or its cache)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; expected a model directory (with config.json)")
    name = str(path_or_id)
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"no model directory at {path} (and it is not a hub id org/name)")
    return _download(name)


def _download(repo_id: str) -> Path:
    # Imported here: only hub ids need it, and a local directory must load without it.
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: all mean "not here"
        raise FileNotFoundError(
            f"could not get {repo_id!r} from the Hugging Face hub or its cache "
            f"(offline mode: {constants.HF_HUB_OFFLINE}): {e}"
        ) from e


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected 'auto', {', '.join(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
    return json.loads(path.read_text(encoding="utf-8"))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = f"; found {pickles}, which are pickles: convert to safetensors" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def _build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Qwen3ForCausalLM:
    # Shapes only: no memory, no random init. (The first meta-device ops of a process import
    # torch's meta kernels once, ~1.5 s; a random init of a 0.6B model on CPU costs more.)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # garbage until load_weights fills it
    model.tie_weights()
    tables = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
    for module in model.modules():  # one shared instance, listed once
        if isinstance(module, RotaryEmbedding):
            module.cos, module.sin = tables.cos.to(device), tables.sin.to(device)
    return model


# exercise 6.1: name-for-name weight loading
def load_weights(model: Qwen3ForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into the parameter of the same name, after checking them all."""
    params = model.state_dict(keep_vars=True)  # name -> Parameter; a tied head appears twice
    key_files = _check_keys(model, files, params)
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key_files.get(key) == file:
                        params[key].copy_(f.get_tensor(key))  # casts to the model's dtype


def _check_keys(
    model: Qwen3ForCausalLM, files: list[Path], params: dict[str, torch.Tensor]
) -> dict[str, Path]:
    """Key -> file it is read from; raises on unexpected, missing or wrongly shaped tensors."""
    key_files: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(IGNORED_KEY_SUFFIXES):
                    continue
                if key not in params:
                    raise CheckpointError(f"{file.name}: unexpected key {key!r} (not in the model)")
                shape, want = tuple(f.get_slice(key).get_shape()), tuple(params[key].shape)
                if shape != want:
                    raise CheckpointError(
                        f"{file.name}: {key!r} has shape {shape}, config.json implies {want}"
                    )
                key_files[key] = file
    optional = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(params) - set(key_files) - optional)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint in {files[0].parent} lacks {shown}")
    return key_files
