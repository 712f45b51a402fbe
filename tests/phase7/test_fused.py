"""Fused kernels (kernels/fused.py) against the torch modules they replace on CUDA: RMSNorm,
SiLU-and-multiply, per-head q/k RMSNorm + RoPE. CPU: Triton interpreter in float32; GPU: bf16
against the float32 modules, by relative error (as in test_kernels.py)."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim.kernels.fused import qk_norm_rope, rms_norm, silu_and_mul  # noqa: E402
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
