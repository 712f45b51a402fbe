"""Engine configuration: the knobs of the scheduler and the KV cache, validated once.

Values computed at run time (how many requests are running, how many slots are free) live in
the scheduler and the cache, never here: the config is frozen. Every field is checked with its
type when the config is built (a bool is not a count, 2.5 is not a count either), with an error
naming the field, so a bad setting fails before any model is loaded or any step runs.

Phase 7: `enforce_eager` turns CUDA graphs off (they only exist on CUDA anyway); slots are int32
on the device (attention.py), so the cache holds fewer than 2**31 of them. `async_scheduling`
(vLLM's name) overlaps the host's work on the next step with the device's on this one (engine.py);
None turns it on where the device runs asynchronously (CUDA) and off elsewhere, where it could
only cost an extra step per stopped request.
"""

import enum
from dataclasses import dataclass, fields

MAX_KV_SLOTS = 2**31 - 1  # slot ids travel to the kernels as int32
# Tensor parallelism: "auto" reads the checkpoint's safetensors, "dummy" (vLLM's name) random
# weights of its config.json, built on each rank's shard (loader.py).
LOAD_FORMATS = ("auto", "dummy")


class PreemptionMode(enum.Enum):
    """What happens to a preempted sequence's KV blocks (vLLM's `preemption_mode`)."""

    RECOMPUTE = "recompute"  # dropped; its tokens are prefilled again when it is readmitted
    SWAP = "swap"  # copied to a CPU pool of `num_cpu_kv_blocks` blocks, and back when room returns


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16  # requests running at once
    max_num_batched_tokens: int = 256  # tokens one step may compute (the per-step token budget)
    num_kv_blocks: int = 512  # KV cache capacity, in blocks (per layer)
    block_size: int = 16  # tokens per block
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode | str = PreemptionMode.RECOMPUTE  # a str is converted
    num_cpu_kv_blocks: int = 0  # the CPU pool swapped-out blocks wait in (swap mode)
    enforce_eager: bool = False  # True: no CUDA graphs, every step runs eagerly (vLLM's name)
    tensor_parallel_size: int = 1  # ranks (GPUs) splitting the model: distributed.py
    load_format: str = "auto"  # LOAD_FORMATS
    async_scheduling: bool | None = None  # overlap scheduling; None: on for CUDA, off elsewhere

    @property
    def num_kv_slots(self) -> int:
        return self.num_kv_blocks * self.block_size

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type is bool and not isinstance(value, bool):
                raise TypeError(f"EngineConfig.{field.name} must be a bool, got {value!r}")
            if field.type is int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"EngineConfig.{field.name} must be an int, got {value!r}")
                minimum = 0 if field.name == "num_cpu_kv_blocks" else 1  # no CPU pool is valid
                if value < minimum:
                    raise ValueError(f"EngineConfig.{field.name} must be >= {minimum}, got {value}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(
                "EngineConfig.async_scheduling must be a bool or None, "
                f"got {self.async_scheduling!r}"
            )
        modes = [m.value for m in PreemptionMode]
        if self.preemption_mode not in modes + list(PreemptionMode):
            raise ValueError(
                f"EngineConfig.preemption_mode must be one of {modes}, got {self.preemption_mode!r}"
            )
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        if self.preemption_mode == PreemptionMode.SWAP and self.num_cpu_kv_blocks < 1:
            raise ValueError("EngineConfig.num_cpu_kv_blocks must be >= 1 to swap")
        if self.preemption_mode == PreemptionMode.SWAP and self.tensor_parallel_size > 1:
            raise ValueError(
                "EngineConfig.preemption_mode 'swap' needs tensor_parallel_size 1: the other "
                "ranks would not copy their KV heads"
            )
        if self.num_kv_slots > MAX_KV_SLOTS:
            raise ValueError(
                f"EngineConfig.num_kv_blocks * block_size must be <= {MAX_KV_SLOTS} (int32 slot "
                f"ids), got {self.num_kv_slots}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"EngineConfig.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
