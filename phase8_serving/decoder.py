"""One decoder layer: attention, then MLP, each wrapped in pre-norm and a residual.

Problem: deep stacks of transformations are hard to train and lose the input signal.
Idea: x + f(norm(x)). The residual stream carries the token's vector through the stack; each
sub-block reads a normalized copy and adds its contribution. Names match Hugging Face keys
(input_layernorm, self_attn, post_attention_layernorm, mlp).
"""

import torch
from torch import nn

from .attention import Attention, ForwardBatch
from .distributed import TensorParallel
from .kv_cache import KVCache
from .mlp import MLP
from .norm import RMSNorm
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            rotary,
            layer_idx,
            config.qk_norm,
            config.rms_norm_eps,
            tp,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))
