"""Qwen3.5 in phase 7: the hybrid model on the fast engine. The torch path and the Triton kernels
(run by the interpreter on CPU) against transformers, the engine's state slots through chunked
prefill, preemption and aborts, the memory budget that counts the state pool, and what one GPU
cannot do (tensor parallelism). The kernels themselves: test_gated_delta_kernels.py."""

import dataclasses
import logging

import pytest
import torch

from phase7_optim import LLM, SamplingParams
from phase7_optim.attention import ForwardBatch
from phase7_optim.config import EngineConfig, KernelConfig
from phase7_optim.engine import LLMEngine
from phase7_optim.kv_cache import KVCache
from phase7_optim.kv_cache_config import (
    MemoryProfile,
    kv_block_bytes,
    num_blocks_from_memory,
    state_pool_bytes,
)
from phase7_optim.loader import load_model
from phase7_optim.qwen3_5 import Qwen3_5Config
from phase7_optim.state_pool import StatePool
from phase7_optim.tokenizer import Tokenizer
from tests import hybrid
from tests.tolerances import HF_MIN_MARGIN, assert_no_near_tie

MAX_TOKENS = 32
GiB = 2**30
# float32 on CPU. Phase 7 stacks in_proj_qkv/z/b/a and q/k/v into one matmul each, which orders
# MKL's reductions differently from transformers' separate ones (~1e-6 a product); the tiny
# random model (init 0.2) carries that through three DeltaNet layers to <= 5e-4 in its logits.
# The greedy paths compared are won by more than twice that (HF_MIN_MARGIN).
HYBRID_ATOL = 1e-3


def interpreted() -> KernelConfig:
    """The Triton kernels on CPU tensors (tests/conftest.py switches the interpreter on), all but
    the GEMV: interpreted over the 151,936-row LM head it took 90 % of these tests' time (~80 s),
    and tests/phase7/test_levers.py checks it on its own."""
    return KernelConfig(interpret_on_cpu=True, gemv_max_batch=0)


@pytest.fixture(scope="module")
def hf_model():
    return hybrid.tiny_qwen3_5()


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, qwen3_tokenizer_dir):
    return hybrid.save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory, qwen3_tokenizer_dir):
    directory = tmp_path_factory.mktemp("qwen3_5-published")
    return hybrid.save_tiny_qwen3_5(directory, qwen3_tokenizer_dir, layout="published")


@pytest.fixture(scope="module")
def prompts():
    return hybrid.prompts_of_lengths()


@pytest.fixture(scope="module")
def oracle(hf_model, prompts):
    refs = hybrid.greedy_continuations(hf_model, prompts, MAX_TOKENS)
    for prompt, ref in zip(prompts, refs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1]
        assert_no_near_tie(logits, HF_MIN_MARGIN)
    return refs


def forward_in_pieces(model, ids: list[int], pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Logits of every position, the sequence fed as chunked prefill feeds it (one-token pieces
    are decode steps), continuing from state slot 1 and a 16-token-block KV cache."""
    c, block_size = model.config, 16
    num_blocks = -(-len(ids) // block_size)
    kv = KVCache(c.num_attention_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                 torch.float32, "cpu")  # fmt: skip
    pool = StatePool(c.state_shape, c.num_deltanet_layers, 2, torch.float32, "cpu")
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = []
    for start, end in pieces:
        n = end - start
        batch = ForwardBatch(
            query_start_loc=i32([0, n]), seq_lens=i32([end]),
            slot_mapping=i32(list(range(start, end))),
            block_tables=i32([list(range(num_blocks))]), logits_indices=i32(list(range(n))),
            max_query_len=n, max_seq_len=end, block_size=block_size,
            num_decodes=int(n == 1), decode_order=i32([0]) if n == 1 else None,
            state_slots=i32([1]),
        )  # fmt: skip
        with torch.inference_mode():
            out.append(model(torch.tensor(ids[start:end]), torch.arange(start, end), batch, kv,
                             pool))  # fmt: skip
    return torch.cat(out)


# The interpreter runs each kernel in Python: it gets a short sequence whose pieces still cover a
# prefill, a continued chunk and a decode step (the kernels' own tests cover the 64-token chunk
# boundary).
CASES = {
    "torch": (KernelConfig, 70, ([(0, 70)], [(0, 64), (64, 69), (69, 70)])),
    "triton-interpreted": (interpreted, 20, ([(0, 16), (16, 19), (19, 20)],)),
}


@pytest.mark.parametrize(
    "path, layout", [("torch", "text"), ("torch", "published"), ("triton-interpreted", "text")]
)
def test_logits_equal_transformers(path, layout, qwen3_5_dir, published_dir, hf_model, caplog):
    kernels, length, all_pieces = CASES[path]
    directory = qwen3_5_dir if layout == "text" else published_dir
    with caplog.at_level(logging.INFO):
        loaded = load_model(directory, kernels=kernels())
    assert isinstance(loaded.config, Qwen3_5Config)
    if layout == "published":
        assert "skipped 2 checkpoint tensors outside the text model" in caplog.text
    ids = hybrid.prompts_of_lengths([length])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    for pieces in all_pieces:
        got = forward_in_pieces(loaded.model, ids, pieces)
        torch.testing.assert_close(got, ref, atol=HYBRID_ATOL, rtol=0)


def test_greedy_tokens_equal_transformers(qwen3_5_dir, prompts, oracle, caplog):
    with caplog.at_level(logging.INFO):
        llm = LLM(qwen3_5_dir)
    assert "prefix caching is off for this hybrid model" in caplog.text
    assert "state pool: " in caplog.text
    assert not llm.engine.block_manager.enable_prefix_caching
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle


@pytest.mark.parametrize("fuse_store", [True, False], ids=["one-kernel", "rope-then-store"])
def test_gated_attention_kernels_equal_its_torch_ops(fuse_store, qwen3_5_dir):
    """On CUDA the gated attention's q/k norms (gain 1 + w), partial RoPE (8 of 32 dims) and KV
    store are one kernel and its sigmoid gate another (kernels/fused.py); interpreted on CPU
    they give what the torch ops give: the output, the cache at the written slots, padded rows
    (PAD_SLOT_ID) and every other slot untouched."""
    from phase7_optim.kernels import PAD_SLOT_ID

    torch_attn = load_model(qwen3_5_dir).model.model.layers[3].self_attn
    kernels = KernelConfig(interpret_on_cpu=True, fuse_rope_kv_store=fuse_store)
    kernel_attn = load_model(qwen3_5_dir, kernels=kernels).model.model.layers[3].self_attn
    with torch.no_grad():  # gains away from 1 + 0: an offset applied twice, or not, shows
        for norm in ("q_norm", "k_norm"):
            getattr(torch_attn, norm).weight.uniform_(-0.5, 0.5)
            getattr(kernel_attn, norm).weight.copy_(getattr(torch_attn, norm).weight)
    c, block_size = load_model(qwen3_5_dir).config, 4
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    # Two sequences: a 3-token prefill, and a 2-token chunk at positions 4-5 (its first four
    # tokens' junk stands in for their cached keys in block 2).
    batch = ForwardBatch(
        query_start_loc=i32([0, 3, 5]), seq_lens=i32([3, 6]),
        slot_mapping=i32([0, 1, 2, 12, 13]), block_tables=i32([[0, 1], [2, 3]]),
        logits_indices=i32([2, 4]), max_query_len=3, max_seq_len=6, block_size=block_size,
    )  # fmt: skip
    positions = torch.tensor([0, 1, 2, 4, 5])
    torch.manual_seed(3)
    x = torch.randn(5, c.hidden_size)
    caches = []
    for attn in (torch_attn, kernel_attn):
        torch.manual_seed(4)  # the same junk in both caches
        kv = KVCache(1, 4, block_size, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        kv.k[0].normal_(), kv.v[0].normal_()
        with torch.inference_mode():
            out = attn(x, positions, batch, kv)
        caches.append((out, kv.k[0].clone(), kv.v[0].clone()))
    (out, k, v), (kernel_out, kernel_k, kernel_v) = caches
    torch.testing.assert_close(kernel_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_k, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_v, v, atol=1e-5, rtol=1e-5)  # the GEMV rounds its own way

    # A row with slot PAD_SLOT_ID (a CUDA graph's padding) writes neither cache: every slot but
    # the four written keeps its junk (-1 must not index the last slot, on either store path).
    written = [0, 1, 2, 12]
    padded = dataclasses.replace(batch, slot_mapping=i32([*written, PAD_SLOT_ID]))
    torch.manual_seed(4)
    kv = KVCache(1, 4, block_size, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    kv.k[0].normal_(), kv.v[0].normal_()
    junk = kv.k[0].flatten(0, 1).clone(), kv.v[0].flatten(0, 1).clone()
    with torch.inference_mode():
        kernel_attn(x, positions, padded, kv)
    untouched = [slot for slot in range(4 * block_size) if slot not in written]
    assert torch.equal(kv.k[0].flatten(0, 1)[untouched], junk[0][untouched])
    assert torch.equal(kv.v[0].flatten(0, 1)[untouched], junk[1][untouched])


def test_offset_norm_kernels_equal_the_torch_norm(qwen3_5_dir):
    """OffsetRMSNorm's kernels add the 1 of the gain 1 + w themselves (no torch launches):
    alone, and fused with the residual add."""
    from phase7_optim.qwen3_5 import OffsetRMSNorm

    torch.manual_seed(5)
    torch_norm = OffsetRMSNorm(64, 1e-6)
    kernel_norm = OffsetRMSNorm(64, 1e-6, KernelConfig(interpret_on_cpu=True))
    with torch.no_grad():
        torch_norm.weight.uniform_(-0.5, 0.5)
        kernel_norm.weight.copy_(torch_norm.weight)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    torch.testing.assert_close(kernel_norm(x), torch_norm(x), atol=1e-5, rtol=1e-5)
    out, stream = torch_norm(x, residual.clone())
    kernel_out, kernel_stream = kernel_norm(x, residual.clone())
    assert torch.equal(kernel_stream, stream)
    torch.testing.assert_close(kernel_out, out, atol=1e-5, rtol=1e-5)


def run_checked(engine, prompts, params) -> tuple[list[list[int]], int]:
    """Runs every prompt to the end, checking scheduler and pool after each step ->
    (token ids per prompt, preemptions seen)."""
    schedule, preempted = engine.scheduler.schedule, []

    def counted():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    engine.scheduler.schedule = counted
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    engine.runner.state_pool.check_invariants(set())
    return [done[i] for i in ids], len(preempted)


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=48, num_kv_blocks=16, max_num_seqs=4),
        dict(max_num_batched_tokens=32, num_kv_blocks=16, max_num_seqs=4,
             preemption_mode="swap", num_cpu_kv_blocks=64),
    ],
    ids=["recompute", "swap"],
)  # fmt: skip
def test_chunked_prefill_and_preemption_give_identical_tokens(
    settings, qwen3_5_dir, prompts, oracle
):
    engine = LLM(qwen3_5_dir, **settings).engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, preempted = run_checked(engine, prompts, params)
    assert preempted > 0, "the settings no longer force a preemption"
    assert tokens == oracle


def test_the_kernels_run_the_engine_through_chunks_and_decodes(qwen3_5_dir, hf_model):
    """The Triton path (interpreted) through the real engine: conv and rule kernels by slot,
    a prompt chunked beside another's decodes (a mixed step), then decode steps."""
    prompts = hybrid.prompts_of_lengths([3, 20])
    refs = hybrid.greedy_continuations(hf_model, prompts, 3)
    loaded = load_model(qwen3_5_dir, kernels=interpreted())
    config = EngineConfig(max_num_batched_tokens=12, max_num_seqs=2)
    engine = LLMEngine(loaded.model, Tokenizer.from_dir(qwen3_5_dir), config)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens, _ = run_checked(engine, prompts, params)
    assert tokens == refs


def test_aborts_give_every_slot_back_and_the_engine_still_answers(qwen3_5_dir, prompts, oracle):
    llm = LLM(qwen3_5_dir, max_num_batched_tokens=64, max_num_seqs=3)
    engine, pool = llm.engine, llm.engine.runner.state_pool
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert pool.slots, "nothing was running when the aborts came"
    for i in ids:
        engine.abort_request(i)
    while engine.has_unfinished_requests():  # a step in flight (overlap) completes first
        engine.step()
    pool.check_invariants(set())
    assert sorted(pool.free_slots) == [0, 1, 2]
    outs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle[:3]


def test_the_gpu_budget_counts_the_state_pool_before_the_blocks(qwen3_5_dir):
    loaded = load_model(qwen3_5_dir)
    config = EngineConfig(max_num_seqs=8).for_device("cpu")
    c = loaded.config
    per_slot = c.num_deltanet_layers * c.state_shape.bytes_per_slot(torch.float32)
    assert state_pool_bytes(loaded.model, config) == 8 * per_slot
    block = kv_block_bytes(loaded.model, 16, torch.float32)
    assert block == 16 * 2 * c.num_attention_layers * c.num_kv_heads * c.head_dim * 4
    profile = MemoryProfile(total_bytes=100 * GiB, weights_bytes=10 * GiB,
                            peak_activation_bytes=5 * GiB, other_bytes=2 * GiB)  # fmt: skip
    without = num_blocks_from_memory(profile, 0.9, block)
    with_pool = num_blocks_from_memory(profile, 0.9, block, state_bytes=GiB)
    assert without - with_pool == GiB // block
    with pytest.raises(ValueError, match="the state pool 74.00"):
        num_blocks_from_memory(profile, 0.9, block, state_bytes=74 * GiB)


def test_tensor_parallelism_is_refused_before_any_worker_starts(qwen3_5_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM(qwen3_5_dir, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_greedy_tokens_equal_transformers(enforce_eager, qwen3_5_dir, prompts, oracle):
    """On the GPU every DeltaNet step runs the kernels (decode steps inside CUDA graphs, their
    padded rows on PAD_SLOT_ID), float32 so the comparison with transformers' CPU tokens holds."""
    llm = LLM(qwen3_5_dir, dtype="float32", max_num_batched_tokens=48, max_num_seqs=4,
              num_kv_blocks=16, enforce_eager=enforce_eager)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, preempted = run_checked(llm.engine, prompts, params)
    assert preempted > 0
    assert tokens == oracle


@pytest.mark.gpu
def test_gpu_gated_attention_kernels_at_0_8b_heads():
    """Qwen3.5-0.8B's attention heads (8 q and 2 KV of 256, RoPE on the first 64 dims, q/k gains
    1 + w, the sigmoid gate) in bf16 on the GPU, against the torch ops in fp32 on the CPU."""
    from phase7_optim.kernels.fused import qk_norm_rope_store, sigmoid_gate_mul
    from phase7_optim.qwen3_5 import OffsetRMSNorm
    from phase7_optim.rope import RotaryEmbedding

    from .test_kernels import relative_error

    torch.manual_seed(8)
    tokens, heads, kv_heads, head_dim, rotary_dim, eps = 200, 8, 2, 256, 64, 1e-6
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * head_dim)
    norms = [OffsetRMSNorm(head_dim, eps) for _ in range(2)]
    for norm in norms:
        torch.nn.init.uniform_(norm.weight, -0.5, 0.5)
    rotary = RotaryEmbedding(rotary_dim, 32768, 1e7)
    positions = torch.randint(0, 32768, (tokens,))

    def reference(x, norm):
        x = norm(x)
        return torch.cat((rotary(x[..., :rotary_dim], positions), x[..., rotary_dim:]), dim=-1)

    def views(qkv):  # strided, as the model's split of its gated qkv projection makes them
        q_gate, k, v = qkv.split(
            [2 * heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
        )
        q, gate = q_gate.view(tokens, heads, 2 * head_dim).chunk(2, dim=-1)
        return q, gate, k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)

    q, gate, k, v = views(qkv)
    gpu_q, gpu_gate, gpu_k, gpu_v = views(qkv.cuda().bfloat16())
    gains = [norm.weight.detach().cuda().bfloat16() for norm in norms]
    slot_mapping = torch.randperm(32 * 16, device="cuda")[:tokens].int()
    k_cache = torch.zeros(32, 16, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q_out = qk_norm_rope_store(gpu_q, gpu_k, gpu_v, *gains, rotary.cos.cuda(), rotary.sin.cuda(),
                               positions.cuda(), eps, k_cache, v_cache, slot_mapping,
                               offset=True)  # fmt: skip
    slots = slot_mapping.long()
    with torch.no_grad():
        assert relative_error(q_out.cpu(), reference(q, norms[0])) < 1e-2
        stored_k = k_cache.view(-1, kv_heads, head_dim)[slots].cpu()
        assert relative_error(stored_k, reference(k, norms[1])) < 1e-2
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], gpu_v)
    out = torch.randn(tokens, heads * head_dim)
    gated = sigmoid_gate_mul(out.cuda().bfloat16(), gpu_gate)
    assert relative_error(gated.cpu(), out * torch.sigmoid(gate.reshape(tokens, -1))) < 1e-2
