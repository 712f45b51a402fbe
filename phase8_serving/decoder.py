"""One decoder layer: attention, then MLP, each wrapped in pre-norm and a residual.

Problem: deep stacks of transformations are hard to train and lose the input signal.
Idea: x + f(norm(x)). The residual stream carries the token's vector through the stack; each
sub-block reads a normalized copy and adds its contribution. Names match Hugging Face keys
(input_layernorm, self_attn, post_attention_layernorm, mlp).

Phase 7: every add of a sub-block's output to the stream is followed by a norm, so the add moves
into the norm (norm.py, vLLM's layout): a layer takes the previous sub-block's output and the
stream separately and returns its MLP's output and the stream, and the next norm adds them. The
same sums as `x + f(norm(x))`, in the same order; on CUDA one kernel each instead of two, and at
one or two rows none: each norm names the projection that reads it (`into`), whose GEMV adds and
normalizes as it loads.
"""

import torch
from torch import nn

from .attention import Attention, ForwardBatch
from .config import KernelConfig
from .distributed import TensorParallel
from .kv_cache import KVCache
from .mlp import MLP
from .norm import RMSNorm
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(
        self, config, rotary: RotaryEmbedding, layer_idx: int, tp: TensorParallel,
        kernels: KernelConfig,
    ):  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
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
            kernels,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, kernels)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (layer 0: the embeddings, with residual None) ->
        (this layer's MLP output, the residual stream it is to be added to)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:  # residual += x; h = norm(residual), or left to the layer `into` (norm.py)
            h, residual = self.input_layernorm(x, residual, into=self.self_attn.qkv_proj)
        h = self.self_attn(h, positions, batch, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual, into=self.mlp.gate_up_proj)
        return self.mlp(h), residual
