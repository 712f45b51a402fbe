"""Loading a Hugging Face checkpoint (a local directory or a hub id) into our model classes.

Problem: real weights live in `*.safetensors` files (one, or several shards listed in
`model.safetensors.index.json`) next to a `config.json`; a model of billions of parameters must
not be built twice (random init, then overwritten) and must never be unpickled from a `.bin`.
Idea: read config.json into a `ModelConfig`, build the model on the `meta` device (shapes only,
no memory, no random init), give it uninitialized storage on the target device, then copy every
tensor from the safetensors files by name: our module names are the checkpoint keys (model.py).
Everything is checked before a single weight is copied, so a bad checkpoint fails fast with a
`CheckpointError` naming the file and the key: invalid JSON, config values of the wrong type,
`architectures` that disagree with `model_type`, a truncated or garbage safetensors file, missing,
unexpected or misshaped tensors, and integer tensors (quantized or corrupt weights: casting them to
floats would run a silently wrong model).

Phase 7 (tensor parallelism): each rank builds the model for its `TensorParallel` rank and reads
only its piece of every tensor: the sharded layers say which piece goes where (`shard()`, a
`WeightShard`), and safetensors reads a slice of a tensor without reading the rest. Checkpoint
tensors we stack (q/k/v, gate/up: `STACKED_PARAMS`) land in their part of the stacked weight.
`load_format="dummy"` (vLLM's name) skips the checkpoint: every rank fills its own shard with
small random values where it lives, so a benchmark can run a 70B-parameter shape from nothing but
a config.json.

Qwen3.5 (`model_type` qwen3_5, the published vision-language checkpoints, or qwen3_5_text) loads
into the hybrid `Qwen3_5ForCausalLM` (qwen3_5.py): its text config is read from `text_config`,
its `model.language_model.*` tensors are the text model's `model.*`, and the vision tower and
the multi-token-prediction head are skipped, with a log line that says how many tensors.

Invariants:
- after `load_model`, every parameter holds a checkpoint tensor: missing keys are an error, except
  `lm_head.weight` of a tied model, which IS `model.embed_tokens.weight`;
- no rank reads more of a checkpoint tensor than its own piece (replicated tensors: all of it);
- no pickle is ever read: safetensors only;
- RoPE tables are not in checkpoints; they are recomputed in float32 whatever the weight dtype.
"""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import DEFAULT_KERNELS, LOAD_FORMATS, KernelConfig
from .distributed import SINGLE_RANK, TensorParallel
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear, WeightShard
from .model import STACKED_PARAMS, ModelConfig, Qwen3ForCausalLM
from .qwen3_5 import STACKED_PARAMS as HYBRID_STACKED_PARAMS
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, checkpoint_key
from .rope import RotaryEmbedding

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# What snapshot_download fetches: no `.bin`/`.pt` pickles, no framework-specific duplicates.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Old Llama exports store RoPE's inverse frequencies; we compute them instead.
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_TENSOR_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names for what we load
ARCHITECTURE_BY_MODEL_TYPE = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
}
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")  # Qwen3.5: DeltaNet and attention layers
# config.json fields we read, by the JSON type they must have (null means "absent" for all).
CONFIG_FIELD_TYPES = {
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
         "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
         "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval"),
        int,
    ),
    "layer_types": list,
    "text_config": dict,
    "rms_norm_eps": float,
    "rope_theta": float,
    "tie_word_embeddings": bool,
    "model_type": str,
    "architectures": list,
    "rope_parameters": dict,
}  # fmt: skip
# Dummy weights as vLLM draws them: uniform in [-1e-3, 1e-3], so bf16 activations stay finite.
DUMMY_WEIGHT_RANGE = 1e-3
DUMMY_SEED = 0  # rank r draws from DUMMY_SEED + r
SHARDED_MODULES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file or the key."""


@dataclass(frozen=True)
class LoadedModel:
    model: Qwen3ForCausalLM | Qwen3_5ForCausalLM
    config: ModelConfig | Qwen3_5Config
    model_dir: Path  # where config.json lives; tokenizer files are read from here too


def load_model(
    path_or_id: str | os.PathLike,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str | None = "cpu",
    tp: TensorParallel = SINGLE_RANK,
    load_format: str = "auto",
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> LoadedModel:
    """Load a checkpoint for inference (eval mode, no gradients): rank `tp.rank`'s shard of it.

    dtype "auto" means bfloat16 on a CUDA device that supports it and float32 elsewhere: on a
    2-core CPU, bf16 matmuls are not faster and round every activation, which would make
    comparisons against transformers' float32 logits loose for nothing.
    load_format "dummy": random weights of the checkpoint's config; its safetensors are not read.
    kernels: which fused and small-batch kernels the model's CUDA path runs (config.py).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    device = resolve_device(device)
    model_dir = resolve_model_dir(path_or_id)
    config = read_model_config(model_dir)
    model = _build_empty(config, resolve_dtype(dtype, device), device, tp, kernels)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
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


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on (None: CUDA if present, else CPU), refusing names torch cannot parse."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be a str or a torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a device torch knows: {e}") from None


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected 'auto', {', '.join(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


def read_model_config(model_dir: Path) -> ModelConfig | Qwen3_5Config:
    hf = read_hf_config(model_dir)
    if hf.get("model_type") not in ARCHITECTURE_BY_MODEL_TYPE:
        name = ", ".join(hf.get("architectures") or []) or f"model_type {hf.get('model_type')!r}"
        raise CheckpointError(
            f"{model_dir}: {name} is not supported; supported: "
            f"{', '.join(ARCHITECTURE_BY_MODEL_TYPE.values())}"
        )
    try:
        if hf.get("model_type") in HYBRID_MODEL_TYPES:
            return Qwen3_5Config.from_hf(_text_config(hf))
        return ModelConfig.from_hf(hf)
    except ValueError as e:  # "config.json lacks ...", an unsupported model: name the checkpoint
        raise CheckpointError(f"{model_dir}: {e}") from None


def read_hf_config(model_dir: Path) -> dict:
    """config.json as a dict, its fields' types checked (a "64" is not a hidden size)."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
    hf = _read_json(path)
    for fields in (hf, hf.get("text_config") or {}):  # text_config: a published Qwen3.5's
        for key, kind in CONFIG_FIELD_TYPES.items():
            value = fields.get(key)
            bad_number = kind is not bool and isinstance(value, bool)  # JSON true is not a count
            if value is not None and (bad_number or not isinstance(value, _json_types(kind))):
                raise CheckpointError(
                    f"{path}: {key!r} must be a JSON {kind.__name__}, got {value!r}"
                )
    model_type, architectures = hf.get("model_type"), hf.get("architectures")
    expected = ARCHITECTURE_BY_MODEL_TYPE.get(model_type)
    if expected is not None and architectures is not None and architectures != [expected]:
        raise CheckpointError(
            f"{path}: architectures {architectures} disagree with model_type {model_type!r} "
            f"(which means [{expected!r}])"
        )
    return hf


def _text_config(hf: dict) -> dict:
    """A published Qwen3.5 config.json nests the text model's fields under `text_config`; its
    top-level `tie_word_embeddings` is the one transformers obeys."""
    text = {**hf, **(hf.get("text_config") or {})}
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _json_types(kind: type) -> type | tuple[type, ...]:
    return (int, float) if kind is float else kind  # JSON writes 1e6 as 1000000.0 or 1000000


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
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


def _build_empty(
    config: ModelConfig | Qwen3_5Config,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
    kernels: KernelConfig,
) -> Qwen3ForCausalLM | Qwen3_5ForCausalLM:
    # Shapes only: no memory, no random init. (The first meta-device ops of a process import
    # torch's meta kernels once, ~1.5 s; a random init of a 0.6B model on CPU costs more.)
    hybrid = isinstance(config, Qwen3_5Config)
    with torch.device("meta"):
        model_class = Qwen3_5ForCausalLM if hybrid else Qwen3ForCausalLM
        model = model_class(config, tp, kernels)
    model = model.to(dtype).to_empty(device=device)  # garbage until load_weights fills it
    model.tie_weights()
    rope_dim = config.rotary_dim if hybrid else config.head_dim
    tables = RotaryEmbedding(rope_dim, config.max_position_embeddings, config.rope_theta)
    for module in model.modules():  # one shared instance, listed once
        if isinstance(module, RotaryEmbedding):
            module.cos, module.sin = tables.cos.to(device), tables.sin.to(device)
    return model


def init_dummy_weights(model: Qwen3ForCausalLM) -> None:
    """Fill this rank's shard with seeded random values, on its device (nothing built whole)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(DUMMY_SEED + model.tp.rank)
    with torch.no_grad():
        for param in model.parameters():  # a tied head is listed once
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes on this rank: a piece of one parameter."""

    param: torch.Tensor
    shard: WeightShard


def checkpoint_targets(model: Qwen3ForCausalLM) -> dict[str, Target]:
    """Checkpoint key -> its target on this rank. Sharded layers say which piece is theirs;
    stacked weights (qkv_proj, gate_up_proj) take one checkpoint tensor per shard id."""
    targets: dict[str, Target] = {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        for param_name, param in module.named_parameters(recurse=False):  # a tied head: twice
            if not isinstance(module, SHARDED_MODULES):
                targets[f"{name}.{param_name}"] = Target(param, WeightShard.whole(param.shape))
                continue
            stacked = [
                (ckpt, shard_id)
                for ckpt, ours, shard_id in STACKED_PARAMS + HYBRID_STACKED_PARAMS
                if ours == leaf
            ]
            if not stacked:
                targets[f"{name}.{param_name}"] = Target(param, module.shard())
            for ckpt, shard_id in stacked:
                targets[f"{prefix}.{ckpt}.{param_name}"] = Target(param, module.shard(shard_id))
    return targets


def load_weights(model: Qwen3ForCausalLM, files: list[Path]) -> None:
    """Copy this rank's piece of every checkpoint tensor into its place, after checking them all."""
    targets = checkpoint_targets(model)
    key_files = _check_keys(model, files, targets)
    with torch.no_grad():
        for file in files:
            with _open_safetensors(file) as f:
                for checkpoint_name in f.keys():
                    key = _our_name(model, checkpoint_name)
                    if key is not None and key_files.get(key) == file:
                        param, shard = targets[key].param, targets[key].shard
                        piece = _read_piece(f.get_slice(checkpoint_name), shard)  # these bytes
                        dest = param.narrow(shard.dim, shard.dest_start, shard.size)
                        dest.copy_(piece)  # casts to the model's dtype


def _our_name(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, key: str) -> str | None:
    """The name a checkpoint key loads into; None for tensors that are not ours to load."""
    if key.endswith(IGNORED_KEY_SUFFIXES):
        return None
    return checkpoint_key(key) if isinstance(model, Qwen3_5ForCausalLM) else key


def _read_piece(tensor_slice, shard: WeightShard) -> torch.Tensor:
    end = shard.start + shard.size
    return tensor_slice[shard.start : end] if shard.dim == 0 else tensor_slice[:, shard.start : end]


def _check_keys(
    model: Qwen3ForCausalLM, files: list[Path], targets: dict[str, Target]
) -> dict[str, Path]:
    """Key -> file it is read from; raises on unexpected, missing or wrongly shaped tensors."""
    key_files: dict[str, Path] = {}
    skipped = 0
    for file in files:
        with _open_safetensors(file) as f:
            for checkpoint_name in f.keys():
                key = _our_name(model, checkpoint_name)
                if key is None:
                    skipped += not checkpoint_name.endswith(IGNORED_KEY_SUFFIXES)
                    continue
                if key not in targets:
                    raise CheckpointError(f"{file.name}: unexpected key {key!r} (not in the model)")
                tensor = f.get_slice(checkpoint_name)
                shape, want = tuple(tensor.get_shape()), targets[key].shard.full_shape
                if shape != want:
                    raise CheckpointError(
                        f"{file.name}: {key!r} has shape {shape}, config.json implies {want}"
                    )
                if tensor.get_dtype() not in FLOAT_TENSOR_DTYPES:
                    raise CheckpointError(
                        f"{file.name}: {key!r} is {tensor.get_dtype()}, not a float tensor "
                        "(quantized weights are not supported; casting them would be wrong)"
                    )
                key_files[key] = file
    if skipped:
        logger.info(
            "skipped %d checkpoint tensors outside the text model (vision tower, MTP head)",
            skipped,
        )
    optional = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(targets) - set(key_files) - optional)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint in {files[0].parent} lacks {shown}")
    return key_files


def _open_safetensors(file: Path):
    """`safe_open`, with a truncated or garbage file reported as a CheckpointError naming it."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
