"""Fused kernels (kernels/fused.py) against the torch modules they replace on CUDA: RMSNorm (alone
and after the residual add), SiLU-and-multiply, per-head q/k RMSNorm + RoPE (alone and with the
KV-cache store). CPU: Triton interpreter in float32 (and float16 where rounding is the point); GPU:
bf16 against the float32 modules, by relative error (as in test_kernels.py)."""

import inspect
import os
import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim.kernels import PAD_SLOT_ID, fused, paged_decode, store_kvcache_ref  # noqa: E402
from phase7_optim.kernels.fused import (  # noqa: E402
    fused_add_rms_norm,
    qk_norm_rope,
    qk_norm_rope_store,
    rms_norm,
    silu_and_mul,
)
from phase7_optim.norm import RMSNorm  # noqa: E402
from phase7_optim.rope import RotaryEmbedding  # noqa: E402

from .test_kernels import relative_error  # noqa: E402

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)
EPS = 1e-6


def random_norm(size: int) -> RMSNorm:
    norm = RMSNorm(size, EPS)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not ones: a gain applied in the wrong place shows
    return norm


def torch_norm_rope(x, norm, rotary, positions):
    return rotary(norm(x) if norm is not None else x, positions)


@interpreter
@pytest.mark.parametrize("shape", [(5, 64), (3, 576), (2, 3, 40)])  # 576, 40: masked columns
def test_rms_norm_matches_module(shape):
    torch.manual_seed(0)
    norm = random_norm(shape[-1])
    x = torch.randn(shape) * 3
    torch.testing.assert_close(rms_norm(x, norm.weight, EPS), norm(x), atol=1e-5, rtol=1e-5)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_cols", [64, 576])  # 576: masked columns
def test_fused_add_rms_norm_is_the_add_then_the_norm(dtype, n_cols):
    """residual <- x + residual exactly as torch's add rounds it (in place); the output is the
    norm of that rounded sum, as the unfused pair computes it."""
    torch.manual_seed(4)
    norm = random_norm(n_cols)
    x, residual = (torch.randn(5, n_cols) * 3).to(dtype), (torch.randn(5, n_cols) * 3).to(dtype)
    expected_residual = x + residual
    expected = norm(expected_residual.float()).to(dtype)
    out = fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(residual, expected_residual)  # updated in place, bit for bit
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, expected, **tolerance)
    # the norm of the rounded sum, exactly as the unfused kernels compute it
    assert torch.equal(out, rms_norm(expected_residual, norm.weight, EPS))


@interpreter
def test_rms_norm_module_with_a_residual_fused_or_not():
    """RMSNorm(x, residual) returns (norm(x + residual), x + residual) on both paths."""
    from phase7_optim.config import KernelConfig

    torch.manual_seed(5)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    torch_path = random_norm(64)
    fused = RMSNorm(64, EPS, KernelConfig(interpret_on_cpu=True))
    fused.load_state_dict(torch_path.state_dict())
    out, stream = torch_path(x, residual.clone())
    fused_out, fused_stream = fused(x, residual.clone())
    assert torch.equal(fused_stream, stream)
    torch.testing.assert_close(fused_out, out, atol=1e-5, rtol=1e-5)


@interpreter
@pytest.mark.parametrize("n_cols", [40, 1536])  # 1536: two column blocks, the second masked
def test_silu_and_mul_matches_torch(n_cols):
    torch.manual_seed(1)
    x = torch.randn(7, 2 * n_cols)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@interpreter
@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3, Llama
def test_qk_norm_rope_on_strided_heads_matches_modules(qk_norm):
    """q and k are views into one qkv row, as in attention.py; positions are arbitrary."""
    torch.manual_seed(2)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 100, 1e6)
    positions = torch.tensor([0, 1, 7, 50, 99, 3])
    for x in (q, k):
        norm = random_norm(head_dim) if qk_norm else None
        weight = norm.weight if qk_norm else None
        out = qk_norm_rope(x, weight, rotary.cos, rotary.sin, positions, EPS)
        expected = torch_norm_rope(x, norm, rotary, positions)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def qkv_views(tokens, heads, kv_heads, head_dim, dtype=torch.float32):
    """q, k, v as views into one fused qkv projection output, as attention.py makes them."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


@interpreter
@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3, Llama (no q/k norm)
def test_qk_norm_rope_store_is_norm_rope_then_store(qk_norm):
    """One launch: q comes back normed and rotated, k (normed, rotated) and v land in the paged
    cache at their slots, padded slots write nowhere, every other slot keeps its junk."""
    torch.manual_seed(6)
    tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 32, 4
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 100, 1e6)
    positions = torch.tensor([0, 1, 7, 50, 99, 3])
    slot_mapping = torch.tensor([5, PAD_SLOT_ID, 0, 23, PAD_SLOT_ID, 9], dtype=torch.int32)
    q_norm, k_norm = (random_norm(head_dim), random_norm(head_dim)) if qk_norm else (None, None)
    k_cache = torch.randn(6, block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    out = qk_norm_rope_store(
        q, k, v, q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None,
        rotary.cos, rotary.sin, positions, EPS, k_cache, v_cache, slot_mapping,
    )  # fmt: skip
    torch.testing.assert_close(out, torch_norm_rope(q, q_norm, rotary, positions),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    k_rotated = torch_norm_rope(k, k_norm, rotary, positions)
    store_kvcache_ref(k_rotated, v.contiguous(), k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache, v_ref)  # a copy is exact, and the junk around it untouched


PDL_KERNELS = [
    fused._rms_norm_kernel, fused._fused_add_rms_norm_kernel, fused._silu_and_mul_kernel,
    fused._qk_norm_rope_store_kernel, fused._sigmoid_gate_mul_kernel,
    paged_decode._paged_decode_split_kernel,
    paged_decode._paged_decode_reduce_kernel,
]  # fmt: skip


# What a kernel may read before its wait: what no kernel of the step writes (kernels/pdl.py)
READ_BEFORE_WAIT = {
    "_qk_norm_rope_store_kernel": {"positions_ptr", "cos_ptr", "sin_ptr", "slot_mapping_ptr"},
    # the step's inputs, and with early_loads its first tile's keys before the newest
    "_paged_decode_split_kernel": {
        "order_ptr", "seq_lens_ptr", "block_table_ptr", "k_ptrs", "v_ptrs",
    },
}  # fmt: skip


@pytest.mark.parametrize("kernel", PDL_KERNELS, ids=lambda k: k.fn.__name__)
def test_pdl_kernels_touch_no_memory_before_they_wait(kernel):
    """Launched with programmatic dependent launch, these kernels start while the kernel before
    them still writes their inputs (kernels/pdl.py): nothing is stored before the wait, which
    every program reaches (no return above it), and only READ_BEFORE_WAIT's pointers are loaded
    (the text up to the last wait: decode attention waits in one of two places)."""
    name = kernel.fn.__name__
    before, wait, _ = inspect.getsource(kernel.fn).rpartition("wait_for_previous(PDL)")
    assert wait, f"{name} never waits for the kernel before it"
    for memory_op in ("tl.store", "tl.atomic", "return"):
        assert memory_op not in before, f"{name}: {memory_op} before the wait"
    loaded = set(re.findall(r"tl\.load\(\s*(\w+)", before))
    assert loaded <= READ_BEFORE_WAIT.get(name, set()), f"{name} loads {loaded} before the wait"


@pytest.mark.gpu
def test_gpu_fused_kernels_in_bf16():
    """The references run on CPU: on CUDA the modules themselves call these kernels."""
    torch.manual_seed(3)
    gpu = lambda t: t.cuda().bfloat16()  # noqa: E731
    norm = random_norm(1024)
    x = torch.randn(300, 1024) * 3
    assert relative_error(rms_norm(gpu(x), gpu(norm.weight), EPS).cpu(), norm(x)) < 1e-2
    x = torch.randn(300, 2 * 3072)
    gate, up = x.chunk(2, dim=-1)
    assert relative_error(silu_and_mul(gpu(x)).cpu(), F.silu(gate) * up) < 1e-2
    rotary = RotaryEmbedding(128, 40960, 1e6)
    positions = torch.randint(0, 40960, (300,))
    head_norm = random_norm(128)
    x = torch.randn(300, 16, 128)
    out = qk_norm_rope(gpu(x), gpu(head_norm.weight), rotary.cos.cuda(), rotary.sin.cuda(),
                       positions.cuda(), EPS)  # fmt: skip
    assert relative_error(out.cpu(), torch_norm_rope(x, head_norm, rotary, positions)) < 1e-2
    x, residual = torch.randn(300, 1024) * 3, torch.randn(300, 1024) * 3
    stream = gpu(residual)
    out = fused_add_rms_norm(gpu(x), stream, gpu(norm.weight), EPS)
    assert torch.equal(stream, gpu(x) + gpu(residual))
    assert relative_error(out.cpu(), norm(x + residual)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [True, False])
def test_gpu_qk_norm_rope_store_in_bf16(qk_norm):
    """Qwen3-0.6B's heads: 16 q, 8 KV, head_dim 128; block size 16; a third of the slots padded."""
    torch.manual_seed(7)
    tokens, heads, kv_heads, head_dim = 300, 16, 8, 128
    q, k, v = (t.cuda() for t in qkv_views(tokens, heads, kv_heads, head_dim, torch.bfloat16))
    rotary = RotaryEmbedding(head_dim, 40960, 1e6)
    positions = torch.randint(0, 40960, (tokens,), device="cuda")
    slot_mapping = torch.randperm(40 * 16, device="cuda")[:tokens].int()
    slot_mapping[::3] = PAD_SLOT_ID
    norms = [random_norm(head_dim) for _ in range(2)] if qk_norm else [None, None]
    weights = [gpu_weight(n) for n in norms]
    k_cache = torch.randn(40, 16, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    cos, sin = rotary.cos.cuda(), rotary.sin.cuda()
    out = qk_norm_rope_store(q, k, v, *weights, cos, sin, positions, EPS, k_cache, v_cache,
                             slot_mapping)  # fmt: skip
    expected_q = qk_norm_rope(q, weights[0], cos, sin, positions, EPS)
    assert torch.equal(out, expected_q)  # the same arithmetic as the unfused kernel
    k_rotated = qk_norm_rope(k, weights[1], cos, sin, positions, EPS)
    store_kvcache_ref(k_rotated, v.contiguous(), k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def gpu_weight(norm):
    return None if norm is None else norm.weight.detach().cuda().bfloat16()
