"""Triton attention kernels for the paged KV cache, and the pure-torch references they match.

- `store_kvcache`: write this step's new K/V into the paged cache through `slot_mapping`.
- `flash_attn_varlen_paged`: causal prefill of many packed sequences (FlashAttention-2), reading
  K/V through block tables, so a chunked or prefix-cached prefill sees its earlier context.
- `paged_decode_attention`: one query token per sequence, split-K over long contexts.
Both attention kernels run the same key loop (`attn_tiles`, online_softmax.py). Beside them:
fused element-wise kernels (fused.py), the small-batch GEMV (gemv.py), the sampler (sampling.py),
and Gated DeltaNet's (Qwen3.5's linear attention, state in per-sequence slots): the causal conv1d
with its state (causal_conv1d.py), the gated delta rule's decode step and chunked prefill
(gated_delta.py), the gated RMSNorm after it (gated_norm.py).

Cache layout (phase 5): per layer, K and V caches of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`; logical position p of a sequence lives at slot
`block_table[p // block_size] * block_size + p % block_size`. Importing defines things only; Triton
compiles each kernel on its first call.
"""

from .causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from .flash_prefill import flash_attn_varlen_paged
from .gated_delta import gated_delta_rule_decode, gated_delta_rule_prefill
from .gated_norm import gated_rms_norm
from .kv_store import PAD_SLOT_ID, store_kvcache
from .paged_decode import default_decode_config, paged_decode_attention
from .reference import (
    gather_kv,
    paged_decode_attention_ref,
    store_kvcache_ref,
    varlen_paged_attention_ref,
)

__all__ = [
    "PAD_SLOT_ID",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "default_decode_config",
    "flash_attn_varlen_paged",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "gated_rms_norm",
    "gather_kv",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "store_kvcache",
    "store_kvcache_ref",
    "varlen_paged_attention_ref",
]
