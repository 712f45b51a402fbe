"""An fp8 KV cache (`kv_cache_dtype="fp8"`): what is stored, what the kernels read, what it buys.

Writers (the KV-store kernel, the fused q/k-norm + RoPE + store kernel, the torch path) must store
the same bytes: the value saturated to +-448 and rounded to nearest even, which is torch's cast
after a clamp. Readers (both attention kernels, the torch path) widen fp8 back and compute as
before, so against the fp32 reference over the same fp8 cache they are as close as with a bf16
cache. The engine halves (from bf16) or quarters (from fp32) a block's bytes, so a budget holds
that many times the blocks.
"""

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim import LLM, EngineConfig, SamplingParams  # noqa: E402
from phase7_optim.attention_backend import TorchAttention, TritonAttention  # noqa: E402
from phase7_optim.config import KernelConfig  # noqa: E402
from phase7_optim.kernels import (  # noqa: E402
    FP8_E4M3_MAX,
    PAD_SLOT_ID,
    store_kvcache,
    store_kvcache_ref,
)
from phase7_optim.kernels.fused import qk_norm_rope_store  # noqa: E402
from phase7_optim.kernels.paged_decode import (  # noqa: E402
    BASELINE_DECODE_CONFIG,
    FEW_SEQS_DECODE_CONFIG,
    TUNED_DECODE_CONFIG,
    TUNED_FP8_DECODE_CONFIG,
    default_decode_config,
)
from phase7_optim.loader import load_model  # noqa: E402
from phase7_optim.rope import RotaryEmbedding  # noqa: E402
from tests import hybrid  # noqa: E402

from .conftest import logits_of  # noqa: E402
from .test_fused import EPS, qkv_views, random_norm, torch_norm_rope  # noqa: E402
from .test_kernels import (  # noqa: E402
    CPU,
    CUDA,
    MERGING,
    check_decode,
    check_prefill,
    make_paged_batch,
)
from .test_levers import TINY, decode_step, tiny_model  # noqa: E402
from .test_swap import NUM_KV_BLOCKS  # noqa: E402
from .test_swap import run as swap_run  # noqa: E402

FP8 = torch.float8_e4m3fn
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)


def every_finite_bf16() -> torch.Tensor:
    """All 63,488 finite bfloat16 values (every bit pattern but inf and NaN), as (T, 16, 16)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    return x[: x.numel() // 256 * 256].view(-1, 16, 16)


# Values where a cast goes wrong: ties (1.5625 lies between 1.5 and 1.625), a carry into the
# exponent (1.97 -> 2), subnormals (below 2^-6, steps of 2^-9), past the largest value, infinities.
EDGES = [1.5625, 1.6875, 1.9473, -7.8851, 2**-10, 3 * 2**-11, 1.0625 * 2**-7, 447.9, 464.0, 500.0,
         -1e30, float("inf"), -float("inf"), 0.0]  # fmt: skip


def store_both(x: torch.Tensor, device=CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H, D) through the kernel and the reference into fp8 caches of one slot a block."""
    caches = [torch.zeros(x.shape[0], 1, *x.shape[1:], dtype=FP8, device=device) for _ in range(4)]
    slots = torch.arange(x.shape[0], device=device)
    store_kvcache(x, x, caches[0], caches[1], slots)
    store_kvcache_ref(x, x, caches[2], caches[3], slots)
    assert torch.equal(caches[0].float(), caches[1].float())  # keys and values alike
    return caches[0], caches[2]


def test_the_reference_store_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1.5625, 1.6875, 1.97, 500.0, -float("inf"), 2**-10]).view(-1, 1, 1)
    x = x.expand(-1, 1, 16).contiguous()
    k, v = (torch.zeros(6, 1, 1, 16, dtype=FP8) for _ in range(2))
    store_kvcache_ref(x, x, k, v, torch.arange(6))
    # ties to the even mantissa (1.5, 1.75), the carry, +-448 not NaN, 2^-10 a tie down to 0
    assert k[:, 0, 0, 0].float().tolist() == [1.5, 1.75, 2.0, 448.0, -448.0, 0.0]


@interpreter
def test_the_store_kernel_writes_every_bf16_value_as_the_reference_does():
    ours, reference = store_both(every_finite_bf16())
    assert torch.equal(ours.float(), reference.float())  # by value: -0.0 may come out as 0.0


@interpreter
def test_the_store_kernel_rounds_the_edges_of_fp32_as_the_reference_does():
    ours, reference = store_both(torch.tensor(EDGES).view(-1, 1, 1).expand(-1, 1, 16).contiguous())
    assert torch.equal(ours.float(), reference.float())
    assert ours.float().abs().max() == FP8_E4M3_MAX


def fp8_batch(q_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, device, scale=1.0):
    """make_paged_batch with fp8 caches (values times `scale` first, so some saturate)."""
    batch = make_paged_batch(
        q_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, device
    )
    batch.k_cache = (batch.k_cache.float() * scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    batch.v_cache = (batch.v_cache.float() * scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return batch


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_reads_an_fp8_cache(dtype):
    batch = fp8_batch([1] * 4, [0, 36, 99, 150], 4, 2, 32, dtype, CPU)
    check_decode(batch, None)  # one split, the output written directly
    check_decode(batch, 3, MERGING)


@interpreter
def test_decode_attention_reads_an_fp8_cache_with_its_own_tile():
    batch = fp8_batch([1] * 4, [0, 36, 99, 150], 4, 2, 32, torch.float32, CPU)
    check_decode(batch, None, TUNED_FP8_DECODE_CONFIG)
    check_decode(batch, 3, TUNED_FP8_DECODE_CONFIG)


def test_an_fp8_cache_gets_its_own_decode_tile_from_16_sequences():
    """On CUDA a batch of 16 or more decodes over an fp8 cache runs the 2-warp, 32-key tile (the
    instructions bound it there); fewer, a bf16 cache or the untuned lever keep theirs (a bf16
    cache with fewer than 16 loads its first key tile early)."""
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert default_decode_config(cuda, True, FP8, 16) == TUNED_FP8_DECODE_CONFIG
    assert default_decode_config(cuda, True, FP8, None) == TUNED_FP8_DECODE_CONFIG
    assert default_decode_config(cuda, True, FP8, 15) == TUNED_DECODE_CONFIG
    for num_seqs in (1, 15):
        assert default_decode_config(cuda, True, torch.bfloat16, num_seqs) == FEW_SEQS_DECODE_CONFIG
    assert FEW_SEQS_DECODE_CONFIG == replace(TUNED_DECODE_CONFIG, early_loads=True)
    assert not TUNED_DECODE_CONFIG.early_loads and not TUNED_FP8_DECODE_CONFIG.early_loads
    assert default_decode_config(cuda, True, torch.bfloat16, 256) == TUNED_DECODE_CONFIG
    assert default_decode_config(cuda, False, FP8, 256) == BASELINE_DECODE_CONFIG


def test_early_decode_loads_only_for_narrow_heads_and_outputs():
    """Qwen3-0.6B's 16 heads of 128 load their first key tile before the wait; Qwen3.5's
    256-wide heads (registers spill) and Qwen3-8B's 32 heads (measured slower) do not."""
    from phase7_optim.kernels.paged_decode import early_loads_apply

    assert early_loads_apply(FEW_SEQS_DECODE_CONFIG, 16, 128)
    assert not early_loads_apply(FEW_SEQS_DECODE_CONFIG, 8, 256)
    assert not early_loads_apply(FEW_SEQS_DECODE_CONFIG, 32, 128)
    assert not early_loads_apply(TUNED_DECODE_CONFIG, 16, 128)


@interpreter
def test_prefill_attention_reads_an_fp8_cache():
    batch = fp8_batch([16, 9, 30], [32, 45, 7], 4, 2, 32, torch.float32, CPU)
    check_prefill(batch)


@interpreter
@pytest.mark.parametrize("qk_norm", [True, False])
def test_the_fused_store_writes_the_bytes_the_unfused_path_writes(qk_norm):
    torch.manual_seed(6)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim)
    v = v * 300  # some of v past 448: saturated, not NaN
    rotary = RotaryEmbedding(head_dim, 100, 1e6)
    positions = torch.tensor([0, 1, 7, 50, 99, 3])
    slot_mapping = torch.tensor([5, PAD_SLOT_ID, 0, 23, PAD_SLOT_ID, 9], dtype=torch.int32)
    q_norm, k_norm = (random_norm(head_dim), random_norm(head_dim)) if qk_norm else (None, None)
    k_cache = torch.randn(6, 4, kv_heads, head_dim).to(FP8)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(FP8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qk_norm_rope_store(
        q, k, v, q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None,
        rotary.cos, rotary.sin, positions, EPS, k_cache, v_cache, slot_mapping,
    )  # fmt: skip
    k_rotated = torch_norm_rope(k, k_norm, rotary, positions)
    store_kvcache_ref(k_rotated, v.contiguous(), k_ref, v_ref, slot_mapping)
    assert torch.equal(v_cache.float(), v_ref.float())
    assert v_cache.float().abs().max() == FP8_E4M3_MAX
    # k: the kernel's fp32 rotation and torch's differ in the last bit, which may tip a value
    # lying on a rounding boundary by one fp8 step; anything else is a wrong store
    differ = k_cache.float() != k_ref.float()
    assert differ.sum() <= 2, f"{int(differ.sum())} keys differ"
    torch.testing.assert_close(k_cache.float(), k_ref.float(), rtol=0.07, atol=2**-9)


@interpreter
def test_a_decode_step_on_an_fp8_cache_equals_the_torch_path():
    """Every lever on (the fused store, the GEMVs, the tuned decode kernel) against the torch
    backend over the same fp8 cache: the same logits, the same bytes stored."""
    results = []
    for kernels, backend in (
        (KernelConfig(interpret_on_cpu=True), TritonAttention()),
        (KernelConfig(), TorchAttention()),
    ):
        model = tiny_model(kernels)
        cache, batch, (input_ids, positions) = decode_step(model, backend)
        for pool in cache.k + cache.v:  # the same random contents, in fp8
            pool.data = pool.to(FP8)
        with torch.inference_mode():
            logits = model(input_ids, positions, batch, cache)
        results.append((logits, cache))
    (logits, cache), (expected, expected_cache) = results
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    for layer in range(TINY.num_layers):
        assert cache.k[layer].dtype == FP8
        torch.testing.assert_close(cache.k[layer].float(), expected_cache.k[layer].float(),
                                   rtol=0.07, atol=2**-9)  # fmt: skip
        assert torch.equal(cache.v[layer].float(), expected_cache.v[layer].float())


def tiny_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, kv_cache_memory_bytes=2**20, max_num_seqs=4, **kwargs)


def test_an_fp8_cache_holds_four_times_the_blocks_of_an_fp32_one(tiny_qwen3_tied_dir):
    fp32, fp8 = tiny_llm(tiny_qwen3_tied_dir), tiny_llm(tiny_qwen3_tied_dir, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.k[0].dtype == FP8
    assert fp32.engine.runner.kv_cache.k[0].dtype == torch.float32
    blocks = [llm.engine.kv_cache_config.num_blocks for llm in (fp32, fp8)]
    assert blocks[1] == 4 * blocks[0]
    assert fp8.engine.runner.kv_cache.k[0].shape[0] == blocks[1]


def test_an_engine_on_an_fp8_cache_picks_what_the_exact_model_ranks_first(tiny_qwen3_tied_dir):
    """Greedy through the engine (prefill, prefix caching, decode steps reading the fp8 cache
    back), then the fp32 model teacher-forced over the result: each token the fp8 engine chose
    must be the exact model's first choice or within a rounding error of it. The random tiny
    checkpoint has near-ties, where fp8's per-element error (up to 1/16) may tip the choice and
    the rest of the sequence with it, so a token-for-token comparison would test the seed."""
    prompts = [[151643, 9707, 11, 1879], [151643, 785, 6722, 315, 9625, 374], [151643] * 40,
               list(range(1000, 1100))]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = tiny_llm(tiny_qwen3_tied_dir, kv_cache_dtype="fp8")
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    exact = load_model(tiny_qwen3_tied_dir).model
    gaps, spread = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        logits = logits_of(exact, torch.tensor([prompt + output]))[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
        gaps.append(logits.max(-1).values - chosen)  # 0 where fp8 chose what fp32 would
        spread.append(logits.std())
    gaps, spread = torch.cat(gaps), torch.stack(spread).mean()
    assert (gaps == 0).float().mean() > 0.8, gaps
    assert gaps.max() < 0.25 * spread and gaps.mean() < 0.02 * spread, (gaps, spread)


def test_swapped_fp8_blocks_come_back_as_they_left(tiny_qwen3_tied_dir):
    """Swap preemption copies fp8 blocks to a CPU pool of the same dtype and back: under a tight
    cache the tokens are those of an unpressured fp8 run."""
    unpressured, preemptions, _ = swap_run(tiny_qwen3_tied_dir, kv_cache_dtype="fp8")
    assert preemptions == 0
    tokens, preemptions, swapped = swap_run(
        tiny_qwen3_tied_dir, kv_cache_dtype="fp8", num_kv_blocks=NUM_KV_BLOCKS,
        preemption_mode="swap", num_cpu_kv_blocks=32,
    )  # fmt: skip
    assert swapped and preemptions > 0
    assert tokens == unpressured


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, qwen3_tokenizer_dir):
    return hybrid.save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), qwen3_tokenizer_dir)


def test_a_hybrid_model_keeps_its_state_pool_in_the_model_dtype(qwen3_5_dir):
    """Qwen3.5: only its attention layers' keys and values go to fp8; the Gated DeltaNet state
    (read and rewritten every step) stays as it was."""
    llm = LLM(qwen3_5_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=2**20, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.kv_cache.k[0].dtype == FP8 and runner.state_pool.conv[0].dtype == torch.float32
    out = llm.generate([[151643, 9707, 11, 1879]] * 2, SamplingParams(temperature=0.0,
                       max_tokens=6, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids


@pytest.mark.parametrize("value", ["fp8_e5m2", "float8", "bf16", None, 8])
def test_an_unknown_kv_cache_dtype_is_refused_with_the_known_ones(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'"):
        EngineConfig(kv_cache_dtype=value)


def test_vllms_kv_cache_dtype_argument_is_accepted():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_store_kernel_writes_every_bf16_value_as_the_reference_does():
    ours, reference = store_both(every_finite_bf16().to(CUDA), CUDA)
    assert torch.equal(ours.float(), reference.float())


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_attention_reads_an_fp8_cache(head_dim):
    decode = fp8_batch([1] * 5, [0, 15, 1000, 4999, 32000], 16, 8, head_dim, torch.bfloat16, CUDA)
    check_decode(decode, None)
    check_decode(decode, 1)
    check_decode(decode, None, TUNED_FP8_DECODE_CONFIG)  # the tile of 16 and more sequences
    prefill = fp8_batch([1, 333, 1030], [0, 517, 17], 16, 8, head_dim, torch.bfloat16, CUDA)
    check_prefill(prefill)


@pytest.mark.gpu
def test_gpu_engine_on_an_fp8_cache(tiny_qwen3_tied_dir):
    llm = LLM(tiny_qwen3_tied_dir, kv_cache_dtype="fp8", dtype="bfloat16")
    out = llm.generate([[151643] * 30] * 3,
                       SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))  # fmt: skip
    assert llm.engine.runner.kv_cache.k[0].dtype == FP8
    assert all(len(o.outputs[0].token_ids) == 20 for o in out)
    assert len({tuple(o.outputs[0].token_ids) for o in out}) == 1  # the same prompt, greedy
