"""Engine configuration: the knobs of the scheduler and the KV cache, validated once.

Values computed at run time (how many requests are running, how many slots are free) live in
the scheduler and the cache, never here: the config is frozen. Every field is checked with its
type when the config is built (a bool is not a count, 2.5 is not a count either), with an error
naming the field, so a bad setting fails before any model is loaded or any step runs.

Phase 7: `enforce_eager` turns CUDA graphs off (they only exist on CUDA anyway); slots are int32
on the device (attention.py), so the cache holds fewer than 2**31 of them.
"""

from dataclasses import dataclass, fields

MAX_KV_SLOTS = 2**31 - 1  # slot ids travel to the kernels as int32
# Tensor parallelism: "auto" reads the checkpoint's safetensors, "dummy" (vLLM's name) random
# weights of its config.json, built on each rank's shard (loader.py).
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16  # requests running at once
    max_num_batched_tokens: int = 256  # tokens one step may compute (the per-step token budget)
    num_kv_blocks: int = 512  # KV cache capacity, in blocks (per layer)
    block_size: int = 16  # tokens per block
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs, every step runs eagerly (vLLM's name)
    tensor_parallel_size: int = 1  # ranks (GPUs) splitting the model: distributed.py
    load_format: str = "auto"  # LOAD_FORMATS

    @property
    def num_kv_slots(self) -> int:
        return self.num_kv_blocks * self.block_size

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type is bool and not isinstance(value, bool):
                raise TypeError(f"EngineConfig.{field.name} must be a bool, got {value!r}")
            if field.type is int:  # every count here is at least 1
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"EngineConfig.{field.name} must be an int, got {value!r}")
                if value < 1:
                    raise ValueError(f"EngineConfig.{field.name} must be >= 1, got {value}")
        if self.num_kv_slots > MAX_KV_SLOTS:
            raise ValueError(
                f"EngineConfig.num_kv_blocks * block_size must be <= {MAX_KV_SLOTS} (int32 slot "
                f"ids), got {self.num_kv_slots}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"EngineConfig.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
