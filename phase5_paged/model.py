"""TinyTransformer: a complete decoder-only language model, small enough for 2 CPU cores.

Problem: the pieces (embedding, attention, MLP, norms) are not yet a model.
Idea: embed tokens, run them through a stack of decoder layers, normalize, and project back to the
vocabulary to get next-token logits. The architecture is Llama's (pre-norm, RoPE, GQA, SwiGLU), so
phase 6 swaps random weights for real checkpoints without changing the shape of the code.

Invariants:
- Given `torch.manual_seed(s)`, `TinyTransformer(config)` builds identical weights in phases 0-5
  (modules are created in the same order) under the same state-dict keys, so weights move between
  them with `load_state_dict`; phase 6 keeps the creation order under Hugging Face's names.
- The logits of a token depend only on the tokens of its own sequence at positions up to its own:
  causal, and the sequences packed into one step never see each other.

Phase 3: `forward` also takes explicit positions, a KV cache and a padding mask, so a prompt is
prefilled once and each decode step feeds only the new tokens.

Phase 4: the batch is flattened. `forward` takes the new tokens of many sequences packed into one
(N,) vector and a `ForwardBatch` describing them, and returns logits only where a token will be
sampled: the LM head is the largest matmul of a small model.
"""

from dataclasses import dataclass

import torch
from torch import nn

from .attention import ForwardBatch
from .decoder import DecoderLayer
from .embedding import Embedding
from .kv_cache import KVCache
from .norm import RMSNorm
from .rope import RotaryEmbedding


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


class TinyTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """input_ids, positions: (N,) packed new tokens -> logits (R, vocab_size): one row per
        sequence that samples this step (its last new token; a mid-prompt chunk samples nothing)."""
        x = self.embed_tokens(input_ids)  # (N, C)
        for layer in self.layers:
            x = layer(x, positions, batch, kv_cache)
        return self.lm_head(self.norm(x[batch.logits_indices]))  # (R, V)
