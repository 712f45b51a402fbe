"""Qwen3ForCausalLM: the phase-0 architecture, shaped so real checkpoints load name for name.

Problem: random weights say nothing; real ones come as Hugging Face checkpoints whose tensor names
(`model.layers.3.self_attn.q_proj.weight`) and config.json fields (`num_hidden_layers`) are fixed.
Idea: keep phase 0's Llama architecture (pre-norm, RoPE, GQA, SwiGLU) and change only what real
checkpoints need:
- module names equal checkpoint keys: the decoder stack is `Qwen3Model` under `.model`, the
  projection to the vocabulary is `.lm_head`, so loading is a name-for-name copy (loader.py);
- Qwen3's per-head q/k RMSNorm (`qk_norm`, see attention.py);
- a tied LM head (`tie_word_embeddings`): `lm_head.weight` IS `embed_tokens.weight`, one tensor
  under two names, as small models save memory that way;
- `ModelConfig.from_hf` reads config.json, including the checkpoint's RoPE theta.
The same class serves Llama-family checkpoints (SmolLM2, Llama 3 without RoPE scaling) with
`qk_norm=False`: Qwen3 is Llama plus q/k norm.

Phase 7 (tensor parallelism): the model is built for one rank of a `TensorParallel` group and
holds only that rank's slice of every matrix (linear.py, embedding.py); norms and RoPE tables are
replicated. Matrices that read the same input are stacked in one matmul, as vLLM does:
`qkv_proj` holds q_proj, k_proj and v_proj, `gate_up_proj` holds gate_proj and up_proj; the loader
maps the checkpoint's names onto them (`STACKED_PARAMS`). It is also built with a `KernelConfig`:
which fused and small-batch kernels its CUDA path runs (config.py); the torch path ignores it.

Invariants:
- `state_dict()` keys are the checkpoint keys (plus `lm_head.weight` when tied), with the stacked
  names in place of the tensors they stack;
- `forward(input_ids, positions, batch, kv_cache)` is phase 5's paged interface, unchanged: packed
  new tokens in, logits of the tokens to sample out, the whole vocabulary on every rank;
- with `tp.size == 1` nothing communicates, and no process group is needed;
- given `torch.manual_seed(s)`, `qk_norm=False` and one rank, the weights equal phase 0's
  TinyTransformer (same creation order), under HF names, with q/k/v and gate/up stacked.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import ForwardBatch
from .config import DEFAULT_KERNELS, KernelConfig
from .decoder import DecoderLayer
from .distributed import SINGLE_RANK, TensorParallel
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .kv_cache import KVCache
from .linear import kv_heads_per_rank
from .norm import RMSNorm
from .rope import RotaryEmbedding

# config.json `model_type` -> whether its attention has per-head q/k RMSNorm.
QK_NORM_BY_MODEL_TYPE = {"qwen3": True, "llama": False}
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
# Llama's default when a config names no theta.
DEFAULT_ROPE_THETA = 10000.0
# Checkpoint tensors stored stacked in one of our weights: (checkpoint name, ours, shard id).
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each KV head serves a whole group of query heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Map a Hugging Face config.json (a dict) to our field names; refuse what we can't run."""
        model_type = hf.get("model_type")
        if model_type not in QK_NORM_BY_MODEL_TYPE:
            name = ", ".join(hf.get("architectures") or []) or f"model_type {model_type!r}"
            raise ValueError(
                f"{name} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
                f"(model_type {' or '.join(QK_NORM_BY_MODEL_TYPE)})"
            )
        _check_no_unsupported_features(hf)
        hidden_size, num_heads = _require(hf, "hidden_size"), _require(hf, "num_attention_heads")
        return cls(
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=hidden_size,
            num_layers=_require(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,  # absent: plain MHA
            head_dim=hf.get("head_dim") or hidden_size // num_heads,
            intermediate_size=_require(hf, "intermediate_size"),
            max_position_embeddings=_require(hf, "max_position_embeddings"),
            rope_theta=float(_rope_theta(hf)),
            rms_norm_eps=float(_require(hf, "rms_norm_eps")),
            qk_norm=QK_NORM_BY_MODEL_TYPE[model_type],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def _require(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return hf[key]


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers >= 5 writes `rope_parameters: {rope_theta, ...}`; older configs `rope_theta`.
    params = hf.get("rope_parameters") or {}
    return hf.get("rope_theta") or params.get("rope_theta") or DEFAULT_ROPE_THETA


def _check_no_unsupported_features(hf: dict[str, Any]) -> None:
    """Variants that would load without error but compute something else must fail loudly."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    problems = {
        f"rope_type={rope_type!r} (only unscaled RoPE)": rope_type != "default",
        "attention_bias=true": bool(hf.get("attention_bias")),
        "mlp_bias=true": bool(hf.get("mlp_bias")),
        f"hidden_act={hf.get('hidden_act')!r} (only silu)": hf.get("hidden_act", "silu") != "silu",
        "use_sliding_window=true": bool(hf.get("use_sliding_window")),
    }
    found = [name for name, bad in problems.items() if bad]
    if found:
        raise ValueError(f"unsupported config.json settings: {', '.join(found)}")


class Qwen3Model(nn.Module):
    """The decoder stack (checkpoint keys `model.*`): token ids -> normalized hidden state."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, kernels: KernelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, i, tp, kernels) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """input_ids, positions: (N,) packed new tokens -> hidden states (N, C)."""
        x, residual = self.embed_tokens(input_ids), None  # (N, C)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, batch, kv_cache)
        return self.norm(x, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel = SINGLE_RANK,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        super().__init__()
        self.config = config
        self.tp = tp
        self.kernels = kernels
        self.model = Qwen3Model(config, tp, kernels)
        # Created even when tied, so the RNG stream (and thus random weights) match phase 0.
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, kernels)
        self.tie_weights()

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads this rank computes and caches (all of them without tensor parallelism)."""
        return kv_heads_per_rank(self.config.num_kv_heads, self.tp)

    def tie_weights(self) -> None:
        """A tied head IS the embedding table (the same rank's rows): one tensor, two names.
        Moving a model off the meta device (`to_empty`) makes new tensors per module, so the
        loader ties again."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """input_ids, positions: (N,) packed new tokens -> logits (R, vocab_size): one row per
        sequence that samples this step (its last new token; a mid-prompt chunk samples nothing)."""
        hidden = self.model(input_ids, positions, batch, kv_cache)  # (N, C)
        return self.compute_logits(hidden[batch.logits_indices])  # (R, V)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (R, C) of the rows that sample -> logits (R, vocab_size), on every rank."""
        return self.lm_head(hidden)
