"""The gated delta rule in Triton: one recurrent step per decode row, and the chunked form for a
packed prefill, both reading and writing each sequence's state in its state-pool slot.

Problem: gated_delta.py (the readable oracle; its docstring derives both forms) runs a decode step
as ~15 torch kernels over the (B, H_v, d_k, d_v) state, gathered from the pool by slot and
scattered back (two extra copies of it), and a prefill one sequence at a time with a Python loop
over chunks. A decode step is bandwidth-bound: Qwen3.5-0.8B's state is 16 value heads x 128 x
128 fp32 = 1 MiB per sequence per layer, and its floor is reading and writing that once.

Idea, decode (`gated_delta_rule_decode`): one program per (row, value head, d_v tile) loads its
(d_k, BLOCK_V) tile of the state from the slot, does the whole step in fp32 registers (L2-norm of
q and k, the gates from the raw projections, decay, recall, delta write, readout) and stores the
tile back in place: the state crosses HBM once each way, q, k, v and o are noise beside it.

Idea, prefill (`gated_delta_rule_prefill`), the chunked form of gated_delta.py in three kernels,
as fla's `chunk_gated_delta_rule` splits it:
1. `_chunk_intra_kernel`, one program per (chunk, value head), all chunks of all sequences at
   once: the gates and their cumulative sum gamma, A = beta_i D_ij (k_i . k_j) (strictly lower),
   T = (I + A)^-1 by forward substitution in registers, then W = T (beta exp(gamma) K) and
   U = T (beta V): the "UT transform" that turns C sequential steps into matmuls;
2. `_chunk_state_kernel`, one program per (sequence, value head, d_v tile), the only sequential
   part: walks the sequence's chunks from the slot's state S, storing each chunk's initial S,
   V_new = U - W S (the corrected values) and S <- exp(gamma_C) S + (exp(gamma_C - gamma) K)^T
   V_new; writes the final S back to the slot;
3. `_chunk_output_kernel`, one program per (chunk, value head, d_v tile), parallel again:
   O = exp(gamma) Q S_chunk + (D * Q K^T) V_new.

Invariants:
- q, k (N, H_k, d_k) come raw from the conv (the kernels L2-normalize them with eps 1e-6 inside
  the rsqrt and scale q by d_k ** -0.5, as `prepare_qk`); v (N, H_v, d_v); a, b (N, H_v) the raw
  gate projections: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), in fp32 (`gating`).
  Rows may be strided (views into one projection output); the last dim is contiguous;
- H_v is a multiple of H_k; value head h reads key head h // (H_v / H_k);
- recurrent_state (num_slots, H_v, d_k, d_v) is fp32 and changes only at the slots named in
  `state_slots`, whose valid entries are distinct; PAD_SLOT_ID (kernels/__init__.py) touches no
  state: a decode row so is skipped whole (its output is don't-care), a prefill sequence so starts
  from a zero state and writes none back;
- o comes out in v's dtype; the state, gates and the triangular solve stay fp32, matmul operands
  are rounded to the inputs' dtype (bf16 on the GPU, as fla does);
- a prefill is exact at any split: a sequence prefilled in pieces (each piece's final state in the
  slot) equals one pass, up to rounding; sequences of one token are valid prefill sequences (a
  mixed step may pass decodes through the prefill path).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import PAD_SLOT_ID
from .pdl import launch_dependents, pdl_launch, supports_pdl, wait_for_previous

L2_NORM_EPS = tl.constexpr(1e-6)  # inside the rsqrt, as gated_delta.py's `l2_normalize`
CHUNK_SIZE = 64  # tokens per chunk: Qwen3.5's, as in fla and the reference
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # softplus(x) = x above it, as torch's F.softplus


# ---- shared pieces ------------------------------------------------------------------------------


@triton.jit
def _l2_normalized(ptrs, mask, AXIS: tl.constexpr):
    """The vectors at `ptrs` (laid along AXIS) -> fp32, each scaled to unit L2 norm."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, AXIS, keep_dims=True) + L2_NORM_EPS)


@triton.jit
def _gates(a, b, A_log, dt_bias):
    """Raw projections -> (g, beta) in fp32: g = -exp(A_log) softplus(a + dt_bias) <= 0."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(
        x > SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD)))
    )
    g = -tl.exp(A_log.to(tl.float32)) * softplus
    return g, 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))


# ---- decode: one recurrent step per row ---------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, state_slots_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
    d_k, d_v, scale,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)  # kernels/pdl.py
    wait_for_previous(PDL)  # q, k, v, a, b: the conv's and the projections' outputs
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:  # a CUDA graph's padded row touches no state
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_k, mask_v = offs_k < d_k, offs_v < d_v
        key_head = head // GROUP
        # q, k as (BLOCK_K, 1) columns, to broadcast against the state tile's rows
        q = _l2_normalized(q_ptr + row * stride_qb + key_head * stride_qh + offs_k[:, None],
                           mask_k[:, None], 0) * scale  # fmt: skip
        k = _l2_normalized(k_ptr + row * stride_kb + key_head * stride_kh + offs_k[:, None],
                           mask_k[:, None], 0)  # fmt: skip
        g, beta = _gates(
            tl.load(a_ptr + row * stride_ab + head), tl.load(b_ptr + row * stride_bb + head),
            tl.load(A_log_ptr + head), tl.load(dt_bias_ptr + head),
        )  # fmt: skip
        v = tl.load(v_ptr + row * stride_vb + head * stride_vh + offs_v, mask=mask_v, other=0.0)
        s_ptrs = (state_ptr + slot * stride_ss + head * stride_sh
                  + offs_k[:, None] * stride_sk + offs_v[None, :])  # fmt: skip
        mask_s = mask_k[:, None] & mask_v[None, :]
        S = tl.load(s_ptrs, mask=mask_s, other=0.0) * tl.exp(g)  # (BLOCK_K, BLOCK_V) decayed
        u = beta * (v.to(tl.float32) - tl.sum(S * k, 0))  # the delta: v minus what S recalls
        S += k * u[None, :]
        o = tl.sum(S * q, 0)
        tl.store(s_ptrs, S, mask=mask_s)
        o_ptrs = o_ptr + row * stride_ob + head * stride_oh + offs_v
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def decode_block_v(num_rows: int, num_v_heads: int, d_v: int) -> int:
    """d_v columns per decode program: small batches split d_v finer, so that enough programs
    are in flight to pull the state at full bandwidth (a few per SM on the H200's 132)."""
    block_v = min(64, triton.next_power_of_2(d_v))
    while block_v > 16 and num_rows * num_v_heads * triton.cdiv(d_v, block_v) < 1024:
        block_v //= 2
    return block_v


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_slots: torch.Tensor,
    pdl: bool = True,
    block_v: int | None = None,
) -> torch.Tensor:
    """One step of B rows: q, k (B, H_k, d_k) raw, v (B, H_v, d_v), a, b (B, H_v) raw, A_log and
    dt_bias (H_v,); row r's state is recurrent_state[state_slots[r]], updated in place ->
    o (B, H_v, d_v) in v's dtype (PAD_SLOT_ID rows: not written). `pdl`: kernels/pdl.py;
    `block_v`: d_v columns per program, None: `decode_block_v`'s choice."""
    num_rows, num_v_heads, d_v = v.shape
    _check_inputs(q, k, v, a, b, recurrent_state)
    assert state_slots.shape == (num_rows,)
    d_k = q.shape[-1]
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    pdl = pdl and supports_pdl(v.device)
    if num_rows == 0:
        return o
    block_v = block_v or decode_block_v(num_rows, num_v_heads, d_v)
    grid = (num_rows, num_v_heads, triton.cdiv(d_v, block_v))
    _decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, recurrent_state, o, state_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), *recurrent_state.stride()[:3], o.stride(0), o.stride(1),
        d_k, d_v, d_k**-0.5,
        GROUP=num_v_heads // q.shape[1], BLOCK_K=triton.next_power_of_2(d_k), BLOCK_V=block_v,
        PAD_SLOT=PAD_SLOT_ID, PDL=pdl, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return o


def _check_inputs(q, k, v, a, b, recurrent_state) -> None:
    num_tokens, num_v_heads, d_v = v.shape
    assert q.shape == k.shape and q.shape[0] == num_tokens and num_v_heads % q.shape[1] == 0
    assert a.shape == b.shape == (num_tokens, num_v_heads)
    assert recurrent_state.shape[1:] == (num_v_heads, q.shape[2], d_v)
    assert recurrent_state.dtype == torch.float32 and recurrent_state.stride(-1) == 1
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == a.stride(-1) == b.stride(-1) == 1


# ---- prefill: the chunked form ------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkConfig:
    """Launch shapes of the three prefill kernels (benchmarks/phase7_gdn_kernels.py sweeps them).
    `state_block_v`: d_v columns per program of the sequential state pass (fewer: more programs
    in flight when a prefill holds few sequences); `output_block_v`: of the output kernel."""

    intra_warps: int = 4
    state_block_v: int = 32
    state_warps: int = 4
    output_block_v: int = 64
    output_warps: int = 4

    def __post_init__(self):
        for name in ("state_block_v", "output_block_v"):
            value = getattr(self, name)
            if value < 16 or value != triton.next_power_of_2(value):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")


DEFAULT_CHUNK_CONFIG = ChunkConfig()


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, CHUNK: tl.constexpr):
    """Chunk `chunk`'s token rows (CHUNK,) int64, which of them exist, and its first row."""
    t0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    offs_t = tl.arange(0, CHUNK)
    return t0 + offs_t, offs_t < tl.load(chunk_len_ptr + chunk), t0


@triton.jit
def _chunk_intra_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, chunk_start_ptr, chunk_len_ptr,
    w_ptr, u_ptr, gamma_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_gt,
    d_k, d_v,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    chunk, head = tl.program_id(0), tl.program_id(1)
    rows, valid, _ = _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, CHUNK)
    chunk_len = tl.load(chunk_len_ptr + chunk)
    offs_k, offs_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_DV)
    dot_type = k_ptr.dtype.element_ty
    k = _l2_normalized(
        k_ptr + rows[:, None] * stride_kt + (head // GROUP) * stride_kh + offs_k[None, :],
        valid[:, None] & (offs_k < d_k)[None, :], 1,
    )  # fmt: skip
    a = tl.load(a_ptr + rows * stride_at + head, mask=valid, other=0.0)
    b = tl.load(b_ptr + rows * stride_bt + head, mask=valid, other=0.0)
    g, beta = _gates(a, b, tl.load(A_log_ptr + head), tl.load(dt_bias_ptr + head))
    # padded rows: no decay (gamma stays at the last token's) and no write
    g, beta = tl.where(valid, g, 0.0), tl.where(valid, beta, 0.0)
    gamma = tl.cumsum(g, 0)  # (CHUNK,) cumulative log-decay
    tl.store(gamma_ptr + rows * stride_gt + head, gamma, mask=valid)

    # A_ij = beta_i D_ij (k_i . k_j), j < i; D_ij = exp(gamma_i - gamma_j) (-inf above: no overflow)
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    decay = tl.exp(tl.where(i > j, gamma[:, None] - gamma[None, :], float("-inf")))
    kk = tl.dot(k.to(dot_type), tl.trans(k.to(dot_type)))
    A = beta[:, None] * decay * kk
    # T = (I + A)^-1 by forward substitution, all right-hand sides (I's columns) at once: once
    # row c of T is final, subtract A_ic T_c from every row below it (A is zero elsewhere; the
    # rows past the chunk's end are zero too, so a short chunk stops early)
    T = tl.where(i == j, 1.0, 0.0)
    for c in range(0, chunk_len - 1):
        a_c = tl.sum(tl.where(j == c, A, 0.0), 1)  # column c of A: (CHUNK,) over rows
        t_c = tl.sum(tl.where(i == c, T, 0.0), 0)  # row c of T: (CHUNK,) over columns
        T -= a_c[:, None] * t_c[None, :]
    T = T.to(dot_type)

    w = tl.dot(T, (k * (beta * tl.exp(gamma))[:, None]).to(dot_type))  # T (beta exp(gamma) K)
    w_ptrs = w_ptr + rows[:, None] * stride_wt + head * stride_wh + offs_k[None, :]
    tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty), mask=valid[:, None] & (offs_k < d_k)[None, :])
    mask_v = valid[:, None] & (offs_v < d_v)[None, :]
    v = tl.load(v_ptr + rows[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
                mask=mask_v, other=0.0)  # fmt: skip
    u = tl.dot(T, (v.to(tl.float32) * beta[:, None]).to(dot_type))  # T (beta V)
    tl.store(u_ptr + rows[:, None] * stride_ut + head * stride_uh + offs_v[None, :],
             u.to(u_ptr.dtype.element_ty), mask=mask_v)  # fmt: skip


@triton.jit
def _chunk_state_kernel(
    k_ptr, w_ptr, u_ptr, gamma_ptr, h_ptr, state_ptr,
    chunk_start_ptr, chunk_len_ptr, seq_chunk_loc_ptr, state_slots_ptr,
    stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh, stride_gt,
    stride_hc, stride_hh, stride_hk, stride_ss, stride_sh, stride_sk,
    d_k, d_v,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PAD_SLOT: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < d_k, offs_v < d_v
    mask_s = mask_k[:, None] & mask_v[None, :]
    dot_type = k_ptr.dtype.element_ty
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    s_ptrs = (state_ptr + slot * stride_ss + head * stride_sh
              + offs_k[:, None] * stride_sk + offs_v[None, :])  # fmt: skip
    S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)  # a PAD_SLOT_ID sequence starts from 0
    if slot != PAD_SLOT:
        S = tl.load(s_ptrs, mask=mask_s, other=0.0)
    first_chunk = tl.load(seq_chunk_loc_ptr + seq).to(tl.int64)  # int64: chunk * stride_hc
    for chunk in range(first_chunk, tl.load(seq_chunk_loc_ptr + seq + 1)):
        rows, valid, t0 = _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, CHUNK)
        h_ptrs = (h_ptr + chunk * stride_hc + head * stride_hh
                  + offs_k[:, None] * stride_hk + offs_v[None, :])  # fmt: skip
        tl.store(h_ptrs, S.to(h_ptr.dtype.element_ty), mask=mask_s)  # the chunk's initial state
        w = tl.load(w_ptr + rows[:, None] * stride_wt + head * stride_wh + offs_k[None, :],
                    mask=valid[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        u_ptrs = u_ptr + rows[:, None] * stride_ut + head * stride_uh + offs_v[None, :]
        mask_u = valid[:, None] & mask_v[None, :]
        u = tl.load(u_ptrs, mask=mask_u, other=0.0).to(tl.float32)
        v_new = u - tl.dot(w, S.to(dot_type))  # U - W S: the values corrected for S
        tl.store(u_ptrs, v_new.to(u_ptr.dtype.element_ty), mask=mask_u)  # in place of U
        k = _l2_normalized(
            k_ptr + rows[:, None] * stride_kt + (head // GROUP) * stride_kh + offs_k[None, :],
            valid[:, None] & mask_k[None, :], 1,
        )  # fmt: skip
        gamma = tl.load(gamma_ptr + rows * stride_gt + head, mask=valid, other=0.0)
        gamma_last = tl.load(gamma_ptr + (t0 + tl.load(chunk_len_ptr + chunk) - 1) * stride_gt
                             + head)  # fmt: skip
        to_end = tl.where(valid, tl.exp(gamma_last - gamma), 0.0)  # exp(gamma_C - gamma_j)
        k_decayed = tl.trans((k * to_end[:, None]).to(dot_type))  # (BLOCK_K, CHUNK)
        S = S * tl.exp(gamma_last) + tl.dot(k_decayed, v_new.to(dot_type))
    if slot != PAD_SLOT:
        tl.store(s_ptrs, S, mask=mask_s)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, u_ptr, gamma_ptr, h_ptr, o_ptr, chunk_start_ptr, chunk_len_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ut, stride_uh, stride_gt,
    stride_hc, stride_hh, stride_hk, stride_ot, stride_oh,
    d_k, d_v, scale,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    chunk, head = tl.program_id(0), tl.program_id(1)
    rows, valid, _ = _chunk_rows(chunk_start_ptr, chunk_len_ptr, chunk, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < d_k, offs_v < d_v
    dot_type = k_ptr.dtype.element_ty
    key_head = head // GROUP
    mask_qk = valid[:, None] & mask_k[None, :]
    q = _l2_normalized(q_ptr + rows[:, None] * stride_qt + key_head * stride_qh + offs_k[None, :],
                       mask_qk, 1) * scale  # fmt: skip
    k = _l2_normalized(k_ptr + rows[:, None] * stride_kt + key_head * stride_kh + offs_k[None, :],
                       mask_qk, 1)  # fmt: skip
    q, k = q.to(dot_type), k.to(dot_type)
    gamma = tl.load(gamma_ptr + rows * stride_gt + head, mask=valid, other=0.0)
    h = tl.load(h_ptr + chunk.to(tl.int64) * stride_hc + head * stride_hh
                + offs_k[:, None] * stride_hk + offs_v[None, :],
                mask=mask_k[:, None] & mask_v[None, :], other=0.0)  # fmt: skip
    o = tl.dot(q, h.to(dot_type)) * tl.exp(gamma)[:, None]  # exp(gamma_i) S_0^T q_i
    i, j = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    # -inf above the diagonal and on rows past the chunk's end (whose loaded gamma is 0): no
    # exp overflows
    causal = (i >= j) & valid[:, None]
    decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
    scores = tl.dot(q, tl.trans(k)) * decay  # D_ij q_i . k_j, j <= i
    mask_o = valid[:, None] & mask_v[None, :]
    v_new = tl.load(u_ptr + rows[:, None] * stride_ut + head * stride_uh + offs_v[None, :],
                    mask=mask_o, other=0.0)  # fmt: skip
    o += tl.dot(scores.to(dot_type), v_new.to(dot_type))
    tl.store(o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mask_o)  # fmt: skip


def chunk_layout(query_start_loc: torch.Tensor, chunk_size: int):
    """Sequences -> chunks, on the host: (chunk_start (num_chunks,) first row of each chunk,
    chunk_len (num_chunks,) its tokens (<= chunk_size), seq_chunk_loc (S + 1,) sequence i's
    chunks are seq_chunk_loc[i] .. seq_chunk_loc[i + 1]), int32 on query_start_loc's device."""
    starts = query_start_loc.cpu().long()  # a prefill syncs once, here
    counts = (starts.diff() + chunk_size - 1) // chunk_size
    seq_chunk_loc = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
    seq_of_chunk = torch.repeat_interleave(torch.arange(len(counts)), counts)
    index_in_seq = torch.arange(int(seq_chunk_loc[-1])) - seq_chunk_loc[seq_of_chunk]
    chunk_start = starts[seq_of_chunk] + index_in_seq * chunk_size
    chunk_len = torch.minimum(starts[seq_of_chunk + 1] - chunk_start, torch.tensor(chunk_size))
    device = query_start_loc.device
    return tuple(x.to(device, torch.int32) for x in (chunk_start, chunk_len, seq_chunk_loc))


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    config: ChunkConfig = DEFAULT_CHUNK_CONFIG,
) -> torch.Tensor:
    """Packed prefill of S sequences (any lengths, 1 included): q, k (N, H_k, d_k) raw, v
    (N, H_v, d_v), a, b (N, H_v) raw, A_log and dt_bias (H_v,); sequence i is rows
    query_start_loc[i] .. query_start_loc[i + 1] (S + 1,) and continues
    recurrent_state[state_slots[i]] (S,), written back -> o (N, H_v, d_v) in v's dtype."""
    num_tokens, num_v_heads, d_v = v.shape
    _check_inputs(q, k, v, a, b, recurrent_state)
    num_seqs, d_k = state_slots.shape[0], q.shape[-1]
    assert query_start_loc.shape == (num_seqs + 1,)
    assert chunk_size >= 16 and chunk_size == triton.next_power_of_2(chunk_size), "tl.dot tiles"
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return o
    chunk_start, chunk_len, seq_chunk_loc = chunk_layout(query_start_loc, chunk_size)
    num_chunks = chunk_start.shape[0]
    # scratch: W, U (then V_new in place), gamma per token; each chunk's initial state
    w = torch.empty(num_tokens, num_v_heads, d_k, dtype=k.dtype, device=k.device)
    u = torch.empty(num_tokens, num_v_heads, d_v, dtype=v.dtype, device=v.device)
    gamma = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=v.device)
    h = torch.empty(num_chunks, num_v_heads, d_k, d_v, dtype=k.dtype, device=k.device)
    block_k = max(16, triton.next_power_of_2(d_k))
    common = dict(GROUP=num_v_heads // q.shape[1], CHUNK=chunk_size, BLOCK_K=block_k)
    if num_chunks:
        _chunk_intra_kernel[(num_chunks, num_v_heads)](
            k, v, a, b, A_log, dt_bias, chunk_start, chunk_len, w, u, gamma,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), gamma.stride(0), d_k, d_v,
            BLOCK_DV=max(16, triton.next_power_of_2(d_v)), num_warps=config.intra_warps, **common,
        )  # fmt: skip
    block_v = min(config.state_block_v, max(16, triton.next_power_of_2(d_v)))
    _chunk_state_kernel[(num_seqs, num_v_heads, triton.cdiv(d_v, block_v))](
        k, w, u, gamma, h, recurrent_state, chunk_start, chunk_len, seq_chunk_loc, state_slots,
        k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        gamma.stride(0), *h.stride()[:3], *recurrent_state.stride()[:3], d_k, d_v,
        BLOCK_V=block_v, PAD_SLOT=PAD_SLOT_ID, num_warps=config.state_warps, **common,
    )  # fmt: skip
    if num_chunks:
        block_v = min(config.output_block_v, max(16, triton.next_power_of_2(d_v)))
        _chunk_output_kernel[(num_chunks, num_v_heads, triton.cdiv(d_v, block_v))](
            q, k, u, gamma, h, o, chunk_start, chunk_len,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), u.stride(0), u.stride(1),
            gamma.stride(0), *h.stride()[:3], o.stride(0), o.stride(1), d_k, d_v, d_k**-0.5,
            BLOCK_V=block_v, num_warps=config.output_warps, **common,
        )  # fmt: skip
    return o
