"""KV store: write this step's new K/V rows into the paged cache through `slot_mapping`.

Problem: the attention kernels read K/V from the paged cache, so every new token's key and value
must first be scattered to the physical slot its sequence's block table gives it. In torch this is
an index_put per cache (`k_cache.view(-1, H, D)[slot_mapping] = k`), which also needs the padded
slots filtered out first (a boolean mask, a nonzero, a host sync).

Idea: one program per new token reads its slot, returns at once if the slot is PAD_SLOT_ID
(padding added to fill a CUDA graph's fixed batch), and otherwise copies that token's
`[num_kv_heads, head_dim]` rows of K and V. Each byte of K/V is read once and written once.

Invariants:
- `slot_mapping[i]` is the flat slot (`block * block_size + offset`) of new token i, or
  PAD_SLOT_ID; valid slots are distinct, so programs never write the same row.
- Cache layout `[num_blocks, block_size, num_kv_heads, head_dim]` (phase 5); only the slot rows
  named in `slot_mapping` change.
- An fp8 cache (float8_e4m3fn) gets each value saturated to +-FP8_E4M3_MAX and rounded to nearest
  even, exactly what the torch path stores (`store_cast`).
"""

import torch
import triton
import triton.language as tl

# PAD_SLOT_ID: a padded row (kernels/__init__.py), nothing is written for it
from . import FP8_E4M3_MAX, PAD_SLOT_ID

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)  # a jit function reads only constexpr globals


@triton.jit
def store_cast(x, ptr):
    """x as `ptr`'s element type. For fp8 (e4m3: 3 mantissa bits, exponents -6..8, below that
    steps of 2^-9) the value is saturated and rounded to nearest even here, in fp32, so the cast
    itself is exact: a GPU's cast would round the same way, but Triton's CPU interpreter, which
    runs the tests, rounds ties up and loses the carry into the exponent (1.97 -> 1.0)."""
    if ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -_FP8_MAX), _FP8_MAX)
        exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        # the spacing of e4m3 values there, 2^(exponent - 3), and its inverse: powers of two, so
        # multiplying by them is exact (a division might not be: GPUs may divide approximately)
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        per_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)
        # |x * per_step| < 16: adding and taking away 1.5 * 2^23 leaves it rounded to an integer
        # (to nearest even, fp32's own rounding)
        x = ((x * per_step + 12582912.0) - 12582912.0) * step
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAD_SLOT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot == PAD_SLOT:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    k_dst = k_dst + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_dst + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, store_cast(k, k_dst), mask=mask)
    tl.store(v_dst, store_cast(v, v_dst), mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `k`, `v` (`[num_tokens, num_kv_heads, head_dim]`) into the caches in place.

    `slot_mapping` is int32 `[num_tokens]` (the engine's METADATA_DTYPE; int64 works too); entries
    equal to PAD_SLOT_ID are skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = k_cache.shape[1]
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (num_tokens,)
    assert head_dim == triton.next_power_of_2(head_dim), "tl.arange needs a power of two"
    # the last dim of every tensor is read as contiguous
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        PAD_SLOT=PAD_SLOT_ID,
    )
