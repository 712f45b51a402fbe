"""The KV cache's size: the memory arithmetic on made-up numbers, and the CPU engine's choices.

The GPU's side (a profiling step, then the cache filling `gpu_memory_utilization` of the GPU) is
in test_gpu_engine.py; under tensor parallelism the ranks' minimum is checked in test_tp.py.
"""

import logging
import math

import pytest

from phase7_optim import LLM, EngineConfig, SamplingParams
from phase7_optim.config import CPU_DEFAULTS, GPU_DEFAULTS
from phase7_optim.kv_cache_config import (
    GiB,
    MemoryProfile,
    num_blocks_from_budget,
    num_blocks_from_memory,
    profile_run,
)

from .conftest import TINY_QWEN3

MiB = 2**20
PROFILE = MemoryProfile(
    total_bytes=100 * GiB, weights_bytes=10 * GiB, peak_activation_bytes=5 * GiB,
    other_bytes=2 * GiB,
)  # fmt: skip
FLOAT32_BYTES, BLOCK_SIZE = 4, 16
# The tiny checkpoint's block: keys and values, 2 layers, 2 KV heads of 16, float32, 16 tokens.
KV_VALUES_PER_TOKEN = 2 * TINY_QWEN3["num_hidden_layers"] * TINY_QWEN3["num_key_value_heads"] * (
    TINY_QWEN3["head_dim"]
)  # fmt: skip
TINY_BLOCK_BYTES = KV_VALUES_PER_TOKEN * FLOAT32_BYTES * BLOCK_SIZE
TINY_CONTEXT = TINY_QWEN3["max_position_embeddings"]


def test_blocks_fill_the_utilization_after_weights_activations_and_the_rest():
    # 0.9 x 100 GiB = 90 GiB, minus 10 + 5 + 2 GiB: 73 GiB of 1 MiB blocks
    assert num_blocks_from_memory(PROFILE, 0.9, MiB) == 73 * 1024
    assert num_blocks_from_memory(PROFILE, 0.5, MiB) == 33 * 1024
    assert num_blocks_from_memory(PROFILE, 0.9, 3 * MiB) == 73 * 1024 // 3  # whole blocks only


def test_no_room_for_a_block_says_where_the_memory_went():
    with pytest.raises(ValueError, match="weights take 10.00, the largest step 5.00"):
        num_blocks_from_memory(PROFILE, 0.17, MiB)  # 17 GiB: all spent already
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_from_budget(MiB - 1, MiB)


@pytest.mark.parametrize("utilization", [0, 0.0, -0.1, 1.01, 2, math.nan, math.inf])
def test_a_bad_gpu_memory_utilization_is_a_value_error(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=utilization)
    EngineConfig(gpu_memory_utilization=1)  # the whole GPU is allowed


@pytest.mark.parametrize("utilization", [True, "0.9", None])
def test_a_gpu_memory_utilization_that_is_no_number_is_a_type_error(utilization, tmp_path):
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        LLM(tmp_path / "never-read", gpu_memory_utilization=utilization)


def test_device_defaults_fill_only_what_is_unset():
    gpu, cpu = EngineConfig().for_device("cuda"), EngineConfig().for_device("cpu")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 16384) == (
        GPU_DEFAULTS.max_num_seqs, GPU_DEFAULTS.max_num_batched_tokens,
    )  # fmt: skip
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (16, 256) == (
        CPU_DEFAULTS.max_num_seqs, CPU_DEFAULTS.max_num_batched_tokens,
    )  # fmt: skip
    mine = EngineConfig(max_num_seqs=3, max_num_batched_tokens=40).for_device("cuda")
    assert (mine.max_num_seqs, mine.max_num_batched_tokens) == (3, 40)


def test_cpu_budget_gives_its_block_count(tiny_qwen3_tied_dir):
    llm = LLM(
        tiny_qwen3_tied_dir, dtype="float32", kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES + 7
    )
    kv = llm.engine.kv_cache_config
    assert (kv.num_blocks, kv.block_bytes) == (100, TINY_BLOCK_BYTES)
    assert llm.engine.block_manager.num_free_blocks == 100
    assert llm.engine.runner.kv_cache.k[0].shape[0] == 100


def test_cpu_default_holds_max_num_seqs_requests_at_full_context(tiny_qwen3_tied_dir, caplog):
    """1 GiB would be some 260,000 of the tiny model's blocks: the cap keeps 4 requests' worth."""
    with caplog.at_level(logging.INFO, logger="phase7_optim.kv_cache_config"):
        llm = LLM(tiny_qwen3_tied_dir, dtype="float32", max_num_seqs=4)
    kv = llm.engine.kv_cache_config
    assert kv.num_tokens == 4 * TINY_CONTEXT
    assert 4 * TINY_CONTEXT * TINY_BLOCK_BYTES // 16 < GiB  # the budget is not what binds
    assert f"CPU KV cache size: {4 * TINY_CONTEXT:,} tokens" in caplog.text
    assert f"Maximum concurrency for {TINY_CONTEXT:,} tokens per request: 4.00x" in caplog.text


def test_num_kv_blocks_overrides_every_budget(tiny_qwen3_tied_dir):
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", num_kv_blocks=5, kv_cache_memory_bytes=GiB)
    assert llm.engine.kv_cache_config.num_blocks == 5
    with pytest.raises(ValueError, match=r"can never fit in the KV cache \(80 slots\)"):
        llm.engine.add_request([1] * 50, SamplingParams(max_tokens=40))  # within the context


def test_profile_step_stays_within_the_context(tiny_qwen3_tied_dir):
    """One sequence and a budget 4x the context: the profiling step splits nothing it cannot
    (positions past the context have no rotary angle), and runs on CPU as on a GPU."""
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", num_kv_blocks=8)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=4 * TINY_CONTEXT).for_device("cpu")
    profile_run(llm.engine.model, config)
