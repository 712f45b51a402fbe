"""Engine configuration: the knobs of the scheduler and the KV cache, validated once.

Values computed at run time (how many requests are running, how many slots are free) live in
the scheduler and the cache, never here: the config is frozen. Every field is checked with its
type when the config is built (a bool is not a count, 2.5 is not a count either), with an error
naming the field, so a bad setting fails before any model is loaded or any step runs.

Phase 7: `enforce_eager` turns CUDA graphs off (they only exist on CUDA anyway); slots are int32
on the device (attention.py), so the cache holds fewer than 2**31 of them. What a GPU can hold is
not known until the model is on it: `num_kv_blocks` left unset is sized at start-up from
`gpu_memory_utilization` on CUDA and from `kv_cache_memory_bytes` on CPU (kv_cache_config.py:
the result is a `KVCacheConfig`, never written back here), and `max_num_seqs` and
`max_num_batched_tokens` left unset take the device's defaults (`for_device`: vLLM's on CUDA).
Each kernel-level speed-up of the CUDA path can be switched off on its own (`KernelConfig`, read
from the engine's fields of the same names), so a benchmark can measure what each one is worth.
`async_scheduling` (vLLM's name) overlaps the host's work on the next step with the device's on
this one (engine.py); unset, it is on where the device runs behind the host (CUDA) and off on
CPU, where it could only cost an extra step per stopped request. `max_model_len` caps prompt +
output tokens below the model's context (kv_cache_config.py resolves it once the cache is sized).

`engine_config` reads `LLM(...)`'s keyword arguments under vLLM's names: this engine's fields,
vLLM's other names for them (`num_gpu_blocks_override`), and vLLM arguments that have no meaning
here, accepted at the value that asks for nothing (`quantization=None`) so code written for vLLM
runs unchanged, refused with an error that names them at any other; anything else is a TypeError
that lists what is known.

Phase 8: `ServerConfig`, the HTTP server's own settings (the name clients ask for, the context
limit the engine core reports, the API key, the body and choice limits, the request log, the
dashboard), beside the engine's and, like it, importable without the server's dependencies, so
the command line takes its defaults from here and every part of the server reads one definition.
"""

import dataclasses
import difflib
import enum
import math
import os
import typing
from dataclasses import dataclass, fields, replace

if typing.TYPE_CHECKING:  # the config loads without torch: the CLI sets OpenMP's policy first
    import torch

MAX_KV_SLOTS = 2**31 - 1  # slot ids travel to the kernels as int32
# Tensor parallelism: "auto" reads the checkpoint's safetensors, "dummy" (vLLM's name) random
# weights of its config.json, built on each rank's shard (loader.py).
LOAD_FORMATS = ("auto", "dummy")
# the KV cache's element type (vLLM's names): the model's dtype, or float8_e4m3fn (kv_cache.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
OPTIONAL_INT = int | None  # a count the engine chooses when it is None
OPTIONAL_BOOL = bool | None  # a switch the device's defaults set when it is None


@dataclass(frozen=True)
class DeviceDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool


# vLLM's on a GPU (256 sequences; 16,384 batched tokens, its choice for large GPUs); on a CPU,
# sizes a few cores get through in well under a second a step.
GPU_DEFAULTS = DeviceDefaults(max_num_seqs=256, max_num_batched_tokens=16384, async_scheduling=True)
CPU_DEFAULTS = DeviceDefaults(max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=False)


class PreemptionMode(enum.Enum):
    """What happens to a preempted sequence's KV blocks (vLLM's `preemption_mode`)."""

    RECOMPUTE = "recompute"  # dropped; its tokens are prefilled again when it is readmitted
    SWAP = "swap"  # copied to a CPU pool of `num_cpu_kv_blocks` blocks, and back when room returns


class SchedulingPolicy(enum.Enum):
    """Which waiting request goes first (vLLM's `scheduling_policy`; scheduler.py)."""

    FCFS = "fcfs"  # first come, first served (fairly shared across requests)
    PRIORITY = "priority"  # each request's `priority`, lower first; first come among equals


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels the model's CUDA path runs. The torch path (CPU) is the definition; every
    lever here changes how many kernels a step launches and how fast they are, never the math
    (up to rounding), and the model is built with one (model.py)."""

    fuse_add_rms_norm: bool = True  # residual add + RMSNorm in one kernel (kernels/fused.py)
    fuse_rope_kv_store: bool = True  # q/k norm + RoPE + KV-cache store in one kernel
    tune_decode_attention: bool = True  # decode attention's W-tuned launch (kernels/paged_decode)
    gemv_max_batch: int = 8  # linears of at most this many rows run the GEMV kernel; 0: never
    fuse_silu_into_gemv: bool = True  # the down projection's GEMV computes SiLU-and-mul as it loads
    # QKV's and gate_up's GEMV compute the residual add + RMSNorm before them as they load x
    fold_norm_into_gemv: bool = True
    # Programmatic dependent launch (Hopper on, kernels/pdl.py): each Triton kernel of a decode step
    # starts while the kernel before it ends; a GEMV loads its weights before it waits
    programmatic_launch: bool = True
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

    def use_triton(self, x: "torch.Tensor") -> bool:
        """Whether `x`'s device runs the Triton kernels (CUDA; CPU only when interpreted)."""
        return x.is_cuda or (self.interpret_on_cpu and x.device.type == "cpu")

    def use_gemv(self, x: "torch.Tensor") -> bool:
        """x (rows, in): few rows make a matmul a matrix-vector product, bound by the weight's
        bytes, where the GEMV kernel beats cuBLAS (kernels/gemv.py)."""
        return 0 < x.shape[0] <= self.gemv_max_batch and self.use_triton(x)


MAX_GEMV_BATCH = 16  # rows the GEMV kernel's tile holds (tl.dot's smallest M on a GPU)
DEFAULT_KERNELS = KernelConfig()  # every lever on: what a model built without one runs


# no CPU pool, no GEMV and no LM head in the graphs are valid
ZERO_ALLOWED = ("num_cpu_kv_blocks", "gemv_max_batch", "lm_head_graph_max_batch")
MIN_MODEL_LEN = 2  # one prompt token and one output token


@dataclass(frozen=True)
class EngineConfig:
    # None: the device's default (`for_device`)
    max_num_seqs: int | None = None  # requests running at once
    max_num_batched_tokens: int | None = None  # tokens one step may compute (the token budget)
    num_kv_blocks: int | None = None  # KV cache capacity, in blocks (per layer); None: sized
    block_size: int = 16  # tokens per block
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode | str = PreemptionMode.RECOMPUTE  # a str is converted
    num_cpu_kv_blocks: int = 0  # the CPU pool swapped-out blocks wait in (swap mode)
    scheduling_policy: SchedulingPolicy | str = SchedulingPolicy.FCFS  # a str is converted
    enforce_eager: bool = False  # True: no CUDA graphs, every step runs eagerly (vLLM's name)
    # Decode graphs of at most this many rows capture the LM head too; larger ones end at the
    # hidden states and the LM head runs after the replay (cuda_graph.py says why). 0: never.
    lm_head_graph_max_batch: int = 16
    tensor_parallel_size: int = 1  # ranks (GPUs) splitting the model: distributed.py
    # Prompt + output tokens a request may hold (vLLM's name); None: the model's context, or what
    # the KV cache holds if that is less (kv_cache_config.py)
    max_model_len: int | None = None
    load_format: str = "auto"  # LOAD_FORMATS
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: "fp8" halves the cache's bytes (kv_cache.py)
    # How num_kv_blocks is sized when unset (vLLM's names): the KV cache takes
    # kv_cache_memory_bytes per rank when set; otherwise on CUDA what is left of the GPU's
    # memory times gpu_memory_utilization after the weights and the largest step, on CPU a fixed
    # budget (kv_cache_config.py).
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    async_scheduling: bool | None = None  # overlap scheduling (engine.py); None: device default
    # The CUDA path's kernel levers (KernelConfig says what each does); the defaults are fastest.
    fuse_add_rms_norm: bool = True
    fuse_rope_kv_store: bool = True
    tune_decode_attention: bool = True
    gemv_max_batch: int = 8
    fuse_silu_into_gemv: bool = True
    fold_norm_into_gemv: bool = True
    programmatic_launch: bool = True

    @property
    def kernels(self) -> KernelConfig:
        return KernelConfig(
            self.fuse_add_rms_norm, self.fuse_rope_kv_store, self.tune_decode_attention,
            self.gemv_max_batch, self.fuse_silu_into_gemv, self.fold_norm_into_gemv,
            self.programmatic_launch,
        )  # fmt: skip

    def for_device(self, device_type: str) -> "EngineConfig":
        """This config with the device's defaults where it leaves the batch sizes or
        `async_scheduling` unset."""
        defaults = GPU_DEFAULTS if device_type == "cuda" else CPU_DEFAULTS
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        overlap = self.async_scheduling
        return replace(
            self,
            max_num_seqs=defaults.max_num_seqs if seqs is None else seqs,
            max_num_batched_tokens=defaults.max_num_batched_tokens if tokens is None else tokens,
            async_scheduling=defaults.async_scheduling if overlap is None else overlap,
        )

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            optional_bool = field.type == OPTIONAL_BOOL and value is not None
            if (field.type is bool or optional_bool) and not isinstance(value, bool):
                raise TypeError(f"EngineConfig.{field.name} must be a bool, got {value!r}")
            if field.type is int or (field.type == OPTIONAL_INT and value is not None):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"EngineConfig.{field.name} must be an int, got {value!r}")
                minimum = 0 if field.name in ZERO_ALLOWED else 1
                if value < minimum:
                    raise ValueError(f"EngineConfig.{field.name} must be >= {minimum}, got {value}")
        modes = [m.value for m in PreemptionMode]
        if self.preemption_mode not in modes + list(PreemptionMode):
            raise ValueError(
                f"EngineConfig.preemption_mode must be one of {modes}, got {self.preemption_mode!r}"
            )
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        policies = [p.value for p in SchedulingPolicy]
        if self.scheduling_policy not in policies + list(SchedulingPolicy):
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {policies}, "
                             f"got {self.scheduling_policy!r}")  # fmt: skip
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        if self.preemption_mode == PreemptionMode.SWAP and self.num_cpu_kv_blocks < 1:
            raise ValueError("EngineConfig.num_cpu_kv_blocks must be >= 1 to swap")
        if self.preemption_mode == PreemptionMode.SWAP and self.tensor_parallel_size > 1:
            raise ValueError(
                "EngineConfig.preemption_mode 'swap' needs tensor_parallel_size 1: the other "
                "ranks would not copy their KV heads"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size > MAX_KV_SLOTS:
            raise ValueError(
                f"EngineConfig.num_kv_blocks * block_size must be <= {MAX_KV_SLOTS} (int32 slot "
                f"ids), got {self.num_kv_blocks * self.block_size}"
            )
        if self.max_model_len is not None and self.max_model_len < MIN_MODEL_LEN:
            raise ValueError(
                f"EngineConfig.max_model_len must be >= {MIN_MODEL_LEN} (a prompt token and an "
                f"output token), got {self.max_model_len}"
            )
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        self.kernels  # noqa: B018 (KernelConfig checks its own ranges)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"EngineConfig.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )


def check_priority(priority: object, policy: SchedulingPolicy | str) -> None:
    """A request's priority: an int, other than 0 only under scheduling_policy "priority"."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r}")
    if priority != 0 and SchedulingPolicy(policy) != SchedulingPolicy.PRIORITY:
        raise ValueError(
            f"priority {priority} needs scheduling_policy 'priority' (--scheduling-policy "
            "priority); under 'fcfs' every request's priority is 0"
        )


def check_gpu_memory_utilization(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"EngineConfig.gpu_memory_utilization must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {value}")


# vLLM's names for this engine's fields, where they differ (EngineArgs, `LLM(**kwargs)`)
VLLM_ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}
# vLLM arguments that mean nothing here, each with the value that asks for nothing (or a tuple of
# them, the first the flag's default): accepted at that value, refused at any other (with the
# reason, or where to look instead)
VLLM_UNSUPPORTED = {
    "task": (("auto", "generate"), "this engine generates text; there is no pooling runner"),
    "runner": (("auto", "generate"), "this engine generates text; there is no pooling runner"),
    "tokenizer": (None, "the tokenizer is always the checkpoint's own"),
    "tokenizer_mode": ("auto", "the tokenizer is always the checkpoint's tokenizer.json"),
    "skip_tokenizer_init": (False, "the engine always loads the checkpoint's tokenizer"),
    "revision": (None, "pass a local directory, or a hub id at its default revision"),
    "tokenizer_revision": (None, "the tokenizer is always the checkpoint's own"),
    "quantization": (None, "weights load in `dtype`; there are no quantized kernels"),
    "pipeline_parallel_size": (1, "only tensor parallelism splits a model here"),
    "data_parallel_size": (1, "engines side by side are `mini-vllm serve --data-parallel-size`"),
    "swap_space": (0, "swap preemption is preemption_mode='swap' with num_cpu_kv_blocks blocks"),
    "cpu_offload_gb": (0, "every weight lives on the device"),
    "enable_lora": (False, "there are no LoRA adapters here"),
    "speculative_config": (None, "there is no speculative decoding here"),
    "hf_overrides": (None, "the checkpoint's config.json is read as it is"),
    "compilation_config": (None, "the model runs eagerly or in CUDA graphs, never torch.compile"),
    "max_logprobs": (20, "a request may ask for the 20 most likely tokens at most"),
    "download_dir": (None, "hub checkpoints go to the Hugging Face cache ($HF_HOME)"),
    "hf_token": (None, "set $HF_TOKEN, which the hub download reads, for a gated checkpoint"),
    "code_revision": (None, "no checkpoint code ever runs"),
    "model_impl": ("auto", "the model classes are this engine's own (model.py, qwen3_5.py)"),
    "worker_cls": ("auto", "the workers are this engine's own (worker.py)"),
    "enable_sleep_mode": (False, "there is no sleep mode here"),
    "enable_expert_parallel": (False, "there are no mixture-of-experts models here"),
    "calculate_kv_scales": (False, "an fp8 KV cache stores its values unscaled (kv_cache.py)"),
    "limit_mm_per_prompt": (None, "the models here read text only"),
    "mm_processor_kwargs": (None, "the models here read text only"),
    "kv_transfer_config": (None, "there is no disaggregated prefill here"),
    "logits_processors": (None, "there are no logits processor plugins here"),
    "otlp_traces_endpoint": (None, "there is no OpenTelemetry tracing here"),
    "max_num_partial_prefills": (1, "prompts are chunked by the step's token budget alone"),
    "long_prefill_token_threshold": (0, "prompts are chunked by the step's token budget alone"),
    "scheduler_delay_factor": (0.0, "the scheduler never holds a step back to gather prompts"),
}
# vLLM arguments that change nothing here whatever their value -> (the flag's default: False
# makes it a switch, anything else takes a value of its type), and why
VLLM_IGNORED = {
    "trust_remote_code": (False, "no code from a checkpoint ever runs: the model classes are ours"),
    "disable_log_stats": (False, "an offline engine logs no periodic stats"),
    "disable_custom_all_reduce": (False, "tensor parallelism all-reduces through NCCL alone"),
    "distributed_executor_backend": (None, "tensor-parallel ranks are local processes "
                                           "(worker.py), whatever the backend named"),
    "max_seq_len_to_capture": (8192, "decode CUDA graphs are captured by batch size and replay "
                                     "at any sequence length"),
    "max_cudagraph_capture_size": (None, "the CUDA graphs' batch sizes are the engine's own "
                                         "(cuda_graph.py)"),
    "prefix_caching_hash_algo": ("builtin", "the prefix cache chains hashes and checks every "
                                            "hit's tokens (block_manager.py)"),
    "guided_decoding_backend": ("auto", "structured outputs run on this engine's own grammars "
                                        "(structured_output.py)"),
    "structured_outputs_config": (None, "structured outputs run on this engine's own grammars "
                                        "(structured_output.py)"),
}  # fmt: skip


def engine_config(caller: str, kwargs: dict[str, object], others: tuple[str, ...]) -> EngineConfig:
    """`caller`'s engine keyword arguments (vLLM's `EngineArgs`) as an `EngineConfig`.

    `others`: the caller's own keyword arguments, listed with the known ones in the error for an
    unknown one. Raises TypeError for an unknown argument or one named twice, ValueError for a
    vLLM argument this engine does not support at the value given.
    """
    field_names = {f.name for f in fields(EngineConfig)}
    known = sorted(field_names | VLLM_ALIASES.keys() | VLLM_UNSUPPORTED.keys() | VLLM_IGNORED.keys()
                   | set(others))  # fmt: skip
    config_kwargs = {}
    for name, value in kwargs.items():
        if name in VLLM_IGNORED:
            continue
        if name in VLLM_UNSUPPORTED:
            neutral, why = VLLM_UNSUPPORTED[name]
            accepted = neutral if isinstance(neutral, tuple) else (neutral,)
            if value not in accepted:
                spelled = " or ".join(f"{name}={v!r}" for v in accepted)
                raise ValueError(
                    f"{caller}(): vLLM's {name}={value!r} is not supported here ({why}); "
                    f"only {spelled}, which changes nothing, is accepted"
                )
            continue
        target = VLLM_ALIASES.get(name, name)
        if target not in field_names:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{caller}() got an unknown engine argument {name!r}{hint}; the known ones are: "
                + ", ".join(known)
            )
        if target in config_kwargs:
            raise TypeError(f"{caller}() got {target!r} twice (once as vLLM's {name!r})")
        config_kwargs[target] = value
    return EngineConfig(**config_kwargs)


def check_root_path(path: str) -> None:
    """A proxy's path prefix: /prefix, or nothing."""
    if path and not (path.startswith("/") and path[-1] != "/"):
        raise ValueError(f"root_path must look like /prefix, got {path!r}")


DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20  # a long-context prompt as text fits well inside
DEFAULT_MAX_CHOICES_PER_REQUEST = 256  # prompts x n: an engine's worth of running requests
DEFAULT_MAX_STORED_RESPONSES = 1000  # /v1/responses kept in memory for previous_response_id


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what clients put in "model"
    max_model_len: int  # prompt + completion tokens, at most
    api_key: str | None = None  # None: no authentication
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get a 413
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST  # prompts x n, at most
    enable_log_requests: bool = False  # a log line per request (uvicorn's access log too)
    enable_prompt_tokens_details: bool = False  # usage says how many prompt tokens were cached
    enable_dashboard: bool = True  # GET /dashboard
    model_root: str | None = None  # the checkpoint model_name serves (the model card's root)
    reasoning_parser: str | None = None  # "qwen3", "deepseek_r1": chats' reasoning_content
    enable_server_load_tracking: bool = False  # GET /load: generation requests in progress
    # every stream carries usage, on every chunk, whatever its stream_options (vLLM's flag)
    enable_force_include_usage: bool = False
    root_path: str = ""  # the path prefix of a proxy in front: /v1/... is served under it too
    chat_template: str | None = None  # a template for every chat, instead of the checkpoint's
    # the newest stored /v1/responses kept (serving_responses.py); 0: none is stored
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    # CORS (vLLM's defaults): which other origins' pages may call the API from a browser
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    model_aliases: tuple[str, ...] = ()  # other names requests may use for the model
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    enable_request_id_headers: bool = False  # every response carries X-Request-Id (vLLM's)
    # what a request leaves unset, sampled as the model's generation config recommends
    # (sampling_params.generation_defaults; `serve --generation-config`, vLLM's flag)
    sampling_defaults: dict[str, typing.Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.reasoning_parser not in (None, "qwen3", "deepseek_r1"):
            raise ValueError(
                f"reasoning_parser must be qwen3 or deepseek_r1, got {self.reasoning_parser!r}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        check_root_path(self.root_path)
        for name in ("max_request_body_bytes", "max_choices_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
