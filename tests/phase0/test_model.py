"""Phase 0 building blocks, each checked against an independent oracle (torch or transformers)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from phase0_basics.attention import causal_attention
from phase0_basics.embedding import Embedding
from phase0_basics.mlp import MLP
from phase0_basics.model import ModelConfig, TinyTransformer
from phase0_basics.norm import RMSNorm
from phase0_basics.rope import RotaryEmbedding


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def test_embedding_is_one_hot_matmul():
    torch.manual_seed(0)
    emb = Embedding(50, 8)
    ids = torch.tensor([[3, 7, 49, 0]])
    one_hot = F.one_hot(ids, 50).float()
    assert_close(emb(ids), one_hot @ emb.weight)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_causal_attention_matches_sdpa(num_heads, num_kv_heads):
    torch.manual_seed(0)
    B, T, D = 2, 9, 16
    q = torch.randn(B, num_heads, T, D)
    k = torch.randn(B, num_kv_heads, T, D)
    v = torch.randn(B, num_kv_heads, T, D)
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True
    )
    assert_close(causal_attention(q, k, v), expected)


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.randn(16)
    x = torch.randn(3, 5, 16)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert_close(norm(x), expected)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=16, max_position=64, theta=10000.0)
    q = torch.randn(1, 1, 16)  # (T, heads, D)
    k = torch.randn(1, 1, 16)

    def score(pq, pk):
        rq = rope(q, torch.tensor([pq]))
        rk = rope(k, torch.tensor([pk]))
        return (rq * rk).sum()

    assert_close(score(5, 2), score(40, 37))
    assert_close(score(0, 0), (q * k).sum())  # position 0 is the identity rotation
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_mlp_is_swiglu():
    torch.manual_seed(0)
    mlp = MLP(8, 32)
    x = torch.randn(2, 8)
    expected = (
        F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
    ) @ mlp.down_proj.weight.T
    assert_close(mlp(x), expected)


def test_model_is_causal():
    torch.manual_seed(0)
    model = TinyTransformer(ModelConfig())
    ids = torch.randint(0, 512, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    with torch.no_grad():
        assert_close(model(ids)[:, :8], model(changed)[:, :8])
        assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:])


def test_seed_fixes_weights_and_keys():
    torch.manual_seed(3)
    a = TinyTransformer(ModelConfig()).state_dict()
    torch.manual_seed(3)
    b = TinyTransformer(ModelConfig()).state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "layers.0.self_attn.q_proj.weight" in a and "embed_tokens.weight" in a


def test_rope_matches_transformers_rotary_embedding():
    """The rotation alone (no attention around it) against Llama's: the half-split pairing and
    the angles of each position, in any order of positions."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = ModelConfig()
    hf_config = llama.LlamaConfig(
        hidden_size=config.num_heads * config.head_dim,
        num_attention_heads=config.num_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
    )
    rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
    torch.manual_seed(0)
    x = torch.randn(2, 5, config.num_heads, config.head_dim)  # (B, T, H, D)
    positions = torch.tensor([[0, 1, 2, 3, 4], [9, 3, 40, 7, 100]])
    cos, sin = llama.LlamaRotaryEmbedding(hf_config)(x, positions)  # (B, T, D)
    expected, _ = llama.apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=2)
    assert_close(rope(x, positions), expected)


def test_matches_transformers_llama():
    """Same weights in Hugging Face's Llama give the same logits: the architecture is Llama's."""
    transformers = pytest.importorskip("transformers")
    config = ModelConfig()
    torch.manual_seed(0)
    ours = TinyTransformer(config).eval()
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    state = {
        (k if k.startswith("lm_head") else f"model.{k}"): v for k, v in ours.state_dict().items()
    }
    hf.load_state_dict(state)
    ids = torch.randint(0, config.vocab_size, (2, 17))
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change", [{"num_kv_heads": 3}, {"hidden_size": 0}, {"head_dim": 15}])
def test_config_validation(change):
    with pytest.raises(ValueError):
        dataclasses.replace(ModelConfig(), **change)


def test_too_long_input_raises():
    config = ModelConfig(max_position_embeddings=8)
    model = TinyTransformer(config)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 9, dtype=torch.long))
