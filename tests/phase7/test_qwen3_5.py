"""Qwen3.5 in phase 7: the hybrid model on the fast engine. The torch path and the Triton kernels
(run by the interpreter on CPU) against transformers, the engine's state slots through chunked
prefill, preemption and aborts, the memory budget that counts the state pool, and what one GPU
cannot do (tensor parallelism). The kernels themselves: test_gated_delta_kernels.py."""

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
    """The Triton kernels on CPU tensors (tests/conftest.py switches the interpreter on)."""
    return KernelConfig(interpret_on_cpu=True)


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


# The interpreter is slow (~1 s a kernel launch at these shapes): it gets a short sequence whose
# pieces still cover a prefill, a continued chunk and a decode step (the kernels' own tests cover
# the 64-token chunk boundary).
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


@pytest.mark.slow
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
    block = kv_block_bytes(loaded.model, 16)
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
