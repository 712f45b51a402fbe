"""Engine configuration: the knobs of the scheduler and the KV cache, validated once.

Values computed at run time (how many requests are running, how many slots are free) live in
the scheduler and the cache, never here: the config is frozen. Every field is checked with its
type when the config is built (a bool is not a count, 2.5 is not a count either), with an error
naming the field, so a bad setting fails before any model is loaded or any step runs.

Phase 7: `enforce_eager` turns CUDA graphs off (they only exist on CUDA anyway); slots are int32
on the device (attention.py), so the cache holds fewer than 2**31 of them. Each kernel-level
speed-up of the CUDA path can be switched off on its own (`KernelConfig`, read from the engine's
fields of the same names), so a benchmark can measure what each one is worth.
"""

import enum
import os
from dataclasses import dataclass, fields

import torch

MAX_KV_SLOTS = 2**31 - 1  # slot ids travel to the kernels as int32
# Tensor parallelism: "auto" reads the checkpoint's safetensors, "dummy" (vLLM's name) random
# weights of its config.json, built on each rank's shard (loader.py).
LOAD_FORMATS = ("auto", "dummy")


class PreemptionMode(enum.Enum):
    """What happens to a preempted sequence's KV blocks (vLLM's `preemption_mode`)."""

    RECOMPUTE = "recompute"  # dropped; its tokens are prefilled again when it is readmitted
    SWAP = "swap"  # copied to a CPU pool of `num_cpu_kv_blocks` blocks, and back when room returns


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels the model's CUDA path runs. The torch path (CPU) is the definition; every
    lever here changes how many kernels a step launches and how fast they are, never the math
    (up to rounding), and the model is built with one (model.py)."""

    fuse_add_rms_norm: bool = True  # residual add + RMSNorm in one kernel (kernels/fused.py)
    fuse_rope_kv_store: bool = True  # q/k norm + RoPE + KV-cache store in one kernel
    tune_decode_attention: bool = True  # decode attention's W-tuned launch (kernels/paged_decode)
    gemv_max_batch: int = 8  # linears of at most this many rows run the GEMV kernel; 0: never
    # Run the Triton kernels on CPU tensors as well, through Triton's interpreter: slow, for
    # stepping through the kernels and for the tests that count a step's launches.
    interpret_on_cpu: bool = False

    def __post_init__(self):
        if isinstance(self.gemv_max_batch, bool) or not isinstance(self.gemv_max_batch, int):
            raise TypeError(f"gemv_max_batch must be an int, got {self.gemv_max_batch!r}")
        if not 0 <= self.gemv_max_batch <= MAX_GEMV_BATCH:
            raise ValueError(
                f"gemv_max_batch must be in 0..{MAX_GEMV_BATCH} (the GEMV kernel's row tile), "
                f"got {self.gemv_max_batch}"
            )
        if self.interpret_on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "interpret_on_cpu needs TRITON_INTERPRET=1 in the environment before triton is "
                "imported (tests/conftest.py sets it)"
            )

    def use_triton(self, x: torch.Tensor) -> bool:
        """Whether `x`'s device runs the Triton kernels (CUDA; CPU only when interpreted)."""
        return x.is_cuda or (self.interpret_on_cpu and x.device.type == "cpu")

    def use_gemv(self, x: torch.Tensor) -> bool:
        """x (rows, in): few rows make a matmul a matrix-vector product, bound by the weight's
        bytes, where the GEMV kernel beats cuBLAS (kernels/gemv.py)."""
        return 0 < x.shape[0] <= self.gemv_max_batch and self.use_triton(x)


MAX_GEMV_BATCH = 16  # rows the GEMV kernel's tile holds (tl.dot's smallest M on a GPU)
DEFAULT_KERNELS = KernelConfig()  # every lever on: what a model built without one runs


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
    # The CUDA path's kernel levers (KernelConfig says what each does); the defaults are fastest.
    fuse_add_rms_norm: bool = True
    fuse_rope_kv_store: bool = True
    tune_decode_attention: bool = True
    gemv_max_batch: int = 8

    @property
    def kernels(self) -> KernelConfig:
        return KernelConfig(
            self.fuse_add_rms_norm, self.fuse_rope_kv_store, self.tune_decode_attention,
            self.gemv_max_batch,
        )  # fmt: skip

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
                # no CPU pool and no GEMV are valid
                minimum = 0 if field.name in ("num_cpu_kv_blocks", "gemv_max_batch") else 1
                if value < minimum:
                    raise ValueError(f"EngineConfig.{field.name} must be >= {minimum}, got {value}")
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
        self.kernels  # noqa: B018 (KernelConfig checks its own ranges)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"EngineConfig.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
