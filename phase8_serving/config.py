"""Engine configuration: the knobs of the scheduler and the KV cache, validated once.

Values computed at run time (how many requests are running, how many slots are free) live in
the scheduler and the cache, never here: the config is frozen.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16  # requests running at once
    max_num_batched_tokens: int = 256  # tokens one step may compute (the per-step token budget)
    num_kv_blocks: int = 512  # KV cache capacity, in blocks (per layer)
    block_size: int = 16  # tokens per block
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True

    @property
    def num_kv_slots(self) -> int:
        return self.num_kv_blocks * self.block_size

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
