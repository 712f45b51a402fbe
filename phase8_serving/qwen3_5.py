"""Qwen3.5: a hybrid model. Three of every four layers are Gated DeltaNet, one is gated attention.

Problem: attention's memory grows with the context (every past key and value is kept and read
again at every step). Linear attention keeps a fixed-size state instead, but recalls less
precisely. Qwen3.5 mixes both: `layer_types` lists `linear_attention` (Gated DeltaNet,
gated_delta.py: a recurrent state per sequence, in a `StatePool` slot) and `full_attention`
(softmax attention over the paged KV cache, every fourth layer by default), so only a quarter
of the layers keep KV blocks at all.
Idea: the same decoder skeleton as Qwen3 (pre-norm, residuals, SwiGLU MLP, names equal to the
checkpoint's keys), with Qwen3.5's differences:
- every RMSNorm scales by (1 + w) and multiplies in float32 (`OffsetRMSNorm`; the gains are stored
  as w - 1, zero at init);
- attention has an output gate: q_proj yields [q | gate] per head and the output is multiplied by
  sigmoid(gate) before o_proj; q/k RMSNorm; RoPE on the first `rotary_dim` of the head's 256
  dims only (partial rotary, theta 1e7; the multimodal RoPE of the published checkpoints reduces
  to this for text, where all three position ids are equal);
- a DeltaNet layer projects x to q/k/v (through a causal conv1d of width 4 and SiLU), to a gate z,
  and to a and b (the decay and write strength), runs the gated delta rule, normalizes each head's
  output with a gated RMSNorm (times SiLU(z)), and projects back.

Phase 7 (speed): on CUDA the DeltaNet layer runs Triton kernels (kernels/gated_delta.py,
kernels/causal_conv1d.py) that read and write each sequence's state in place by slot index, so a
decode step (the recurrence once per token) is captured in a CUDA graph like any other; padded
graph rows have slot PAD_SLOT_ID and touch no state. Prefill and mixed steps run the chunked
kernels over the packed batch. Matrices that read the same input are stacked (`in_proj` holds
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a; `gated_qkv_proj` q_proj, k_proj and v_proj),
the norms are phase 7's fused kernels with the (1 + w) gain added inside them, the gated
attention's q/k norms, partial RoPE and KV store one fused kernel and its output gate another,
attention the paged kernels (head_dim 256). One GPU only: tensor parallelism is not built for
this model.

Invariants:
- `state_dict()` keys are the text model's checkpoint keys (`Qwen3_5ForCausalLM`'s, the stacked
  names in place of what they stack; the loader maps `model.language_model.*` onto them);
- `forward(input_ids, positions, batch, kv_cache, state_pool)` is Qwen3's paged interface plus
  the state pool: attention layer j (j-th full-attention layer) uses KV cache layer j, DeltaNet
  layer j uses state pool layer j, and each sequence's state is its `batch.state_slots` row.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import ForwardBatch
from .config import DEFAULT_KERNELS, KernelConfig
from .distributed import SINGLE_RANK, TensorParallel
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .gated_delta import causal_conv1d, gated_delta_rule, gated_rms_norm, gating
from .kv_cache import KVCache
from .linear import ColumnParallelLinear, MergedColumnParallelLinear
from .mlp import MLP
from .model import _require  # config.json's required fields, one rule for both models
from .rope import RotaryEmbedding
from .state_pool import StatePool, StateShape

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # L, L, L, F when config.json lists no layer_types
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
# What a published (vision-language) checkpoint holds besides the text model: skipped on load.
TEXT_PREFIX, CHECKPOINT_TEXT_PREFIX = "model.", "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower, multi-token-prediction head
# Checkpoint tensors stored stacked in one of our weights: (checkpoint name, ours, shard id).
STACKED_PARAMS = (
    ("in_proj_qkv", "in_proj", 0),
    ("in_proj_z", "in_proj", 1),
    ("in_proj_b", "in_proj", 2),
    ("in_proj_a", "in_proj", 3),
    ("q_proj", "gated_qkv_proj", 0),
    ("k_proj", "gated_qkv_proj", 1),
    ("v_proj", "gated_qkv_proj", 2),
)


@dataclass(frozen=True)
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int  # full attention
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # RoPE rotates the first rotary_dim dims of each head
    linear_num_key_heads: int  # Gated DeltaNet
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    def __post_init__(self):
        unknown = [(i, t) for i, t in enumerate(self.layer_types) if t not in LAYER_TYPES]
        if unknown:
            i, t = unknown[0]
            raise ValueError(f"layer_types[{i}] is {t!r}; known layer types: {LAYER_TYPES}")
        if self.num_heads % self.num_kv_heads or self.linear_num_value_heads % (
            self.linear_num_key_heads
        ):
            raise ValueError("query heads must be a multiple of KV heads, value of key heads")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(FULL_ATTENTION)

    @property
    def num_deltanet_layers(self) -> int:
        return self.layer_types.count(LINEAR_ATTENTION)

    @property
    def state_shape(self) -> StateShape:
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        return StateShape(
            conv_channels=2 * key_dim + value_dim,
            conv_width=self.linear_conv_kernel_dim,
            num_heads=self.linear_num_value_heads,
            key_dim=self.linear_key_head_dim,
            value_dim=self.linear_value_head_dim,
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen3_5Config":
        """A text config.json (or a published checkpoint's `text_config`, merged by the loader)."""
        rope = hf.get("rope_parameters") or {}
        head_dim = _require(hf, "head_dim")
        factor = rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor")
        factor = DEFAULT_PARTIAL_ROTARY_FACTOR if factor is None else factor
        num_layers = _require(hf, "num_hidden_layers")
        interval = hf.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL
        layer_types = hf.get("layer_types") or [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)
        ]
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, not {num_layers}")
        return cls(
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=_require(hf, "hidden_size"),
            intermediate_size=_require(hf, "intermediate_size"),
            layer_types=tuple(layer_types),
            num_heads=_require(hf, "num_attention_heads"),
            num_kv_heads=_require(hf, "num_key_value_heads"),
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            linear_num_key_heads=_require(hf, "linear_num_key_heads"),
            linear_num_value_heads=_require(hf, "linear_num_value_heads"),
            linear_key_head_dim=_require(hf, "linear_key_head_dim"),
            linear_value_head_dim=_require(hf, "linear_value_head_dim"),
            linear_conv_kernel_dim=_require(hf, "linear_conv_kernel_dim"),
            max_position_embeddings=_require(hf, "max_position_embeddings"),
            rope_theta=float(rope.get("rope_theta") or _require(hf, "rope_theta")),
            rms_norm_eps=float(_require(hf, "rms_norm_eps")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


class OffsetRMSNorm(nn.Module):
    """RMSNorm with gain (1 + w), multiplied in float32 before rounding (vLLM's GemmaRMSNorm).
    Given the residual stream, it adds first, as norm.RMSNorm does: (norm(x + r), x + r). On
    CUDA phase 7's fused kernels run it, adding the 1 in fp32 themselves (`offset=True`): a gain
    computed in torch would be two more launches for each of the step's 61 norms."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if self.kernels.use_triton(x):
                from .kernels.fused import fused_add_rms_norm  # here: CPU-only installs

                pdl = self.kernels.programmatic_launch
                out = fused_add_rms_norm(x, residual, self.weight, self.eps, pdl, offset=True)
                return out, residual
            residual = x + residual
            return self.forward(residual), residual
        if self.kernels.use_triton(x):
            from .kernels.fused import rms_norm

            pdl = self.kernels.programmatic_launch
            return rms_norm(x, self.weight, self.eps, pdl, offset=True)
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Qwen3's paged GQA attention with an output gate and partial RoPE. On CUDA, as Qwen3's:
    q/k norm, RoPE (of the first rotary_dim dims) and the KV store are one kernel, the gate
    another (kernels/fused.py), where torch takes some forty small ones."""

    def __init__(self, config: Qwen3_5Config, rotary: RotaryEmbedding, kv_layer: int, kernels):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rotary_dim = c.rotary_dim
        q_size, kv_size = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.gated_qkv_proj = MergedColumnParallelLinear(
            c.hidden_size, (q_size, kv_size, kv_size), SINGLE_RANK, kernels=kernels
        )
        self.o_proj = ColumnParallelLinear(
            c.num_heads * c.head_dim, (c.hidden_size,), SINGLE_RANK, kernels=kernels
        )
        self.q_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps, kernels)
        self.k_norm = OffsetRMSNorm(c.head_dim, c.rms_norm_eps, kernels)
        self.rotary = rotary
        self.kv_layer = kv_layer  # which of the KV cache's layers this module reads and writes
        self.kernels = kernels

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rotated = self.rotary(x[..., : self.rotary_dim], positions)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)

    def forward(self, x, positions, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        N, H, D = x.shape[0], self.num_heads, self.head_dim
        q_gate, k, v = self.gated_qkv_proj(x).split(self.gated_qkv_proj.local_sizes, dim=-1)
        q, gate = q_gate.view(N, H, 2 * D).chunk(2, dim=-1)
        k = k.view(N, self.num_kv_heads, D)
        v = v.view(N, self.num_kv_heads, D)
        k_cache, v_cache = kv_cache.k[self.kv_layer], kv_cache.v[self.kv_layer]
        backend = kv_cache.attention_backend
        if self.kernels.use_triton(x):
            return self._kernels(q, gate, k, v, positions, batch, k_cache, v_cache, backend)
        q = self.rope(self.q_norm(q.contiguous()), positions)
        k = self.rope(self.k_norm(k), positions)
        backend.store(k, v, k_cache, v_cache, batch)
        out = backend.attend(q, k_cache, v_cache, batch, self.kernels)
        return self.o_proj(out.reshape(N, -1) * torch.sigmoid(gate.reshape(N, -1)))

    def _kernels(self, q, gate, k, v, positions, batch, k_cache, v_cache, backend):
        from .kernels.fused import (  # here: CPU-only installs may lack Triton
            qk_norm_rope,
            qk_norm_rope_store,
            sigmoid_gate_mul,
        )

        cos, sin, eps = self.rotary.cos, self.rotary.sin, self.q_norm.eps
        q_w, k_w, pdl = self.q_norm.weight, self.k_norm.weight, self.kernels.programmatic_launch
        if self.kernels.fuse_rope_kv_store:
            q = qk_norm_rope_store(q, k, v, q_w, k_w, cos, sin, positions, eps, k_cache, v_cache,
                                   batch.slot_mapping, pdl, offset=True)  # fmt: skip
        else:
            q = qk_norm_rope(q, q_w, cos, sin, positions, eps, offset=True)
            k = qk_norm_rope(k, k_w, cos, sin, positions, eps, offset=True)
            backend.store(k, v, k_cache, v_cache, batch)
        out = backend.attend(q, k_cache, v_cache, batch, self.kernels)
        return self.o_proj(sigmoid_gate_mul(out.reshape(q.shape[0], -1), gate, pdl))


class GatedRMSNorm(nn.Module):
    """Each head's output normalized, times its gain, times SiLU(gate) (gated_delta.py); one
    kernel on CUDA (kernels/gated_norm.py)."""

    def __init__(self, head_dim: int, eps: float, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.kernels = kernels

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.kernels.use_triton(x):
            from .kernels import gated_norm  # here: CPU-only installs may lack Triton

            pdl = self.kernels.programmatic_launch
            return gated_norm.gated_rms_norm(x, gate, self.weight, self.eps, pdl)
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; its memory is the sequence's state slot."""

    def __init__(self, config: Qwen3_5Config, state_layer: int, kernels: KernelConfig):
        super().__init__()
        c, shape = config, config.state_shape
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        sizes = (shape.conv_channels, self.value_dim, self.num_v_heads, self.num_v_heads)
        self.in_proj = MergedColumnParallelLinear(
            c.hidden_size, sizes, SINGLE_RANK, kernels=kernels
        )
        channels, width = shape.conv_channels, shape.conv_width  # depthwise: one filter a channel
        self.conv1d = nn.Conv1d(channels, channels, width, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps, kernels)
        self.out_proj = ColumnParallelLinear(
            self.value_dim, (c.hidden_size,), SINGLE_RANK, kernels=kernels
        )
        self.state_layer = state_layer  # which of the state pool's layers this module owns
        self.kernels = kernels

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state_pool: StatePool):
        N = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.in_proj.local_sizes, dim=-1)
        conv_state = state_pool.conv[self.state_layer]
        recurrent_state = state_pool.recurrent[self.state_layer]
        weight = self.conv1d.weight[:, 0]  # (C, W)
        if self.kernels.use_triton(x):
            o = self._kernels(qkv, b, a, conv_state, weight, recurrent_state, batch)
        else:  # the readable path (gated_delta.py), one sequence at a time
            starts, slots = batch.query_start_loc.tolist(), batch.state_slots.tolist()
            qkv = causal_conv1d(qkv, conv_state, weight, starts, slots)
            q, k, v = self._heads(qkv)
            g, beta = gating(a, b, self.A_log, self.dt_bias)
            o = gated_delta_rule(q, k, v, g, beta, recurrent_state, starts, slots).to(x.dtype)
        z = z.reshape(N, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).reshape(N, -1))

    def _heads(self, qkv: torch.Tensor):
        N = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.view(N, self.num_k_heads, self.head_k_dim),
            k.view(N, self.num_k_heads, self.head_k_dim),
            v.view(N, self.num_v_heads, self.head_v_dim),
        )

    def _kernels(self, qkv, b, a, conv_state, weight, recurrent_state, batch: ForwardBatch):
        """Decode steps (CUDA graphs) take the one-token kernels, others the chunked ones."""
        from . import kernels  # here: CPU-only installs may lack Triton

        slots, pdl = batch.state_slots, self.kernels.programmatic_launch  # a, b: strided views
        if batch.max_query_len == 1:
            qkv = kernels.causal_conv1d_update(qkv, conv_state, weight, slots, pdl)
            q, k, v = self._heads(qkv)
            return kernels.gated_delta_rule_decode(
                q, k, v, a, b, self.A_log, self.dt_bias, recurrent_state, slots, pdl
            )
        qkv = kernels.causal_conv1d_varlen(
            qkv, conv_state, weight, batch.query_start_loc, slots, batch.max_query_len
        )
        q, k, v = self._heads(qkv)
        return kernels.gated_delta_rule_prefill(
            q, k, v, a, b, self.A_log, self.dt_bias, recurrent_state, batch.query_start_loc, slots
        )


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual layer whose token mixer is DeltaNet (`linear_attn`) or attention
    (`self_attn`), as the checkpoint names them; the residual add moves into the next norm, as
    in decoder.py."""

    def __init__(self, config: Qwen3_5Config, rotary, index: int, cache_layer: int, kernels):
        super().__init__()
        c = config
        self.layer_type = c.layer_types[index]
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(c, cache_layer, kernels)
        else:
            self.self_attn = GatedAttention(c, rotary, cache_layer, kernels)
        self.input_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps, kernels)
        self.post_attention_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps, kernels)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, SINGLE_RANK, kernels)

    def forward(self, x, residual, positions, batch, kv_cache, state_pool):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)  # residual += x; h = norm(residual)
        if self.layer_type == LINEAR_ATTENTION:
            h = self.linear_attn(h, batch, state_pool)
        else:
            h = self.self_attn(h, positions, batch, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config: Qwen3_5Config, kernels: KernelConfig):
        super().__init__()
        c = config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, SINGLE_RANK)
        rotary = RotaryEmbedding(c.rotary_dim, c.max_position_embeddings, c.rope_theta)
        # Each kind counts its own layers: the j-th attention layer is KV cache layer j.
        ordinals = [c.layer_types[:i].count(t) for i, t in enumerate(c.layer_types)]
        self.layers = nn.ModuleList(
            HybridDecoderLayer(c, rotary, i, ordinals[i], kernels) for i in range(c.num_layers)
        )
        self.norm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps, kernels)

    def forward(self, input_ids, positions, batch, kv_cache, state_pool) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (N, C)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, batch, kv_cache, state_pool)
        return self.norm(x, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(
        self,
        config: Qwen3_5Config,
        tp: TensorParallel = SINGLE_RANK,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        super().__init__()
        if tp.size > 1:
            raise ValueError(
                "Qwen3.5 runs on one GPU here: tensor parallelism is not built for its DeltaNet "
                "layers (tensor_parallel_size must be 1)"
            )
        self.config = config
        self.tp = tp
        self.kernels = kernels
        self.model = Qwen3_5Model(config, kernels)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, kernels)
        self.tie_weights()

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.config.num_kv_heads

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
        state_pool: StatePool,
    ) -> torch.Tensor:
        """input_ids, positions: (N,) packed new tokens -> logits (R, vocab_size) of the rows that
        sample; every sequence's DeltaNet state advances in its slot by its new tokens."""
        hidden = self.model(input_ids, positions, batch, kv_cache, state_pool)
        return self.compute_logits(hidden[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def checkpoint_key(key: str) -> str | None:
    """A published checkpoint's tensor name -> ours (None: not part of the text model)."""
    if key.startswith(SKIPPED_PREFIXES):
        return None
    if key.startswith(CHECKPOINT_TEXT_PREFIX):
        return TEXT_PREFIX + key[len(CHECKPOINT_TEXT_PREFIX) :]
    return key


def is_hybrid(config: object) -> bool:
    """Whether a model has a state pool beside its KV cache."""
    return isinstance(config, Qwen3_5Config)
