"""Depthwise causal conv1d + SiLU with per-sequence state: the short convolution before Gated
DeltaNet's rule, for a decode step (`causal_conv1d_update`) and a packed prefill
(`causal_conv1d_varlen`).

Problem: each q/k/v channel c of a DeltaNet layer is mixed with its W - 1 predecessors,
y_t = silu(sum_j weight[c, j] * x_{t - (W-1) + j}), and a sequence that continues (the next decode
step, the next chunk of a prefill) needs its last W - 1 inputs: the conv state, kept in a state
pool slot. The readable version (gated_delta.py's `causal_conv1d`) concatenates the state and the
new inputs, runs F.conv1d and copies the tail back, one sequence at a time: for a decode step of
B sequences that is some 6 kernels per sequence (cat, cast, conv, silu, cast, copy), each reading
and writing the (C, W - 1 + T) window again.
Idea: one program per (sequence, channel block, token block) reads each input once per tap
(W loads of a (BLOCK_T, BLOCK_C) tile that hit in cache), sums the taps in fp32 registers, applies
SiLU and stores the output once; the program of a sequence's first token block also writes the
new conv state. A decode step is the same with one token per row (`causal_conv1d_update`).

Invariants:
- x (N, C) may be a strided view (rows strided, last dim contiguous); weight (C, W); conv_state
  (num_slots, C, W - 1) is read and written only at the rows named by `state_slots`, whose valid
  entries are distinct;
- a sequence or decode row whose slot is PAD_SLOT_ID reads and writes no state (its output is
  don't-care): a CUDA graph's padded rows are harmless;
- the new conv state is the sequence's last W - 1 inputs, reaching into the old state when the
  sequence is shorter than W - 1 tokens. Only the first token block reads the old state (its
  positions < W - 1 are the only ones that look back past the sequence start, BLOCK_T >= W - 1),
  and that same program writes the new state after a barrier: no other program can read a state
  that was already overwritten;
- the taps are summed in fp32 and the output stored in x's dtype; the state keeps its dtype.
"""

import torch
import triton
import triton.language as tl

from . import PAD_SLOT_ID
from .pdl import launch_dependents, pdl_launch, supports_pdl, wait_for_previous

BLOCK_C = 128  # channels per program: 6144 channels (Qwen3.5-0.8B) -> 48 channel blocks
BLOCK_T = 32  # tokens per program of a prefill (>= W - 1, see the invariants)
NUM_WARPS = 4


@triton.jit
def _conv_tile(
    x_ptr, state_ptr, w_ptr, out_ptr, start, seq_len, t0, offs_c, n_channels,
    stride_xt, stride_ot, stride_sc, stride_sw, stride_wc,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Outputs of positions t0 .. t0 + BLOCK_T of one sequence (rows start .. start + seq_len of
    x) for channels `offs_c` (1, BLOCK_C); `state_ptr` points at the sequence's conv-state row.
    The program with t0 == 0 then writes the new state: the last W - 1 inputs."""
    lanes = offs_c < n_channels
    offs_t = t0 + tl.arange(0, BLOCK_T)[:, None]  # (BLOCK_T, 1) positions in the sequence
    valid = (offs_t < seq_len) & lanes
    s_ptrs = state_ptr + offs_c * stride_sc
    acc = tl.zeros((BLOCK_T, offs_c.shape[1]), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        p = offs_t - (WIDTH - 1) + j  # the input tap j sees; p < 0: in the old conv state
        x = tl.load(x_ptr + (start + p) * stride_xt + offs_c, mask=valid & (p >= 0), other=0.0)
        s = tl.load(s_ptrs + (p + WIDTH - 1) * stride_sw, mask=valid & (p < 0), other=0.0)
        w = tl.load(w_ptr + offs_c * stride_wc + j, mask=lanes, other=0.0).to(tl.float32)
        acc += (x.to(tl.float32) + s.to(tl.float32)) * w  # one of x, s is the masked zero
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    out_ptrs = out_ptr + (start + offs_t) * stride_ot + offs_c
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=valid)
    if t0 == 0:  # (new names inside: a compiled `if` may not change a variable's shape)
        offs_w = tl.arange(0, BLOCK_W)[:, None]  # (BLOCK_W, 1) columns of the new state
        column = (offs_w < WIDTH - 1) & lanes
        src = seq_len - (WIDTH - 1) + offs_w  # the input that becomes column offs_w
        from_x = tl.load(x_ptr + (start + src) * stride_xt + offs_c, mask=column & (src >= 0))
        from_state = tl.load(s_ptrs + (src + WIDTH - 1) * stride_sw, mask=column & (src < 0))
        new = tl.where(src >= 0, from_x.to(state_ptr.dtype.element_ty), from_state)
        # the new state is not computed from the old value at the same place (it shifts), so a
        # thread could overwrite a column another thread has yet to read: all read, then write
        tl.debug_barrier()
        tl.store(s_ptrs + offs_w * stride_sw, new, mask=column)


@triton.jit
def _causal_conv1d_varlen_kernel(
    x_ptr, state_ptr, w_ptr, out_ptr, query_start_loc_ptr, state_slots_ptr, n_channels,
    stride_xt, stride_ot, stride_ss, stride_sc, stride_sw, stride_wc,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PAD_SLOT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    t0 = tl.program_id(2) * BLOCK_T
    start = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(query_start_loc_ptr + seq + 1) - start
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    if (t0 < seq_len) & (slot != PAD_SLOT):  # the grid covers the longest sequence
        offs_c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        _conv_tile(
            x_ptr, state_ptr + slot * stride_ss, w_ptr, out_ptr, start.to(tl.int64), seq_len, t0,
            offs_c, n_channels, stride_xt, stride_ot, stride_sc, stride_sw, stride_wc,
            WIDTH, BLOCK_T, BLOCK_W,
        )  # fmt: skip


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, out_ptr, state_slots_ptr, n_channels,
    stride_xt, stride_ot, stride_ss, stride_sc, stride_sw, stride_wc,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # kernels/pdl.py
    wait_for_previous(PDL)  # x: the in-projection's output
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:  # a CUDA graph's padded row touches no state
        offs_c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        _conv_tile(
            x_ptr, state_ptr + slot * stride_ss, w_ptr, out_ptr, row, 1, 0, offs_c, n_channels,
            stride_xt, stride_ot, stride_sc, stride_sw, stride_wc, WIDTH, 1, BLOCK_W,
        )  # fmt: skip


def _check(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> None:
    n_channels, width = weight.shape
    assert x.dim() == 2 and x.shape[1] == n_channels and x.stride(1) == 1
    assert conv_state.shape[1:] == (n_channels, width - 1) and weight.stride(1) == 1
    assert width - 1 <= BLOCK_T, "only the first token block may read the old state"


def causal_conv1d_varlen(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Packed prefill: x (N, C) holds S sequences, sequence i at rows query_start_loc[i] ..
    query_start_loc[i + 1] (int32 (S + 1,)), continuing from conv_state[state_slots[i]] (S,) and
    writing its last W - 1 inputs back -> silu(conv) (N, C) in x's dtype. `max_query_len` sizes
    the grid; None reads it from query_start_loc (a device-to-host sync)."""
    _check(x, conv_state, weight)
    num_seqs = state_slots.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max()) if num_seqs else 0
    if num_seqs == 0 or max_query_len == 0:
        return out
    n_channels, width = weight.shape
    grid = (num_seqs, triton.cdiv(n_channels, BLOCK_C), triton.cdiv(max_query_len, BLOCK_T))
    _causal_conv1d_varlen_kernel[grid](
        x, conv_state, weight, out, query_start_loc, state_slots, n_channels,
        x.stride(0), out.stride(0), *conv_state.stride(), weight.stride(0),
        WIDTH=width, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, BLOCK_W=triton.next_power_of_2(width),
        PAD_SLOT=PAD_SLOT_ID, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    pdl: bool = True,
) -> torch.Tensor:
    """Decode: x (B, C) one new input per row, row b continuing conv_state[state_slots[b]] (and
    shifting x into it) -> silu(conv) (B, C) in x's dtype. Rows with slot PAD_SLOT_ID touch no
    state and leave their output row unwritten. `pdl`: kernels/pdl.py."""
    _check(x, conv_state, weight)
    assert state_slots.shape == (x.shape[0],)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    pdl = pdl and supports_pdl(x.device)
    if x.shape[0]:
        n_channels, width = weight.shape
        _causal_conv1d_update_kernel[(x.shape[0], triton.cdiv(n_channels, BLOCK_C))](
            x, conv_state, weight, out, state_slots, n_channels,
            x.stride(0), out.stride(0), *conv_state.stride(), weight.stride(0),
            WIDTH=width, BLOCK_C=BLOCK_C, BLOCK_W=triton.next_power_of_2(width),
            PAD_SLOT=PAD_SLOT_ID, PDL=pdl, num_warps=NUM_WARPS, **pdl_launch(pdl),
        )  # fmt: skip
    return out
