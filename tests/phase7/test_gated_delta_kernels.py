"""Gated DeltaNet kernels (kernels/causal_conv1d.py, gated_delta.py, gated_norm.py) against the
readable torch they replace (phase7_optim/gated_delta.py).

Every state-pool test fills the pool with junk and compares the whole pool after the kernel with
the reference's: only the named slots may change, PAD_SLOT_ID rows change nothing. CPU: Triton
interpreter in fp32 (its bf16 tl.dot is wrong), small heads (d_k 16, d_v 32), H_k 2 serving H_v 4
(head repetition); lengths around the conv width (1, 2, 3) and the chunk size (63, 64, 65, 130).
GPU (`-m gpu`): bf16 at Qwen3.5-0.8B's shapes against the fp32 reference, by relative error.
"""

import inspect
import itertools
import os

import pytest
import torch

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim import gated_delta as ref  # noqa: E402
from phase7_optim.kernels import (  # noqa: E402
    PAD_SLOT_ID,
    causal_conv1d,
    causal_conv1d_update,
    causal_conv1d_varlen,
    gated_delta,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    gated_norm,
    gated_rms_norm,
)

from .test_kernels import relative_error  # noqa: E402

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)
FP32 = dict(atol=2e-5, rtol=2e-5)  # the interpreter's fp32 against the fp32 reference
BF16_REL_ERROR = 2e-2  # GPU bf16 against the fp32 reference, ‖out - ref‖ / ‖ref‖
WIDTH = 4  # Qwen3.5's conv kernel size
NUM_SLOTS = 9


def packed(lengths: list[int]) -> list[int]:
    """Sequence lengths -> query_start_loc."""
    return [0, *itertools.accumulate(lengths)]


def int32(values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---- causal conv1d -----------------------------------------------------------------------------


def conv_inputs(num_tokens, channels, dtype=torch.float32, device="cpu"):
    """x as a strided view (every other row of a wider buffer, as a projection's slice), a pool
    of junk conv states, a weight."""
    x = torch.randn(num_tokens, 2 * channels, device=device).to(dtype)[:, :channels]
    conv_state = torch.randn(NUM_SLOTS, channels, WIDTH - 1, device=device).to(dtype)
    return x, conv_state, torch.randn(channels, WIDTH, device=device).to(dtype)


CONV_BATCHES = {
    "short": [2, 1, 3],  # shorter than W - 1: the new state reaches into the old one
    "long": [65, 1, 130, 2],  # several token blocks per sequence
}


@interpreter
@pytest.mark.parametrize("batch", CONV_BATCHES)
def test_conv1d_varlen_matches_reference(batch):
    torch.manual_seed(0)
    lengths = CONV_BATCHES[batch]
    x, conv_state, weight = conv_inputs(sum(lengths), 40)  # 40 channels: masked lanes
    slots = [7, 0, 4, 2][: len(lengths)]
    expected_state = conv_state.clone()
    expected = ref.causal_conv1d(x, expected_state, weight, packed(lengths), slots)
    out = causal_conv1d_varlen(x, conv_state, weight, int32(packed(lengths)), int32(slots))
    torch.testing.assert_close(out, expected, **FP32)
    assert torch.equal(conv_state, expected_state)  # a copy of inputs: exact, the rest untouched


@interpreter
def test_conv1d_update_is_a_one_token_sequence_and_pad_rows_touch_nothing():
    torch.manual_seed(1)
    x, conv_state, weight = conv_inputs(5, 40)
    slots = [3, PAD_SLOT_ID, 8, 0, PAD_SLOT_ID]
    live = [i for i, s in enumerate(slots) if s != PAD_SLOT_ID]
    expected_state = conv_state.clone()
    expected = ref.causal_conv1d(
        x[live], expected_state, weight, list(range(len(live) + 1)), [slots[i] for i in live]
    )
    out = causal_conv1d_update(x, conv_state, weight, int32(slots))
    torch.testing.assert_close(out[live], expected, **FP32)
    assert torch.equal(conv_state, expected_state)


# ---- the gated delta rule ----------------------------------------------------------------------

H_K, H_V, D_K, D_V = 2, 4, 16, 32


def rule_inputs(num_tokens, h_k=H_K, h_v=H_V, d_k=D_K, d_v=D_V, dtype=torch.float32,
                device="cpu", strong_decay=False):  # fmt: skip
    """q, k, v as views into one projection row (strided, as the model slices them), raw gate
    projections a, b, the layer's A_log and dt_bias, and a pool of junk states."""
    widths = [h_k * d_k, h_k * d_k, h_v * d_v]
    qkv = torch.randn(num_tokens, sum(widths), device=device).to(dtype)
    q, k, v = qkv.split(widths, dim=-1)
    q, k, v = q.view(-1, h_k, d_k), k.view(-1, h_k, d_k), v.view(-1, h_v, d_v)
    a = (torch.randn(num_tokens, h_v, device=device) * 2 + (30 if strong_decay else 0)).to(dtype)
    b = torch.randn(num_tokens, h_v, device=device).to(dtype)
    A_log = torch.rand(h_v, device=device).log()  # Qwen3.5 initializes A in (0, 16)
    dt_bias = torch.randn(h_v, device=device)
    state = torch.randn(NUM_SLOTS, h_v, d_k, d_v, device=device) * 0.5
    return q, k, v, a, b, A_log, dt_bias, state


def reference_rule(q, k, v, a, b, A_log, dt_bias, state, query_start_loc, slots):
    g, beta = ref.gating(a, b, A_log, dt_bias)
    return ref.gated_delta_rule(q, k, v, g, beta, state, query_start_loc, slots)


@interpreter
@pytest.mark.parametrize("h_k", [H_K, H_V])  # head repetition 2, and none
def test_decode_matches_reference_and_pad_rows_touch_nothing(h_k):
    torch.manual_seed(2)
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(6, h_k=h_k)
    slots = [5, PAD_SLOT_ID, 0, 8, PAD_SLOT_ID, 2]
    live = [i for i, s in enumerate(slots) if s != PAD_SLOT_ID]
    expected_state = state.clone()
    expected = reference_rule(
        q[live], k[live], v[live], a[live], b[live], A_log, dt_bias, expected_state,
        list(range(len(live) + 1)), [slots[i] for i in live],
    )  # fmt: skip
    out = gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, state, int32(slots))
    assert out.dtype == v.dtype
    torch.testing.assert_close(out[live], expected, **FP32)
    torch.testing.assert_close(state, expected_state, **FP32)
    assert torch.equal(state[[1, 3, 4, 6, 7]], expected_state[[1, 3, 4, 6, 7]])  # untouched


@interpreter
@pytest.mark.parametrize("strong_decay", [False, True], ids=["decay", "strong-decay"])
def test_prefill_matches_reference_on_a_ragged_batch(strong_decay):
    """One token (a decode inside a mixed step), shorter than W - 1, and around the chunk size;
    strong decay: gamma falls by ~ 30 a token, so exp(gamma_i - gamma_j) for j > i would be
    inf if the kernel did not mask it before the exp."""
    torch.manual_seed(3)
    lengths, slots = [1, 3, 63, 64, 65, 130], [4, 0, 8, 2, 6, 1]
    inputs = rule_inputs(sum(lengths), strong_decay=strong_decay)
    *tensors, state = inputs
    expected_state = state.clone()
    expected = reference_rule(*tensors, expected_state, packed(lengths), slots)
    out = gated_delta_rule_prefill(*tensors, state, int32(packed(lengths)), int32(slots))
    torch.testing.assert_close(out, expected, **FP32)
    torch.testing.assert_close(state, expected_state, **FP32)
    assert torch.equal(state[[3, 5, 7]], expected_state[[3, 5, 7]])  # slots no one named


@interpreter
def test_prefill_split_at_every_chunk_boundary_equals_one_pass():
    """130 tokens in one pass, and as pieces 64 + 64 + 2 (each piece continuing from the state
    the one before left in the slot) and 63 + 2 + 65: the same outputs and final state."""
    torch.manual_seed(4)
    *tensors, state = rule_inputs(130)
    one_pass_state = state.clone()
    one_pass = gated_delta_rule_prefill(*tensors, one_pass_state, int32([0, 130]), int32([3]))
    for pieces in ([64, 64, 2], [63, 2, 65]):
        pieces_state, outs = state.clone(), []
        for start, end in itertools.pairwise(packed(pieces)):
            q, k, v, a, b = (t[start:end] for t in tensors[:5])
            args = (q, k, v, a, b, *tensors[5:], pieces_state)
            outs.append(gated_delta_rule_prefill(*args, int32([0, end - start]), int32([3])))
        torch.testing.assert_close(torch.cat(outs), one_pass, **FP32)
        torch.testing.assert_close(pieces_state, one_pass_state, **FP32)


@interpreter
def test_prefill_of_a_pad_sequence_starts_from_zero_and_writes_no_state():
    torch.manual_seed(5)
    lengths = [5, 3]
    *tensors, state = rule_inputs(sum(lengths))
    expected_state = state.clone()
    expected = reference_rule(*tensors, expected_state, packed(lengths), [0, 2])
    zero_start = reference_rule(
        *(t[:5] for t in tensors[:5]), *tensors[5:], torch.zeros_like(state[:1]), [0, 5], [0]
    )  # fmt: skip
    before = state.clone()
    out = gated_delta_rule_prefill(*tensors, state, int32(packed(lengths)), int32([-1, 2]))
    assert PAD_SLOT_ID == -1
    torch.testing.assert_close(out[:5], zero_start, **FP32)
    torch.testing.assert_close(out[5:], expected[5:], **FP32)
    torch.testing.assert_close(state[2], expected_state[2], **FP32)
    assert torch.equal(state[[0, 1, *range(3, NUM_SLOTS)]], before[[0, 1, *range(3, NUM_SLOTS)]])


# ---- gated RMSNorm -----------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm_matches_reference(dtype):
    """x (N, H_v, d_v) and the gate z a view into a wider projection row, d_v 40: masked
    columns; 5 x 4 rows: a partial row block."""
    torch.manual_seed(6)
    x = (torch.randn(5, 4, 40) * 3).to(dtype)
    gate = torch.randn(5, 4 * 40 + 8).to(dtype)[:, :160].view(5, 4, 40)
    weight = torch.empty(40).uniform_(0.5, 1.5).to(dtype)  # not ones: a misplaced gain shows
    expected = ref.gated_rms_norm(x, gate, weight, 1e-6)
    tolerance = FP32 if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(gated_rms_norm(x, gate, weight, 1e-6), expected, **tolerance)


PDL_KERNELS = [
    causal_conv1d._causal_conv1d_update_kernel, gated_delta._decode_kernel,
    gated_norm._gated_rms_norm_kernel,
]  # fmt: skip


@pytest.mark.parametrize("kernel", PDL_KERNELS, ids=lambda k: k.fn.__name__)
def test_pdl_kernels_touch_no_memory_before_they_wait(kernel):
    """As test_fused.py's: the decode-step kernels launch with PDL (kernels/pdl.py), so nothing
    may be loaded, stored or returned before the wait."""
    before, wait, _ = inspect.getsource(kernel.fn).partition("wait_for_previous(PDL)")
    assert wait, f"{kernel.fn.__name__} never waits for the kernel before it"
    for memory_op in ("tl.load", "tl.store", "tl.atomic", "return", "_conv_tile"):
        assert memory_op not in before, f"{kernel.fn.__name__}: {memory_op} before the wait"


# ---- GPU: bf16 at Qwen3.5-0.8B's shapes --------------------------------------------------------

CONV_CHANNELS = 2 * 16 * 128 + 16 * 128  # q, k, v of 16 key and 16 value heads of 128


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(actual).all()
    error = relative_error(actual.float(), expected.float())
    assert error < BF16_REL_ERROR, f"relative error {error:.2e}"


@pytest.mark.gpu
def test_gpu_conv1d_in_bf16():
    torch.manual_seed(7)
    lengths = [1, 2, 700, 64, 3000]
    x, conv_state, weight = conv_inputs(sum(lengths), CONV_CHANNELS, torch.bfloat16, "cuda")
    slots = [8, 0, 3, 5, 1]
    expected_state = conv_state.float()
    expected = ref.causal_conv1d(x.float(), expected_state, weight.float(), packed(lengths), slots)
    qsl = int32(packed(lengths), "cuda")
    out = causal_conv1d_varlen(x, conv_state, weight, qsl, int32(slots, "cuda"))
    assert_close_bf16(out, expected)
    assert torch.equal(conv_state.float(), expected_state)  # bf16 inputs copied: exact
    x, _, _ = conv_inputs(64, CONV_CHANNELS, torch.bfloat16, "cuda")
    live = [0, 13, 26, 39, 52]  # a decode batch padded to 64 rows, as a CUDA graph runs it
    rows = torch.full((64,), PAD_SLOT_ID, dtype=torch.int32)
    rows[live] = int32(slots)
    expected = ref.causal_conv1d(x[live].float(), expected_state, weight.float(),
                                 packed([1] * len(live)), slots)  # fmt: skip
    out = causal_conv1d_update(x, conv_state, weight, rows.cuda())
    assert_close_bf16(out[live], expected)
    assert torch.equal(conv_state.float(), expected_state)


@pytest.mark.gpu
@pytest.mark.parametrize("h_k, h_v", [(16, 16), (2, 4)])
def test_gpu_rule_decode_and_prefill_in_bf16(h_k, h_v):
    torch.manual_seed(8)
    lengths, slots = [1, 17, 64, 1000, 2100], [6, 0, 2, 8, 4]
    shapes = dict(h_k=h_k, h_v=h_v, d_k=128, d_v=128, device="cuda")
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(sum(lengths), dtype=torch.bfloat16,
                                                       **shapes)  # fmt: skip
    tensors = (q, k, v, a, b, A_log, dt_bias)
    expected_state = state.clone()
    expected = reference_rule(*(t.float() for t in tensors), expected_state, packed(lengths), slots)
    qsl = int32(packed(lengths), "cuda")
    out = gated_delta_rule_prefill(*tensors, state, qsl, int32(slots, "cuda"))
    assert out.dtype == torch.bfloat16
    assert_close_bf16(out, expected)
    assert_close_bf16(state, expected_state)

    q, k, v, a, b, *_ = rule_inputs(64, dtype=torch.bfloat16, **shapes)
    rows = torch.full((64,), PAD_SLOT_ID, dtype=torch.int32)
    rows[:5] = torch.tensor(slots)
    tensors = (q[:5], k[:5], v[:5], a[:5], b[:5], A_log, dt_bias)
    expected = reference_rule(*(t.float() for t in tensors), expected_state, packed([1] * 5), slots)
    out = gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, state, rows.cuda())
    assert_close_bf16(out[:5], expected)
    assert_close_bf16(state, expected_state)


@pytest.mark.gpu
def test_gpu_gated_rms_norm_in_bf16():
    torch.manual_seed(9)
    x, gate = (torch.randn(300, 16, 128, device="cuda") for _ in range(2))
    weight = torch.empty(128, device="cuda").uniform_(0.5, 1.5)
    expected = ref.gated_rms_norm(x, gate, weight, 1e-6)
    out = gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight.bfloat16(), 1e-6)
    assert_close_bf16(out, expected)
