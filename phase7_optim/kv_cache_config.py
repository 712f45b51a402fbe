"""The KV cache's size: as many blocks as the memory left for them holds.

Problem: a fixed number of blocks fits no machine. 512 blocks leave a 141 GB GPU nearly empty
(few sequences fit, so the scheduler starves the GPU of work), and a count that fills one GPU
fails to allocate on a smaller one. What a GPU can give the cache is known only once the model is
on it and has run its largest step.
Idea (vLLM's `determine_available_memory` and `KVCacheConfig`): on CUDA, run one profiling step
as large as the scheduler can make (`max_num_batched_tokens` tokens, every sequence sampling),
measure the peak memory it allocates, and give the KV cache what is left of
`gpu_memory_utilization` x the GPU's memory after the weights, that peak, and whatever else is on
the device (the CUDA context, other processes or engines). Under tensor parallelism every rank
measures its own, and they take the minimum: the block ids rank 0 hands out must exist on every
rank. On CPU there is nothing to measure: the cache takes a fixed byte budget
(`CPU_KV_CACHE_MEMORY_BYTES`), and never more than `max_num_seqs` requests at the model's full
context could use. `kv_cache_memory_bytes` sets the budget on any device; `num_kv_blocks`
overrides all of it.

The result is a `KVCacheConfig`, computed once at start-up and handed to the block manager and the
model runner: the frozen `EngineConfig` is never written back. It also fixes `max_model_len`, the
most tokens (prompt + output) a request may hold: the config's, which may not exceed the model's
context nor what the cache holds (an error at start-up, as in vLLM), or else the model's context,
cut to what the cache holds. The engine logs the capacity in tokens and how many requests of
`max_model_len` tokens fit at once, as vLLM does.

A hybrid model (Qwen3.5) also holds a state pool: max_num_seqs slots of DeltaNet state, fixed in
size (state_pool.py). On CUDA its bytes come out of the same budget before the blocks are counted,
and only the attention layers take KV bytes per block.

Invariants: the cache has at least one block and fewer than 2**31 slots (config.MAX_KV_SLOTS);
every rank holds the same number of blocks.
"""

import gc
import logging
import math
from dataclasses import dataclass

import torch

from .attention import ForwardBatch
from .config import MAX_KV_SLOTS, EngineConfig
from .distributed import min_over_ranks
from .kernels import PAD_SLOT_ID  # Triton-free: the kernels load on first use
from .kv_cache import KVCache, resolve_cache_dtype
from .model import ModelConfig, Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, is_hybrid
from .sampling import SamplingBatch, SamplingParams, sample_batch
from .state_pool import StatePool

logger = logging.getLogger(__name__)

GiB = 2**30
# The CPU's budget when none is given: room for the default model's context many times over,
# and capped by what max_num_seqs requests can use, so a tiny test model allocates little.
CPU_KV_CACHE_MEMORY_BYTES = 1 * GiB
# The profiling step samples as the costliest request would: a sort over the vocabulary.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache this engine allocates (per rank: each block holds this rank's KV heads)."""

    num_blocks: int
    block_size: int
    block_bytes: int  # keys and values of one block, every layer
    max_model_len: int  # prompt + output tokens a request may hold, at most

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def memory_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def max_concurrency(self, tokens_per_request: int) -> float:
        """How many requests of `tokens_per_request` tokens the cache holds at once."""
        return self.num_tokens / tokens_per_request


@dataclass(frozen=True)
class MemoryProfile:
    """One GPU's memory, measured after a profiling step (bytes)."""

    total_bytes: int
    weights_bytes: int  # this rank's parameters
    peak_activation_bytes: int  # what the largest step allocates above what was there before
    other_bytes: int  # everything else in use: the CUDA context, buffers, other processes


def kv_block_bytes(
    model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, block_size: int, dtype: torch.dtype
) -> int:
    """One block's keys and values, every layer, in the cache's element type `dtype`."""
    c = model.config
    num_layers = c.num_attention_layers if is_hybrid(c) else c.num_layers
    per_token = 2 * num_layers * model.num_kv_heads_per_rank * c.head_dim * dtype.itemsize
    return block_size * per_token  # 2: keys and values


def kv_cache_dtype(
    model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, config: EngineConfig
) -> torch.dtype:
    """The cache's element type: the model's, or fp8 (`config.kv_cache_dtype`, kv_cache.py)."""
    device = model.lm_head.weight.device
    return resolve_cache_dtype(config.kv_cache_dtype, model.lm_head.weight.dtype, device)


def state_pool_bytes(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, config: EngineConfig) -> int:
    """What a hybrid model's state pool (max_num_seqs slots) takes; 0 for attention-only models."""
    c = model.config
    if not is_hybrid(c):
        return 0
    per_slot = c.num_deltanet_layers * c.state_shape.bytes_per_slot(model.lm_head.weight.dtype)
    return config.max_num_seqs * per_slot


def num_blocks_from_memory(
    profile: MemoryProfile, gpu_memory_utilization: float, block_bytes: int, state_bytes: int = 0
) -> int:
    """The blocks that fit in gpu_memory_utilization x the GPU, after everything else (a hybrid
    model's state pool, `state_bytes`, included)."""
    allowed = gpu_memory_utilization * profile.total_bytes
    spent = profile.weights_bytes + profile.peak_activation_bytes + profile.other_bytes
    num_blocks = int((allowed - spent - state_bytes) // block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization {gpu_memory_utilization}"
            f" x {profile.total_bytes / GiB:.2f} GiB = {allowed / GiB:.2f} GiB, of which the "
            f"weights take {profile.weights_bytes / GiB:.2f}, the largest step "
            f"{profile.peak_activation_bytes / GiB:.2f}, the state pool {state_bytes / GiB:.2f} "
            "and everything else on the GPU "
            f"{profile.other_bytes / GiB:.2f}; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens or max_num_seqs, or set num_kv_blocks"
        )
    return num_blocks


def num_blocks_from_budget(budget_bytes: int, block_bytes: int) -> int:
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes ({budget_bytes}) holds no block ({block_bytes} bytes each)"
        )
    return num_blocks


def determine_kv_cache_config(model: Qwen3ForCausalLM, config: EngineConfig) -> KVCacheConfig:
    """The KV cache for `model` under `config` (its batch sizes resolved: `for_device`). Under
    tensor parallelism every rank calls this at the same point: it runs collectives."""
    device = next(model.parameters()).device
    block_bytes = kv_block_bytes(model, config.block_size, kv_cache_dtype(model, config))
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = num_blocks_from_budget(config.kv_cache_memory_bytes, block_bytes)
    elif device.type == "cuda":
        profile = profile_memory(model, config)
        num_blocks = num_blocks_from_memory(
            profile, config.gpu_memory_utilization, block_bytes, state_pool_bytes(model, config)
        )
    else:  # no more than max_num_seqs requests of max_model_len tokens can use
        full = config.max_num_seqs * -(-model_len(model.config, config) // config.block_size)
        num_blocks = min(num_blocks_from_budget(CPU_KV_CACHE_MEMORY_BYTES, block_bytes), full)
    num_blocks = min(num_blocks, MAX_KV_SLOTS // config.block_size)
    num_blocks = min_over_ranks(num_blocks, model.tp, device)
    num_tokens = num_blocks * config.block_size
    if config.max_model_len is not None and config.max_model_len > num_tokens:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is more than the KV cache holds ({num_tokens} "
            "tokens): lower max_model_len, or give the cache more room (gpu_memory_utilization, "
            "kv_cache_memory_bytes, num_kv_blocks)"
        )
    max_model_len = min(model_len(model.config, config), num_tokens)
    return KVCacheConfig(num_blocks, config.block_size, block_bytes, max_model_len)


def model_len(model_config: ModelConfig | Qwen3_5Config, config: EngineConfig) -> int:
    """The longest request `config` builds the engine for: max_model_len, else the model's
    context; a max_model_len past the context is an error (checked before the slow load, too)."""
    context = model_config.max_position_embeddings
    if config.max_model_len is None:
        return context
    if config.max_model_len > context:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is more than the model's context "
            f"(max_position_embeddings = {context})"
        )
    return config.max_model_len


def log_kv_cache(kv: KVCacheConfig, device_type: str) -> None:
    """vLLM's two start-up lines: the capacity, and the requests of max_model_len it holds."""
    logger.info(
        "%s KV cache size: %s tokens (%s blocks, %.2f GiB)", device_type.upper(),
        f"{kv.num_tokens:,}", f"{kv.num_blocks:,}", kv.memory_bytes / GiB,
    )  # fmt: skip
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{kv.max_model_len:,}", kv.max_concurrency(kv.max_model_len),
    )  # fmt: skip


def profile_memory(model: Qwen3ForCausalLM, config: EngineConfig) -> MemoryProfile:
    """Runs the profiling step on the model's GPU and measures what it and everything else use."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    # An engine dropped just before (its CUDA graphs, caches and runner hold reference cycles) is
    # memory only the garbage collector gives back; counted as "everything else" it would leave
    # this one no room.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_run(model, config)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # the step's memory goes back to the GPU, for the cache
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return MemoryProfile(total, weights, peak, other_bytes=max(0, total - free - weights))


@torch.inference_mode()
def profile_run(model: Qwen3ForCausalLM, config: EngineConfig) -> None:
    """The largest step the scheduler can make: max_num_batched_tokens prompt tokens split over
    as many sequences as may run (each within max_model_len), every one sampling. Its
    keys and values go nowhere (PAD_SLOT_ID) and it reads a one-block cache: only the memory
    it allocates matters."""
    device, c = next(model.parameters()).device, model.config
    num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    num_tokens = min(config.max_num_batched_tokens, num_seqs * model_len(c, config))
    q_lens = torch.full((num_seqs,), num_tokens // num_seqs, dtype=torch.long)
    q_lens[: num_tokens % num_seqs] += 1
    qsl = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(q_lens, 0, out=qsl[1:])
    positions = torch.arange(num_tokens) - torch.repeat_interleave(qsl[:-1], q_lens)
    max_len = int(q_lens.max())
    to = lambda x: x.to(device=device, dtype=torch.int32)  # noqa: E731  (METADATA_DTYPE)
    batch = ForwardBatch(
        query_start_loc=to(qsl), seq_lens=to(q_lens),
        slot_mapping=to(torch.full((num_tokens,), PAD_SLOT_ID)),
        block_tables=to(torch.zeros(num_seqs, math.ceil(max_len / config.block_size))),
        logits_indices=to(qsl[1:] - 1), max_query_len=max_len, max_seq_len=max_len,
        block_size=config.block_size,
    )  # fmt: skip
    dtype, hybrid = model.lm_head.weight.dtype, is_hybrid(c)
    num_kv_layers = c.num_attention_layers if hybrid else c.num_layers
    kv_cache = KVCache(num_kv_layers, 1, config.block_size, model.num_kv_heads_per_rank,
                       c.head_dim, kv_cache_dtype(model, config), device)  # fmt: skip
    caches = (kv_cache,)
    if hybrid:  # one slot for everyone: what they write there is as unread as their keys
        caches += (StatePool(c.state_shape, c.num_deltanet_layers, 1, dtype, device),)
        batch.state_slots = to(torch.zeros(num_seqs))
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    logits = model(input_ids, positions.to(device), batch, *caches)
    if model.tp.rank == 0:  # only rank 0 samples
        params = [PROFILE_SAMPLING] * num_seqs
        vocab_size = logits.shape[-1]
        sample_batch(logits, SamplingBatch.build(params, [None] * num_seqs, vocab_size, device))
