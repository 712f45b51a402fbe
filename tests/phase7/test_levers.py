"""The CUDA path's kernel levers (config.KernelConfig), each seen by a test that fails without it.

- the small-batch GEMV (kernels/gemv.py) against torch's matmul, split-K and uneven shapes, and on
  the slices tensor parallelism gives each rank;
- what a decode step launches: a tiny model runs its Triton path on CPU (the interpreter,
  `interpret_on_cpu`) under a counter of the kernels a GPU would run; switching a lever off adds
  exactly the launches it saves (2 per layer for each fusion, 1 per layer for the decode merge);
- with every lever on, that step's logits are the torch path's (Qwen3 and Llama-family models).
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim.attention import ForwardBatch  # noqa: E402
from phase7_optim.attention_backend import TorchAttention, TritonAttention  # noqa: E402
from phase7_optim.config import EngineConfig, KernelConfig  # noqa: E402
from phase7_optim.distributed import TensorParallel  # noqa: E402
from phase7_optim.kernels.gemv import GemvConfig, counters_for, gemv, gemv_config_for  # noqa: E402
from phase7_optim.kernels.paged_decode import (  # noqa: E402
    BASELINE_DECODE_CONFIG,
    TUNED_DECODE_CONFIG,
    choose_num_splits,
)
from phase7_optim.kv_cache import KVCache  # noqa: E402
from phase7_optim.linear import QKVParallelLinear, RowParallelLinear  # noqa: E402
from phase7_optim.model import ModelConfig, Qwen3ForCausalLM  # noqa: E402

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


# ---- config ------------------------------------------------------------------------------------


def test_engine_config_carries_the_kernel_levers():
    config = EngineConfig(fuse_add_rms_norm=False, gemv_max_batch=0)
    assert config.kernels == KernelConfig(fuse_add_rms_norm=False, gemv_max_batch=0)
    with pytest.raises(ValueError, match="gemv_max_batch"):
        EngineConfig(gemv_max_batch=17)  # more rows than the GEMV kernel's tile
    with pytest.raises(ValueError, match="gemv_max_batch"):
        EngineConfig(gemv_max_batch=-1)
    with pytest.raises(TypeError, match="fuse_rope_kv_store"):
        EngineConfig(fuse_rope_kv_store=1)


def test_gemv_is_used_only_below_the_threshold_and_on_the_triton_path():
    kernels = KernelConfig(gemv_max_batch=4)
    assert not kernels.use_gemv(torch.zeros(2, 8))  # CPU without the interpreter: torch
    if os.environ.get("TRITON_INTERPRET") == "1":
        on_cpu = KernelConfig(gemv_max_batch=4, interpret_on_cpu=True)
        assert on_cpu.use_gemv(torch.zeros(4, 8)) and not on_cpu.use_gemv(torch.zeros(5, 8))
        assert not KernelConfig(gemv_max_batch=0, interpret_on_cpu=True).use_gemv(torch.zeros(1, 8))


# ---- the tuned launch choices (the H200: 132 SMs) -----------------------------------------------


def test_gemv_configs_are_the_h200_sweeps_best_on_qwen3_0_6b():
    best = {  # (rows, N, K): (block_n, block_k, split_k, dot), benchmarks/phase7_gemv.py's sweep
        (1, 4096, 1024): (16, 1024, 1, False),  # qkv_proj: a whole row of W per program
        (1, 1024, 2048): (8, 2048, 1, False),  # o_proj: 8-row tiles rather than a K split
        (1, 6144, 1024): (8, 1024, 1, False),  # gate_up_proj
        (1, 1024, 3072): (8, 512, 6, False),  # down_proj: K is no power of two
        (2, 1024, 3072): (64, 128, 24, False),
        (8, 1024, 2048): (64, 256, 8, True),  # tl.dot from 3 rows on
        (16, 6144, 1024): (32, 512, 2, True),
        (1, 151936, 1024): (64, 128, 1, True),  # lm_head: the K loop, at 93% of copy bandwidth
    }
    for (m, n, k), expected in best.items():
        config = gemv_config_for(m, n, k, num_sms=132)
        assert (config.block_n, config.block_k, config.split_k, config.dot) == expected, (m, n, k)
        assert config.tile == (n < 32768) and config.pdl == config.tile
    assert not gemv_config_for(1, 4096, 1024, num_sms=114).tile  # another GPU: the heuristic


def test_untuned_shapes_at_one_or_two_rows_take_8_row_slices_of_4096():
    """Qwen3-8B's layers (not swept): at 1-2 rows, the tile kernel with K in slices of 4,096
    (the H100 probe's best); from 3 rows, or where K is no multiple of 4,096 (not measured so),
    the K loop."""

    def tile(block_k: int, split_k: int) -> GemvConfig:
        return GemvConfig(8, block_k, split_k, 4, 1, tile=True, dot=False, pdl=True)

    assert gemv_config_for(1, 6144, 4096, num_sms=132) == tile(4096, 1)  # qkv_proj
    assert gemv_config_for(1, 4096, 12288, num_sms=132) == tile(4096, 3)  # down_proj
    assert gemv_config_for(2, 151936, 4096, num_sms=132) == tile(4096, 1)  # lm_head
    assert gemv_config_for(1, 4096, 6144, num_sms=132).dot  # K no multiple of 4,096
    assert gemv_config_for(1, 248320, 1024, num_sms=132).dot  # Qwen3.5's LM head: as before
    loop = gemv_config_for(3, 6144, 4096, num_sms=132)
    assert not loop.tile and (loop.block_n, loop.block_k, loop.split_k) == (32, 128, 1)


def test_tuned_decode_splits_at_ws_mix():
    engine_context = 40960  # a CUDA graph's block table covers Qwen3's whole context
    assert choose_num_splits(256, 8, engine_context, 132, BASELINE_DECODE_CONFIG) == 1
    assert choose_num_splits(256, 8, engine_context, 132, TUNED_DECODE_CONFIG) == 1
    assert choose_num_splits(128, 8, engine_context, 132, TUNED_DECODE_CONFIG) == 2
    # a single stream's engine (64 blocks of 16): 16 splits of its short context, not 4
    assert choose_num_splits(1, 8, 1024, 132, BASELINE_DECODE_CONFIG) == 4
    assert choose_num_splits(1, 8, 1024, 132, TUNED_DECODE_CONFIG) == 16


# ---- the GEMV kernel ---------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, n, k, config",
    [
        (1, 40, 64, GemvConfig(16, 32, 1, 4, 1)),  # N not a multiple of BLOCK_N
        (3, 64, 128, GemvConfig(16, 32, 4, 4, 1)),  # split-K: the last program of a tile sums
        (16, 32, 96, GemvConfig(32, 32, 2, 4, 1)),  # a full row tile; K uneven for the split
        (5, 48, 80, None),  # the interpreter's default config
        (3, 40, 64, GemvConfig(16, 64, 1, 4, 1, tile=True)),  # one slice of W per program, tl.dot
        (3, 40, 64, GemvConfig(8, 32, 2, 4, 1, tile=True, dot=False)),  # multiply-and-sum, split
        (2, 24, 48, GemvConfig(8, 64, 1, 4, 1, tile=True, dot=False)),  # one slice, K masked
    ],
)
def test_gemv_matches_matmul(dtype, m, n, k, config):
    torch.manual_seed(0)
    x, weight = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    counters = counters_for(n, x.device)
    for _ in range(2):  # the counters are zero again after a call: a second call is right too
        y = gemv(x, weight, counters, config)
        torch.testing.assert_close(y, (x.float() @ weight.float().T).to(dtype), **TOLERANCES[dtype])
    assert not counters.any()


@interpreter
@pytest.mark.parametrize(
    "config",
    [
        None,
        GemvConfig(16, 32, 3, 4, 1, tile=True, dot=False),
        GemvConfig(16, 32, 3, 4, 1, tile=True),
    ],
)
def test_gemv_folds_silu_and_mul_into_its_load(config):
    """x = [gate | up]: the product is silu_and_mul's output (rounded to the dtype) times W."""
    from phase7_optim.kernels.fused import silu_and_mul

    torch.manual_seed(4)
    gate_up, weight = torch.randn(3, 2 * 96).half(), torch.randn(40, 96).half()
    y = gemv(gate_up, weight, counters_for(40, gate_up.device), config, silu_mul=True)
    expected = gemv(silu_and_mul(gate_up), weight, counters_for(40, gate_up.device), config)
    torch.testing.assert_close(y, expected, atol=1e-3, rtol=1e-3)


@interpreter
@pytest.mark.parametrize("m, k", [(1, 4096), (2, 3 * 4096)])
def test_untuned_tile_config_folds_silu_and_mul_across_its_k_split(m, k):
    """The rule's config as Qwen3-8B's down projection runs it (K = 12,288 in 3 slices of 4,096,
    each program reading gate and up K apart), and unsplit at K = 4,096: silu(gate) * up @ W^T
    in half precision (fp32's 1e-5 is below the noise of summing 4,096 products in any order)."""
    dtype = torch.float16
    config = gemv_config_for(m, 16, k, num_sms=132)
    assert config.tile and not config.dot and config.split_k == k // 4096
    torch.manual_seed(5)
    gate_up, weight = torch.randn(m, 2 * k).to(dtype), torch.randn(16, k).to(dtype)
    counters = counters_for(16, gate_up.device)
    y = gemv(gate_up, weight, counters, config, silu_mul=True)
    gate, up = gate_up.float().chunk(2, -1)
    x = (torch.nn.functional.silu(gate) * up).to(dtype).float()  # silu_and_mul's rounding
    torch.testing.assert_close(y, (x @ weight.float().T).to(dtype), **TOLERANCES[dtype])
    assert not counters.any()


@interpreter
@pytest.mark.parametrize("m, k", [(1, 96), (2, 64)])  # 96: one masked slice of 128
def test_gemv_folds_the_residual_add_and_norm_into_its_load(m, k):
    """With add_norm the product is fused_add_rms_norm's output times W, and the new residual
    stream is its sum, in a new tensor: the residual read is left as it was (other programs may
    still be reading it while the first writes the sum)."""
    from phase7_optim.kernels.fused import fused_add_rms_norm
    from phase7_optim.kernels.gemv import add_norm_fits, default_gemv_config

    torch.manual_seed(6)
    x, residual = torch.randn(m, k).half(), torch.randn(m, k).half()
    gain, weight = torch.rand(k) + 0.5, torch.randn(40, k).half()
    config = default_gemv_config(m, 40, k, x.device)
    assert add_norm_fits(config, k)
    before, stream = residual.clone(), torch.full_like(residual, float("nan"))
    y = gemv(x, weight, counters_for(40, x.device), config, add_norm=(residual, gain, 1e-6, stream))
    assert torch.equal(residual, before)
    normed = fused_add_rms_norm(x, before.clone(), gain, 1e-6)
    torch.testing.assert_close(stream, x + before, atol=0, rtol=0)
    expected = gemv(normed, weight, counters_for(40, x.device), config)
    torch.testing.assert_close(y, expected, atol=1e-3, rtol=1e-3)
    assert not add_norm_fits(default_gemv_config(3, 40, k, x.device), k)  # 3 rows: tl.dot
    assert not add_norm_fits(GemvConfig(16, 32, 3, 4, 1, tile=True, dot=False), k)  # K split


@interpreter
def test_gemv_on_tensor_parallel_shards_adds_up_to_the_whole_layer():
    """The slices two ranks hold (QKV: by heads, with its q, k and v pieces; o_proj: by input
    features): each rank's GEMV, concatenated or summed as the collectives would, is the
    unsharded product."""
    torch.manual_seed(1)
    hidden, head_dim, heads, kv_heads = 64, 16, 4, 2
    x = torch.randn(2, hidden)
    qkv = lambda tp: QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp)  # noqa: E731
    whole = qkv(TensorParallel(0, 1)).weight.detach()
    q_kv = torch.split(whole, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    per_rank = []
    for rank in range(2):
        layer = qkv(TensorParallel(rank, 2))
        specs = [layer.shard(shard_id) for shard_id in layer.SHARD_IDS]
        local = torch.cat([w[s.start : s.start + s.size] for w, s in zip(q_kv, specs, strict=True)])
        per_rank.append(gemv(x, local, counters_for(local.shape[0], x.device)))
    pieces = [torch.split(y, [heads * head_dim // 2, head_dim, head_dim], -1) for y in per_rank]
    gathered = torch.cat([torch.cat(part, -1) for part in zip(*pieces, strict=True)], -1)
    torch.testing.assert_close(gathered, x @ whole.T, atol=1e-5, rtol=1e-5)

    o_proj = RowParallelLinear(heads * head_dim, hidden, TensorParallel(0, 1)).weight.detach()
    attn = torch.randn(2, heads * head_dim)
    summed = sum(
        gemv(part, w, counters_for(hidden, x.device))
        for part, w in zip(attn.chunk(2, -1), o_proj.chunk(2, -1), strict=True)
    )  # what the all-reduce adds
    torch.testing.assert_close(summed, attn @ o_proj.T, atol=1e-5, rtol=1e-5)


# ---- one decode step: launches and logits ------------------------------------------------------

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"}


class KernelCounter(TorchDispatchMode):
    """Counts what a GPU would launch: every aten op that computes something (views and bare
    allocations launch nothing) and every Triton kernel. The Triton kernels are counted, not run:
    a step's launches never depend on the values its kernels compute, and the interpreter would
    take seconds (their results are checked by the other tests)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.aten, self.triton = [], []
        from triton.runtime.interpreter import InterpretedFunction

        monkeypatch.setattr(InterpretedFunction, "run", lambda fn, *a, **k: self.triton.append(fn))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.aten.append(name)
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return len(self.aten) + len(self.triton)


TINY = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=96, max_position_embeddings=64)  # fmt: skip
BLOCK_SIZE, WIDTH = 4, 4  # 16 positions a sequence: one split, whatever the heuristic
SEQ_LENS = [5, 9, 1]


def decode_step(model, backend, seqs: int = 3) -> tuple[torch.Tensor, ForwardBatch, tuple]:
    """One decode step of three sequences (or the first `seqs`) over a cache of random (seeded)
    contents."""
    c = model.config
    torch.manual_seed(2)
    cache = KVCache(c.num_layers, 12, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu",
                    backend)  # fmt: skip
    for layer in range(c.num_layers):
        cache.k[layer].normal_(), cache.v[layer].normal_()
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [8, 0, 0, 0]], dtype=torch.int32)[:seqs]
    seq_lens = torch.tensor(SEQ_LENS[:seqs], dtype=torch.int32)
    positions = seq_lens.long() - 1
    slots = tables[torch.arange(seqs), positions // BLOCK_SIZE] * BLOCK_SIZE
    batch = ForwardBatch(
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        slot_mapping=(slots + positions % BLOCK_SIZE).int(),
        block_tables=tables,
        logits_indices=torch.arange(seqs, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=WIDTH * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
    )
    input_ids = torch.tensor([7, 99, 3])[:seqs]
    return cache, batch, (input_ids, positions)


def tiny_model(kernels: KernelConfig, qk_norm: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(0)  # the same weights whatever the levers
    config = ModelConfig(**{**TINY.__dict__, "qk_norm": qk_norm})
    model = Qwen3ForCausalLM(config, kernels=kernels).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not ones: a gain applied in the wrong place shows
                param.uniform_(0.5, 1.5)
    return model


def count_launches(kernels: KernelConfig, monkeypatch, seqs: int = 3) -> int:
    model = tiny_model(kernels)
    cache, batch, (input_ids, positions) = decode_step(model, TritonAttention(), seqs)
    with torch.inference_mode(), KernelCounter(monkeypatch) as counter:
        model(input_ids, positions, batch, cache)  # first call: the GEMV's counters are made
        counter.aten.clear(), counter.triton.clear()
        model(input_ids, positions, batch, cache)
    return counter.launches


@interpreter
def test_each_lever_removes_the_launches_it_fuses(monkeypatch):
    on = KernelConfig(interpret_on_cpu=True)
    layers = TINY.num_layers
    baseline = count_launches(on, monkeypatch)
    off = lambda **lever: count_launches(KernelConfig(interpret_on_cpu=True, **lever), monkeypatch)  # noqa: E731
    assert off(fuse_add_rms_norm=False) == baseline + 2 * layers  # an add beside each norm
    assert off(fuse_rope_kv_store=False) == baseline + 2 * layers  # q rope, k rope, store: 3 -> 1
    assert off(tune_decode_attention=False) == baseline + layers  # the merge of a single split
    assert off(gemv_max_batch=0) == baseline + layers  # a matmul for a GEMV, and SiLU's kernel
    assert off(fuse_silu_into_gemv=False) == baseline + layers  # SiLU-and-mul in down's GEMV
    assert off(programmatic_launch=False) == baseline  # how kernels start, not how many
    assert off(fold_norm_into_gemv=False) == baseline  # 3 rows: tl.dot, no norm in the GEMV


@interpreter
@pytest.mark.parametrize("seqs", [1, 2])
def test_at_one_or_two_rows_the_norms_go_into_the_gemvs(seqs, monkeypatch):
    """Every norm after a residual add (all but layer 0's first) is computed by the QKV or
    gate_up GEMV that reads it: one launch fewer each."""
    count = lambda **lever: count_launches(  # noqa: E731
        KernelConfig(interpret_on_cpu=True, **lever), monkeypatch, seqs
    )
    assert count(fold_norm_into_gemv=False) == count() + 2 * TINY.num_layers - 1


@interpreter
@pytest.mark.parametrize(
    "qk_norm, seqs",  # Qwen3, Llama (the fused kernel's norm off); at 2 rows the norms in the GEMVs
    [(True, 3), (False, 3), (True, 2)],
)
def test_decode_step_with_every_lever_equals_the_torch_path(qk_norm, seqs):
    results = []
    for kernels, backend in (
        (KernelConfig(interpret_on_cpu=True), TritonAttention()),
        (KernelConfig(), TorchAttention()),
    ):
        model = tiny_model(kernels, qk_norm)
        cache, batch, (input_ids, positions) = decode_step(model, backend, seqs)
        with torch.inference_mode():
            logits = model(input_ids, positions, batch, cache)
        results.append((logits, cache))
    (logits, cache), (expected, expected_cache) = results
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    for layer in range(TINY.num_layers):  # the fused store wrote this step's K/V where torch did
        for ours, theirs in ((cache.k, expected_cache.k), (cache.v, expected_cache.v)):
            torch.testing.assert_close(ours[layer], theirs[layer], atol=1e-5, rtol=1e-5)


# ---- GPU: the H200 -----------------------------------------------------------------------------

QWEN3_0_6B_LINEARS = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
TP2_SHARDS = [(2048, 1024), (1024, 1024), (3072, 1024), (1024, 1536)]  # one rank's of two


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n, k", QWEN3_0_6B_LINEARS + TP2_SHARDS)
def test_gpu_gemv_in_bf16(m, n, k):
    """Against the fp32 product, as closely as cuBLAS's own bf16 result is."""
    torch.manual_seed(3)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    counters = counters_for(n, x.device)
    expected = x.float() @ weight.float().T
    cublas_error = (torch.nn.functional.linear(x, weight).float() - expected).abs().max()
    for _ in range(2):
        error = (gemv(x, weight, counters).float() - expected).abs().max()
        assert error <= 2 * cublas_error + 1e-3, f"{error:.2e} vs cuBLAS {cublas_error:.2e}"
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n, k", [(4096, 1024), (6144, 1024), (1024, 4096)])  # qkv, gate_up, 8B's
def test_gpu_gemv_folds_the_add_and_norm_on_every_program(m, n, k):
    """The H200's configs for QKV and gate_up (and the untuned rule's at K 4,096), hundreds of
    programs racing: each computes the norm itself, one writes the stream, none reads it back."""
    from phase7_optim.kernels.fused import fused_add_rms_norm
    from phase7_optim.kernels.gemv import add_norm_fits, default_gemv_config

    torch.manual_seed(7)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, residual = torch.randn(m, k, **bf16), torch.randn(m, k, **bf16)
    gain, weight = torch.rand(k, **bf16) + 0.5, torch.randn(n, k, **bf16) * k**-0.5
    assert add_norm_fits(default_gemv_config(m, n, k, x.device), k)
    before = residual.clone()
    counters = counters_for(n, x.device)
    for _ in range(3):
        stream = torch.full_like(residual, float("nan"))
        y = gemv(x, weight, counters, add_norm=(residual, gain, 1e-6, stream))
        torch.cuda.synchronize()
        assert torch.equal(residual, before) and torch.equal(stream, x + before)
        normed = fused_add_rms_norm(x, before.clone(), gain, 1e-6)
        torch.testing.assert_close(y, gemv(normed, weight, counters), atol=2e-2, rtol=2e-2)
