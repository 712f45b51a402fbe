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
`block_table[p // block_size] * block_size + p % block_size`. The caches hold the model's dtype
or fp8 (`kv_cache_dtype="fp8"`, kv_cache.py): writers round through `store_cast` (kv_store.py),
readers widen each tile in `attn_tiles`.

This package is a leaf: it imports nothing of the engine, which imports it. `PAD_SLOT_ID` and
`FP8_E4M3_MAX`, the values both sides share, are defined here, and importing the package needs no
Triton: each name below is imported from its module (Triton with it) on first use (a module
`__getattr__`, PEP 562).
So an engine module takes `PAD_SLOT_ID` from here at its top, and a kernel only inside the
function that calls it: CPU-only installs may lack Triton. Triton compiles each kernel on its
first call.
"""

import importlib
import typing

# A slot_mapping (or state slot) entry that names no slot: a padded row, used only to fill a CUDA
# graph's fixed batch. Every kernel that takes slots skips it: nothing is written or read for it.
PAD_SLOT_ID = -1
# An fp8 KV cache (`kv_cache_dtype="fp8"`) holds float8_e4m3fn: writers saturate to this, its
# largest finite value (a plain cast would turn anything larger into NaN: e4m3fn has no inf).
FP8_E4M3_MAX = 448.0

# public name -> the module of this package that defines it
_EXPORTS = {
    "causal_conv1d_update": "causal_conv1d",
    "causal_conv1d_varlen": "causal_conv1d",
    "default_decode_config": "paged_decode",
    "flash_attn_varlen_paged": "flash_prefill",
    "gated_delta_rule_decode": "gated_delta",
    "gated_delta_rule_prefill": "gated_delta",
    "gated_rms_norm": "gated_norm",
    "gather_kv": "reference",
    "paged_decode_attention": "paged_decode",
    "paged_decode_attention_ref": "reference",
    "store_kvcache": "kv_store",
    "store_kvcache_ref": "reference",
    "varlen_paged_attention_ref": "reference",
}
__all__ = ["FP8_E4M3_MAX", "PAD_SLOT_ID", *_EXPORTS]


def __getattr__(name: str) -> typing.Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later look-ups (the backends', once per layer) skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
