"""Phase 7 model: tiny random Qwen3 checkpoints give transformers' logits and greedy tokens.

The oracle is transformers' own Qwen3ForCausalLM loading the same directory, in float32 on CPU.
"""

import json

import pytest
import torch

from phase7_optim.loader import load_model
from phase7_optim.model import ModelConfig, Qwen3ForCausalLM

from .conftest import QWEN3_VOCAB_SIZE, assert_greedy_matches, logits_of, save_tiny_qwen3

NUM_GREEDY = 6
ATOL = 1e-4  # float32 on CPU; the two implementations order their reductions differently
PROMPTS = [
    [9707, 11, 1879, 0],  # 'Hello, world!'
    [108386, 99489],  # '你好世界'
    [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198],
]


def hf_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tiny_qwen3_dir):
    """(ours, transformers') loaded from the same tiny checkpoint."""
    return load_model(tiny_qwen3_dir).model, hf_model(tiny_qwen3_dir)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.slow  # phase 6's suite again: the CPU path is phase 6's (test_cross_phase.py)
def test_logits_match_transformers(models):
    ours, theirs = models
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = theirs(ids).logits
        assert_close(logits_of(ours, ids), expected)


def test_batched_logits_match_transformers(models):
    ours, theirs = models
    ids = torch.randint(0, QWEN3_VOCAB_SIZE, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = theirs(ids).logits
    assert_close(logits_of(ours, ids), expected)


@pytest.mark.slow
def test_greedy_tokens_match_transformers_generate(models):
    ours, theirs = models
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = theirs.generate(ids, max_new_tokens=NUM_GREEDY, do_sample=False)
        assert_greedy_matches(ours, out, len(prompt), ATOL)


def test_tied_head_is_the_embedding(tiny_qwen3_dir):
    loaded = load_model(tiny_qwen3_dir)
    tied = json.loads((tiny_qwen3_dir / "config.json").read_text())["tie_word_embeddings"]
    assert loaded.config.tie_word_embeddings == tied
    model = loaded.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_sharded_checkpoint_loads(tmp_path, qwen3_tokenizer_dir, models):
    tied = models[0].config.tie_word_embeddings
    sharded = save_tiny_qwen3(tmp_path, qwen3_tokenizer_dir, tied=tied, max_shard_size="10MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ids = torch.tensor([PROMPTS[0]])
    expected = logits_of(models[0], ids)
    assert torch.equal(logits_of(load_model(sharded).model, ids), expected)


def test_bfloat16_load_is_close(models, tiny_qwen3_dir):
    fp32, bf16 = models[0], load_model(tiny_qwen3_dir, "bfloat16").model
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.tensor([PROMPTS[0]])
    diff = (logits_of(bf16, ids).float() - logits_of(fp32, ids)).abs().max()
    assert diff < 0.5, "bf16 rounds weights and activations, never this much"


def test_from_hf_reads_both_rope_theta_spellings():
    base = json.loads(json.dumps(HF_LLAMA))
    assert ModelConfig.from_hf(base).rope_theta == 1e5
    del base["rope_theta"]
    base["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert ModelConfig.from_hf(base).rope_theta == 5e5


def test_from_hf_maps_names_and_defaults():
    hf = {k: v for k, v in HF_LLAMA.items() if k != "head_dim"}
    config = ModelConfig.from_hf(hf)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert config.head_dim == 576 // 9
    assert not config.qk_norm and config.tie_word_embeddings
    assert ModelConfig.from_hf({**HF_LLAMA, "model_type": "qwen3"}).qk_norm


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2MoeFor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
    ],
)
def test_from_hf_refuses_what_it_cannot_run(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**HF_LLAMA, **change})


def stack_projections(state: dict) -> dict:
    """Phase 0's q/k/v and gate/up weights as phase 7's stacked `qkv_proj` and `gate_up_proj`."""
    stacked = {}
    for key, value in state.items():
        for parts, merged in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                              (("gate_proj", "up_proj"), "gate_up_proj")):  # fmt: skip
            if key.endswith(f"{parts[0]}.weight"):
                prefix = key[: -len(f"{parts[0]}.weight")]
                stacked[f"{prefix}{merged}.weight"] = torch.cat(
                    [state[f"{prefix}{part}.weight"] for part in parts]
                )
                break
            if any(key.endswith(f"{part}.weight") for part in parts):
                break  # folded into the stacked weight above
        else:
            stacked[key] = value
    return stacked


def test_random_weights_equal_phase0_under_hf_names():
    """Phase 0's invariant carries over: same seed, same weights, only the names gained `model.`
    and the projections that run as one matmul are stacked (linear.py: one uniform_ draw over the
    stacked matrix is the same stream as the separate draws, in creation order)."""
    from phase0_basics.model import ModelConfig as Phase0Config
    from phase0_basics.model import TinyTransformer

    torch.manual_seed(0)
    phase0 = TinyTransformer(Phase0Config()).state_dict()
    torch.manual_seed(0)
    phase7 = Qwen3ForCausalLM(ModelConfig(qk_norm=False)).state_dict()
    renamed = {k if k.startswith("lm_head") else f"model.{k}": v for k, v in phase0.items()}
    renamed = stack_projections(renamed)
    assert renamed.keys() == phase7.keys()
    assert all(torch.equal(renamed[k], phase7[k]) for k in phase7)


def test_qk_norm_modules_follow_the_config():
    with_norm = Qwen3ForCausalLM(ModelConfig(qk_norm=True)).state_dict()
    without = Qwen3ForCausalLM(ModelConfig(qk_norm=False)).state_dict()
    assert "model.layers.0.self_attn.q_norm.weight" in with_norm
    assert not any("q_norm" in k or "k_norm" in k for k in without)


HF_LLAMA = {  # SmolLM2-135M's config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}
