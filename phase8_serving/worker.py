"""Tensor parallelism's processes: one per rank, rank 0 leads, the others follow its steps.

Problem: a model split across GPUs (linear.py, embedding.py) needs one process per GPU, all
running the same forward pass at the same time, and only one of them may decide anything:
schedule, sample, stop. Two ranks that each sampled would soon disagree about the sequences.
Idea: the user's process is rank 0 and owns the whole engine (scheduler, block manager, sampler).
It spawns ranks 1..size-1 as worker processes that own only their model shard and their KV cache
shard. Each step, rank 0's model runner broadcasts the step's prepared input buffers
(input_batch.py) and every rank runs the same forward pass (a CUDA graph replay or an eager step,
as rank 0 does); the all-reduces inside the layers meet, the LM head all-gathers the logits, and
rank 0 samples. A worker never sees a sequence, a sampled token, or a scheduler.
- The KV cache holds the same number of blocks on every rank (each block holds that rank's KV
  heads), since the block manager on rank 0 hands out block ids valid everywhere: each rank
  sizes its cache from its own memory, and all take the minimum (kv_cache_config.py).
- Shutdown: rank 0 broadcasts a stop message; each worker frees its runner (CUDA graphs hold NCCL
  work, so they go first), then all ranks meet once more and leave the process group together
  (`leave_process_group`); rank 0 joins the processes.

Invariants:
- with `tensor_parallel_size == 1` none of this runs: no process group, no extra process;
- a worker runs exactly the steps rank 0 sends, in order, and nothing else.
"""

import atexit
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .config import EngineConfig
from .distributed import (
    TensorParallel,
    free_port,
    init_process_group,
    leave_process_group,
    rank_device,
)
from .input_batch import receive_step, send_stop
from .kv_cache_config import determine_kv_cache_config
from .loader import load_model, read_hf_config
from .model import ModelConfig, Qwen3ForCausalLM
from .model_runner import ModelRunner

JOIN_TIMEOUT_S = 60.0  # how long rank 0 waits for a stopped worker to exit before killing it


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank; it crosses a process spawn, so it is picklable."""

    model_dir: str
    dtype: str | torch.dtype
    device_type: str  # "cuda" or "cpu"; rank r uses GPU r
    config: EngineConfig  # its batch sizes resolved, as rank 0's
    port: int
    num_threads: int  # torch intra-op threads, as rank 0's (CPU ranks share the cores)


class TPWorkers:
    """Rank 0's handle on ranks 1..size-1: spawned processes that follow rank 0's steps.

    Spawned, not forked: a forked child inherits the parent's CUDA state, which CUDA forbids, and
    spawning gives every rank the same clean start. Daemon processes die with rank 0 if it is
    killed; `stop` is the clean way out.
    """

    def __init__(self, spec: WorkerSpec):
        size = spec.config.tensor_parallel_size
        ctx = multiprocessing.get_context("spawn")
        self.processes = [
            ctx.Process(target=run_worker, args=(TensorParallel(r, size), spec), daemon=True)
            for r in range(1, size)
        ]
        for process in self.processes:
            process.start()
        self.device = rank_device(torch.device(spec.device_type), 0)
        init_process_group(TensorParallel(0, size), self.device, spec.port)
        atexit.register(self.stop)  # a script that never calls stop still exits cleanly

    def stop(self) -> None:
        """Tell the workers to exit, leave the group, and wait for them. Idempotent. Rank 0's
        CUDA graphs must be gone first (the model runner's `shutdown`)."""
        if dist.is_initialized():
            send_stop(self.device)
            leave_process_group(self.device)  # the workers read the stop before the group goes
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():  # a worker stuck in a collective: do not hang rank 0 with it
                process.kill()
                process.join()
        atexit.unregister(self.stop)

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.processes]


def start_workers(
    model_dir: os.PathLike, dtype: str | torch.dtype, device: torch.device, config: EngineConfig
) -> TPWorkers:
    """Rank 0: spawn ranks 1..size-1 and form the process group with them."""
    size = config.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs (one per rank), "
            f"found {torch.cuda.device_count()}"
        )
    # Every split the ranks will make, checked before any process starts (shapes only, on the
    # meta device): a rank failing to build its shard would leave the others in a collective.
    with torch.device("meta"):
        model_config = ModelConfig.from_hf(read_hf_config(Path(model_dir)))
        Qwen3ForCausalLM(model_config, TensorParallel(0, size))
    spec = WorkerSpec(str(model_dir), dtype, device.type, config, free_port(),
                      torch.get_num_threads())  # fmt: skip
    return TPWorkers(spec)


def run_worker(tp: TensorParallel, spec: WorkerSpec) -> None:
    """A worker process's whole life: join the group, load its shard, follow rank 0's steps."""
    # Ctrl-C reaches the whole process group: rank 0 stops the workers (`TPWorkers.stop`) once it
    # has left its step; a worker interrupted in a collective would leave rank 0 hanging in it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    device = rank_device(torch.device(spec.device_type), tp.rank)
    init_process_group(tp, device, spec.port)
    config = spec.config
    loaded = load_model(spec.model_dir, spec.dtype, device, tp, config.load_format, config.kernels)
    kv_cache_config = determine_kv_cache_config(loaded.model, spec.config)  # as rank 0 does
    # never prepares a step: no block manager
    runner = ModelRunner(loaded.model, spec.config, None, kv_cache_config)
    stopped = False
    try:
        with torch.inference_mode():
            while (step := receive_step(runner.inputs)) is not None:
                runner.forward(step)  # logits: rank 0 samples
        stopped = True
    finally:
        runner.shutdown()  # CUDA graphs hold NCCL work: gone before the process group is
        leave_process_group(device, in_step=not stopped)
