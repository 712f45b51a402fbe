"""Phase 7 fixtures: tiny random Qwen3 checkpoints written by transformers, and the default model.

Every model forward in this suite goes through `logits_of`, the one place that knows the model's
call signature (phase 5's paged interface).
"""

import shutil
from pathlib import Path

import pytest
import torch

from phase7_optim.attention import ForwardBatch
from phase7_optim.default_model import default_model_dir
from phase7_optim.kv_cache import KVCache
from phase7_optim.loader import LoadedModel, load_model
from tests import assets

QWEN3_VOCAB_SIZE = 151936  # the real vocabulary, so the real tokenizer's ids are all valid
TINY_QWEN3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Not the default 1e4, so a loader that ignores rope_parameters fails the logits test.
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    # Larger than the default 0.02: logits spread out, so greedy argmax has clear winners.
    initializer_range=0.2,
    bos_token_id=151643,
    eos_token_id=151645,
)
SEED = 0


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids (B, T) -> logits (B, T, V) for every position, through the engine's paged forward:
    each row is one sequence prefilled whole into one block of T slots, and every token samples."""
    B, T = input_ids.shape
    c = model.config
    dtype = model.lm_head.weight.dtype
    kv_cache = KVCache(c.num_layers, B, T, c.num_kv_heads, c.head_dim, dtype, input_ids.device)
    arange = lambda n: torch.arange(n, device=input_ids.device)  # noqa: E731
    batch = ForwardBatch(
        query_start_loc=arange(B + 1) * T,
        seq_lens=torch.full((B,), T, device=input_ids.device),
        slot_mapping=arange(B * T),  # row b's token t -> block b, offset t
        block_tables=arange(B)[:, None],
        logits_indices=arange(B * T),
        max_query_len=T,
        max_seq_len=T,
        block_size=T,
    )
    positions = arange(T).repeat(B)
    with torch.inference_mode():
        return model(input_ids.flatten(), positions, batch, kv_cache).view(B, T, -1)


def assert_greedy_matches(
    model: torch.nn.Module, sequence: torch.Tensor, prompt_len: int, atol: float
) -> None:
    """`sequence` (1, T) is a prompt plus the oracle's greedy continuation. Our greedy loop yields
    the same tokens iff our argmax at every continuation position is the next token; position t
    sees tokens 0..t only, so one teacher-forced forward checks the whole loop.

    Near-ties make argmax fragile, so the winning margin must exceed what the logits may differ by.
    """
    logits = logits_of(model, sequence)[0, prompt_len - 1 : -1]  # (T - prompt_len, V)
    top2 = logits.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == sequence[0, prompt_len:].tolist()
    margin = (top2.values[:, 0] - top2.values[:, 1]).min().item()
    assert margin > 2 * atol, f"near-tie (margin {margin:.1e}): greedy agreement would be luck"


def save_tiny_qwen3(directory: Path, tokenizer_dir: Path, tied: bool, **save_kwargs) -> Path:
    """A random 2-layer Qwen3 saved by transformers (fixed seed), plus the real tokenizer files."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3Config(vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=tied, **TINY_QWEN3)
    model = Qwen3ForCausalLM(config)
    with (
        torch.no_grad()
    ):  # norms start at 1.0; random gains catch a norm applied in the wrong place
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = [151645, 151643]  # like the real Qwen3 checkpoints
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return assets.qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def tiny_qwen3_tied_dir(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-tied"), qwen3_tokenizer_dir, tied=True)


@pytest.fixture(scope="session")
def tiny_qwen3_untied_dir(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-untied")
    return save_tiny_qwen3(directory, qwen3_tokenizer_dir, tied=False)


@pytest.fixture(scope="session", params=["tied", "untied"])
def tiny_qwen3_dir(request) -> Path:
    """Both variants: tests taking this run once with a tied and once with an untied LM head."""
    return request.getfixturevalue(f"tiny_qwen3_{request.param}_dir")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted once per machine into the mini-vllm cache."""
    return default_model_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir) -> LoadedModel:
    return load_model(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
