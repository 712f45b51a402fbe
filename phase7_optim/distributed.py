"""Tensor parallelism's processes: one per rank, rank 0 leads, the others follow its steps.

Problem: a model split across GPUs (linear.py, embedding.py) needs one process per GPU, all
running the same forward pass at the same time, and only one of them may decide anything:
schedule, sample, stop. Two ranks that each sampled would soon disagree about the sequences.
Idea (nano-vllm's and vLLM's): the user's process is rank 0 and owns the whole engine (scheduler,
block manager, sampler). It spawns ranks 1..size-1 as worker processes that own only their model
shard and their KV cache shard. Each step, rank 0 broadcasts the step's inputs (its model
runner's step buffers: token ids, positions, slots, block tables, lengths) and every rank runs the
same forward pass (a CUDA graph replay or an eager step, as rank 0 does); the all-reduces inside
the layers meet, the LM head all-gathers the logits, and rank 0 samples. A worker never sees a
sequence, a sampled token, or a scheduler.
- NCCL over the GPUs' links on CUDA, gloo over TCP on CPU (so CI runs tensor parallelism).
- The KV cache holds the same number of blocks on every rank (each block holds that rank's KV
  heads), since the block manager on rank 0 hands out block ids valid everywhere: the config's
  `num_kv_blocks`. (An engine that sized its cache from free memory, as vLLM does, would take the
  minimum over ranks.)
- Shutdown: rank 0 broadcasts a stop message; each worker frees its runner (CUDA graphs hold NCCL
  work, so they go first), then leaves the process group; rank 0 joins the processes.

Invariants:
- with `tensor_parallel_size == 1` none of this runs: no process group, no extra process;
- every rank runs the same sequence of collectives (same forward pass on the same inputs, same
  shapes), or the group deadlocks: that is why the inputs are broadcast rather than recomputed.
"""

import atexit
import datetime
import enum
import multiprocessing
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .config import EngineConfig

if TYPE_CHECKING:
    from .model_runner import ModelRunner, PreparedStep

HOST = "127.0.0.1"  # all ranks on one machine
# Every rank must reach the rendezvous in this time (spawning and importing torch take seconds).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
JOIN_TIMEOUT_S = 60.0  # how long rank 0 waits for a stopped worker to exit before killing it


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")

    def split(self, n: int, what: str) -> int:
        """n items shared evenly by the ranks: this rank's count; uneven splits are refused."""
        if n % self.size != 0:
            raise ValueError(
                f"{what} ({n}) must be divisible by tensor_parallel_size ({self.size})"
            )
        return n // self.size


SINGLE_RANK = TensorParallel()  # no tensor parallelism: the model is whole on one device


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum x over the ranks, in place (every rank gets the sum)."""
    if tp.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(..., n) on each rank -> (..., size * n) on every rank, rank 0's columns first."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r computes on GPU r; on CPU all ranks share the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def init_process_group(tp: TensorParallel, device: torch.device, port: int) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its GPU
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{HOST}:{port}",
        rank=tp.rank,
        world_size=tp.size,
        timeout=RENDEZVOUS_TIMEOUT,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ---- Step inputs, rank 0 -> the others --------------------------------------------------------
# Rank 0 packs a step into its model runner's device buffers (model_runner.StepInputs); the
# workers have the same buffers, and each step arrives straight in them: a header of ints (what
# `PreparedStep` needs), then one in-place broadcast per buffer, of the rows the step uses.
# Block-table rows go whole (contiguous); entries past a sequence's blocks are never read.


class Command(enum.IntEnum):
    STEP = 0
    STOP = 1


# The header: command, then these (graph bucket 0: an eager step).
HEADER_FIELDS = ("graph_batch_size", "num_seqs", "num_tokens", "num_sampled", "max_query_len",
                 "max_seq_len", "width")  # fmt: skip


def _step_buffers(runner: "ModelRunner", rows: int, num_tokens: int, num_sampled: int):
    inp = runner.inputs
    return (
        inp.input_ids_d[:num_tokens], inp.positions_d[:num_tokens], inp.slot_mapping_d[:num_tokens],
        inp.query_start_loc_d[: rows + 1], inp.seq_lens_d[:rows],
        inp.logits_indices_d[:num_sampled], inp.block_tables_d[:rows],
    )  # fmt: skip


def send_step(runner: "ModelRunner", step: "PreparedStep") -> None:
    """Rank 0: broadcast a prepared step (already in its device buffers) to the other ranks."""
    batch = step.batch
    if step.graph_batch_size is None:
        values = (0, step.num_seqs, step.num_tokens, len(batch.logits_indices),
                  batch.max_query_len, batch.max_seq_len, batch.block_tables.shape[1])  # fmt: skip
        rows, tokens, sampled = step.num_seqs, step.num_tokens, len(batch.logits_indices)
    else:  # a graph replays on its bucket's rows, padding included, so those go
        rows = tokens = sampled = step.graph_batch_size
        values = (rows, step.num_seqs, step.num_tokens, sampled, 1, 0, 0)
    header = torch.tensor((Command.STEP, *values), dtype=torch.long)
    if runner.device.type == "cuda":  # pinned: the copy neither blocks nor syncs the host
        header = header.pin_memory().to(runner.device, non_blocking=True)
    dist.broadcast(header, src=0)
    for buffer in _step_buffers(runner, rows, tokens, sampled):
        dist.broadcast(buffer, src=0)


def send_stop(device: torch.device) -> None:
    header = torch.zeros(1 + len(HEADER_FIELDS), dtype=torch.long, device=device)
    header[0] = Command.STOP
    dist.broadcast(header, src=0)


def receive_step(runner: "ModelRunner") -> "PreparedStep | None":
    """Ranks > 0: the next step, received into this rank's buffers; None when rank 0 stops."""
    # Imported here: attention.py and model_runner.py import the layers, which import us.
    from .attention import ForwardBatch
    from .model_runner import PreparedStep

    header = torch.empty(1 + len(HEADER_FIELDS), dtype=torch.long, device=runner.device)
    dist.broadcast(header, src=0)
    command, *values = header.tolist()
    if command == Command.STOP:
        return None
    h = dict(zip(HEADER_FIELDS, values, strict=True))
    graph_rows = h["graph_batch_size"] or None
    rows = graph_rows or h["num_seqs"]
    tokens, sampled = (rows, rows) if graph_rows else (h["num_tokens"], h["num_sampled"])
    for buffer in _step_buffers(runner, rows, tokens, sampled):
        dist.broadcast(buffer, src=0)
    batch = None
    if graph_rows is None:  # the buffers' rows, as rank 0's batch views them
        inp, width = runner.inputs, h["width"]
        batch = ForwardBatch(
            query_start_loc=inp.query_start_loc_d[: rows + 1],
            seq_lens=inp.seq_lens_d[:rows],
            slot_mapping=inp.slot_mapping_d[:tokens],
            block_tables=inp.block_tables_d[:rows, :width],
            logits_indices=inp.logits_indices_d[:sampled],
            max_query_len=h["max_query_len"],
            max_seq_len=h["max_seq_len"],
            block_size=runner.block_size,
        )
    return PreparedStep(h["num_seqs"], h["num_tokens"], graph_rows, batch, samples=None)


# ---- Processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank; it crosses a process spawn, so it is picklable."""

    model_dir: str
    dtype: str | torch.dtype
    device_type: str  # "cuda" or "cpu"; rank r uses GPU r
    config: EngineConfig
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
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the stop is sent before NCCL goes away
            dist.destroy_process_group()
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
    from .loader import read_hf_config  # here: the model's layers import this module
    from .model import ModelConfig, Qwen3ForCausalLM

    with torch.device("meta"):
        model_config = ModelConfig.from_hf(read_hf_config(Path(model_dir)))
        Qwen3ForCausalLM(model_config, TensorParallel(0, size))
    spec = WorkerSpec(str(model_dir), dtype, device.type, config, free_port(),
                      torch.get_num_threads())  # fmt: skip
    return TPWorkers(spec)


def run_worker(tp: TensorParallel, spec: WorkerSpec) -> None:
    """A worker process's whole life: join the group, load its shard, follow rank 0's steps."""
    torch.set_num_threads(spec.num_threads)
    device = rank_device(torch.device(spec.device_type), tp.rank)
    init_process_group(tp, device, spec.port)
    # Imported here, not at the top: the model's layers import this module for its collectives.
    from .loader import load_model
    from .model_runner import ModelRunner

    config = spec.config
    loaded = load_model(spec.model_dir, spec.dtype, device, tp, config.load_format, config.kernels)
    runner = ModelRunner(loaded.model, spec.config, block_manager=None)  # never prepares a step
    try:
        with torch.inference_mode():
            while (step := receive_step(runner)) is not None:
                runner.forward(step)  # logits: rank 0 samples
    finally:
        runner.shutdown()  # CUDA graphs hold NCCL work: gone before the process group is
        dist.destroy_process_group()
