"""Phase 7 loader: every way a checkpoint can be wrong fails early with a message naming it."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from phase7_optim.loader import CheckpointError, load_model, resolve_dtype, weight_files

from .conftest import save_tiny_qwen3


@pytest.fixture
def checkpoint(tmp_path, tiny_qwen3_tied_dir):
    """A private, editable copy of a tiny checkpoint."""
    return shutil.copytree(tiny_qwen3_tied_dir, tmp_path / "ckpt")


def edit_weights(directory, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        load_model(tmp_path / "nowhere")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(checkpoint)


def test_missing_weights_mentions_pickles(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*pickle"):
        load_model(checkpoint)


def test_unsupported_architecture(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config |= {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM is not supported"):
        load_model(checkpoint)


def test_missing_key(checkpoint):
    edit_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(checkpoint)


def test_unexpected_key(checkpoint):
    edit_weights(checkpoint, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected key"):
        load_model(checkpoint)


def test_shape_mismatch(checkpoint):
    key = "model.layers.0.self_attn.k_norm.weight"
    edit_weights(checkpoint, lambda t: t.update({key: torch.ones(8)}))
    with pytest.raises(CheckpointError, match=r"k_norm\.weight' has shape \(8,\).*\(16,\)"):
        load_model(checkpoint)


def test_missing_shard(tmp_path, qwen3_tokenizer_dir):
    directory = save_tiny_qwen3(tmp_path, qwen3_tokenizer_dir, tied=True, max_shard_size="10MB")
    next(directory.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shards that are missing"):
        weight_files(directory)


def test_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    from huggingface_hub import constants

    # Read by huggingface_hub at import time from HF_HUB_OFFLINE / HF_HUB_CACHE; patched here so
    # the test never touches the network or the user's cache.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="mini-vllm/no-such-model.*offline mode: True"):
        load_model("mini-vllm/no-such-model")


def test_hub_id_found_in_the_cache(monkeypatch, tmp_path, tiny_qwen3_tied_dir):
    """An id already in the hub cache loads offline, like `LLM("Qwen/Qwen3-0.6B")` on a plane."""
    from huggingface_hub import constants

    snapshot = tmp_path / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_qwen3_tied_dir, snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert load_model("org/tiny").model_dir == snapshot


def test_dtype_auto_is_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_invalid_config_json_names_the_file(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_model(checkpoint)
    (checkpoint / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json: expected a JSON object"):
        load_model(checkpoint)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
        ({"vocab_size": True}, "vocab_size"),  # JSON true is not a count
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"architectures": "Qwen3ForCausalLM"}, "architectures"),
        ({"rope_parameters": 1e6}, "rope_parameters"),
    ],
)
def test_config_values_of_the_wrong_type_name_the_file_and_key(checkpoint, changes, key):
    edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=rf"config\.json: '{key}' must be a JSON"):
        load_model(checkpoint)


def test_a_missing_config_value_names_the_file(checkpoint):
    edit_config(checkpoint, intermediate_size=None)
    with pytest.raises(CheckpointError, match=r"ckpt: config\.json lacks 'intermediate_size'"):
        load_model(checkpoint)


def test_architectures_that_disagree_with_model_type(checkpoint):
    # A Qwen3 checkpoint relabelled as Llama would load without its q/k norms: refused instead.
    edit_config(checkpoint, model_type="llama")
    with pytest.raises(CheckpointError, match=r"\['Qwen3ForCausalLM'\] disagree with model_type"):
        load_model(checkpoint)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_safetensors_names_the_file(checkpoint, damage):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not weights" * 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_model(checkpoint)


def test_integer_weights_are_refused_not_cast(checkpoint):
    key = "model.layers.0.input_layernorm.weight"
    edit_weights(checkpoint, lambda t: t.update({key: torch.ones(t[key].shape, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight' is I8, not a float"):
        load_model(checkpoint)


def test_invalid_index_json_names_the_file(tmp_path, qwen3_tokenizer_dir):
    directory = save_tiny_qwen3(tmp_path, qwen3_tokenizer_dir, tied=True, max_shard_size="10MB")
    (directory / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        weight_files(directory)
