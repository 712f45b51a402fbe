"""Tensor parallelism's group: which rank this process is, and the collectives the layers call.

Problem: a model split across GPUs (linear.py, embedding.py) needs every rank to combine its
partial results with the others' at fixed points of the forward pass.
Idea (vLLM's `parallel_state` and communication ops, in a few functions): `TensorParallel` says
which rank of how many this process is; every layer takes one and splits its weights with it;
`all_reduce` sums the row-parallel layers' partial outputs and `all_gather_last_dim` puts the
LM head's vocabulary slices side by side; `min_over_ranks` makes the ranks agree on the size of
the KV cache. NCCL over the GPUs' links on CUDA, gloo over TCP on CPU (so CI runs tensor
parallelism). The processes that hold the ranks live in worker.py.

This module is the low half of tensor parallelism: the layers import it, and it imports nothing
of this package (a layer never depends on the processes or the runner that drive it).

Invariants:
- with `size == 1` every collective returns its input: no process group, nothing to wait for;
- every rank runs the same sequence of collectives (same forward pass on the same inputs, same
  shapes), or the group deadlocks.
"""

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # all ranks on one machine
# Every rank must reach the rendezvous in this time (spawning and importing torch take seconds).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
# How long a rank leaving the group waits for the others to arrive there too.
LEAVE_TIMEOUT = datetime.timedelta(seconds=60)


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


def min_over_ranks(n: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest of the ranks' n, on every rank."""
    if tp.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


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


def leave_process_group(device: torch.device, in_step: bool = False) -> None:
    """Every rank's last call. Ranks must leave together: gloo aborts a process ("terminate
    called without an active exception") when its peer tears the group down while it still reads
    the last message, so a clean exit meets the others first. gloo's barrier has a timeout (a
    peer that died must not hang the exit); NCCL's has none, and there every rank's queued work
    drained on its GPU is enough. `in_step`: this rank left mid-step (an error), so the others
    will never arrive; go at once."""
    if not in_step:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            try:
                dist.monitored_barrier(timeout=LEAVE_TIMEOUT)
            except RuntimeError:  # a peer died or hung: leave without it, rank 0 reaps it
                pass
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]
