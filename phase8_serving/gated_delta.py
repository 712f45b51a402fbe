"""The gated delta rule: linear attention whose whole history is one fixed-size matrix per head.

Problem: softmax attention keeps every past key and value (the KV cache grows with the context,
and a decode step reads all of it). Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2024), three of
every four layers of Qwen3.5, keeps instead a state S of shape (d_k, d_v) per head: an associative
memory that maps keys to values. Each token first lets the memory fade, then corrects what the
memory recalls for its key towards its value (the delta rule: write only the error):

    S'  = exp(g_t) * S_{t-1}            g_t <= 0: the gate, how much of the past survives
    u_t = beta_t * (v_t - S'^T k_t)     beta_t in (0, 1): how far to correct
    S_t = S' + k_t u_t^T                = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T
    o_t = S_t^T q_t

q and k are L2-normalized (a unit key makes the correction a projection) and q is scaled by
d_k ** -0.5. A decode step is this recurrence once: O(d_k * d_v) per head whatever the context.

The chunked form (prefill). Token by token is a loop of T tiny steps; a GPU wants matmuls. Take a
chunk of C tokens starting from state S_0, with gamma_i = g_1 + ... + g_i (cumulative log-decay)
and D_ij = exp(gamma_i - gamma_j) for j <= i. Unrolling the recurrence inside the chunk gives

    u_i = beta_i * (v_i - exp(gamma_i) S_0^T k_i - sum_{j<i} D_ij (k_i . k_j) u_j)

which is a lower-triangular linear system for all u at once: (I + A) U = beta (V - exp(gamma) K S_0)
with A_ij = beta_i D_ij (k_i . k_j) for j < i. Solving it (one triangular solve, the "UT
transform") turns C sequential steps into matmuls:

    U   = T (beta V) - T (beta exp(gamma) K) S_0              T = (I + A)^-1
    o_i = exp(gamma_i) S_0^T q_i + sum_{j<=i} D_ij (q_i . k_j) u_j
    S_C = exp(gamma_C) S_0 + sum_j exp(gamma_C - gamma_j) k_j u_j^T

and chunks follow each other through S. Both forms compute the same numbers (tests check it at
every length around the chunk size), so a prefill split anywhere continues exactly.

Before the rule, a depthwise causal conv1d of width W mixes each q/k/v channel with its W - 1
predecessors; its state is those W - 1 inputs. Both states live in a `StatePool` slot
(state_pool.py), read and written here by slot index.

Everything here is readable torch, float32 for the state, one sequence at a time for prefill:
the oracle that phase 7's kernels are checked against.
"""

import itertools

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of the chunked form (Qwen3.5's, as in fla and transformers)
L2_NORM_EPS = 1e-6  # inside the rsqrt, as fla and transformers normalize q and k


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_NORM_EPS)


def gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H_v) projections -> the log-decay g = -exp(A_log) * softplus(a + dt_bias) <= 0 and the
    write strength beta = sigmoid(b), both float32 (exp(A_log) overflows fp16)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """q, k (T, H_k, d_k) -> float32 (T, H_v, d_k): normalized, q scaled, each key head repeated
    for the H_v / H_k value heads it serves (grouped like GQA, but on the value side)."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    group = num_v_heads // k.shape[1]
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """The recurrence, token by token. q, k (T, H, d_k) prepared; v (T, H, d_v); g, beta (T, H);
    state (..., H, d_k, d_v) float32 -> (o (T, H, d_v) float32, final state). Leading batch dims
    of `state` broadcast with T == 1 rows: a decode step of B sequences is T = B, state (B, ...)."""
    v = v.float()
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None, None]
        recalled = (state * k[t][..., :, None]).sum(-2)  # S'^T k: (..., H, d_v)
        u = beta[t][..., None] * (v[t] - recalled)
        state = state + k[t][..., :, None] * u[..., None, :]
        out.append((state * q[t][..., :, None]).sum(-2))
    return torch.stack(out), state


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """The chunked form of the same rule (see the module docstring), one sequence. Arguments as
    `recurrent_gated_delta_rule` with state (H, d_k, d_v); T is padded up to chunks of
    `chunk_size` with zero keys, values and gates, which change neither outputs nor state."""
    T = q.shape[0]
    pad = (-T) % chunk_size
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # (H, n, C, d): heads first, then chunks, then positions within a chunk
    q, k, v = (x.view(-1, chunk_size, *x.shape[1:]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.view(-1, chunk_size, x.shape[-1]).permute(2, 0, 1) for x in (g, beta))
    gamma = g.cumsum(-1)  # (H, n, C) cumulative log-decay inside each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay  # A_ij = beta_i D_ij k_i.k_j (diagonal unused)
    solve = lambda rhs: torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_values = solve(v * beta[..., None])  # T (beta V)
    u_state = solve(k_beta * gamma.exp()[..., None])  # T (beta exp(gamma) K), multiplies S_0
    scores = (q @ k.transpose(-1, -2)) * decay  # D_ij q_i.k_j, j <= i
    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        u = u_values[:, n] - u_state[:, n] @ state  # (H, C, d_v)
        out[:, n] = (q[:, n] * gamma[:, n, :, None].exp()) @ state + scores[:, n] @ u
        to_end = (gamma[:, n, -1:] - gamma[:, n]).exp()[..., None]  # exp(gamma_C - gamma_j)
        state = state * gamma[:, n, -1].exp()[:, None, None] + (k[:, n] * to_end).mT @ u
    return out.permute(1, 2, 0, 3).flatten(0, 1)[:T], state  # (H, n, C, d_v) -> (T, H, d_v)


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    query_start_loc: list[int],
    state_slots: list[int],
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over packed sequences, continuing from their conv states.

    x (N, C) new inputs; conv_state (num_slots, C, W - 1), updated in place: sequence i's row
    `state_slots[i]` holds its last W - 1 inputs before this step and after it; weight (C, W).
    """
    out = torch.empty_like(x)
    width = weight.shape[1]
    for i, slot in enumerate(state_slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        window = torch.cat((conv_state[slot], x[start:end].T.to(conv_state.dtype)), dim=1)
        y = F.conv1d(window[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]
        out[start:end] = F.silu(y.T).to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - (width - 1) :]
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    query_start_loc: list[int],
    state_slots: list[int],
) -> torch.Tensor:
    """The rule over packed sequences, each continuing from its slot's state (written back).

    q, k (N, H_k, d_k) raw (normalized here); v (N, H_v, d_v); g, beta (N, H_v) float32;
    recurrent_state (num_slots, H_v, d_k, d_v) float32 -> o (N, H_v, d_v) float32. Decodes (one
    token) take one batched recurrent step; every longer run takes the chunked form.
    """
    q, k = prepare_qk(q, k, v.shape[1])
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    lengths = [end - start for start, end in itertools.pairwise(query_start_loc)]
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    if decodes:
        rows = torch.tensor([query_start_loc[i] for i in decodes], device=v.device)
        slots = torch.tensor([state_slots[i] for i in decodes], device=v.device)
        o, recurrent_state[slots] = recurrent_gated_delta_rule(
            q[rows][None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
            recurrent_state[slots],
        )  # fmt: skip
        out[rows] = o[0]
    for i, n in enumerate(lengths):
        if n > 1:
            span, slot = slice(query_start_loc[i], query_start_loc[i + 1]), state_slots[i]
            out[span], recurrent_state[slot] = chunk_gated_delta_rule(
                q[span], k[span], v[span], g[span], beta[span], recurrent_state[slot]
            )
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """RMSNorm of each head's output (..., d_v), times weight, times SiLU(gate): the output gate
    of a DeltaNet layer (norm before gate, in float32, as Qwen3.5 computes it)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x.to(dtype) * F.silu(gate.float())).to(dtype)
