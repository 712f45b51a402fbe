"""Tensor parallelism's processes: one per rank, rank 0 leads, the others follow its steps.

Problem: a model split across GPUs (linear.py, embedding.py) needs one process per GPU, all
running the same forward pass at the same time, and only one of them may decide anything:
schedule, sample, stop. Two ranks that each sampled would soon disagree about the sequences.
Idea (nano-vllm's and vLLM's): the user's process is rank 0 and owns the whole engine (scheduler,
block manager, sampler). It spawns ranks 1..size-1 as worker processes that own only their model
shard and their KV cache shard. Each step, rank 0 broadcasts the step's inputs (token ids,
positions, the `ForwardBatch`) and every rank runs the same forward pass; the all-reduces inside
the layers meet, and the logits are gathered on rank 0, which samples. A worker never sees a
sequence, a token it chose, or a scheduler.
- NCCL over the GPUs' links on CUDA, gloo over TCP on CPU (so CI runs tensor parallelism).
- The KV cache holds the same number of blocks on every rank: the minimum over ranks of what each
  could hold, since the block manager on rank 0 hands out block ids valid everywhere.
- Shutdown: rank 0 broadcasts a stop message; each worker frees its runner (CUDA graphs hold NCCL
  work, so they go first), then leaves the process group; rank 0 joins the processes.

Invariants:
- with `tensor_parallel_size == 1` none of this runs: no process group, no extra process;
- every rank runs the same sequence of collectives (same forward pass on the same inputs, same
  shapes), or the group deadlocks: that is why the inputs are broadcast rather than recomputed.
"""

import dataclasses
import datetime
import enum
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def min_over_ranks(n: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest n of all ranks (the KV block count every rank can hold)."""
    if tp.size == 1:
        return n
    value = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


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
# Two broadcasts per step: a fixed-length int64 header (what follows: for every item its kind,
# dtype and shape, or its int value), then every tensor packed into one int64 payload.


class Command(enum.IntEnum):
    STEP = 0
    STOP = 1


class Kind(enum.IntEnum):
    TENSOR = 0
    INT = 1
    BOOL = 2
    NONE = 3


MAX_DIMS = 3  # the step's tensors are at most 2-D (block_tables); one spare
ITEM_WIDTH = 3 + MAX_DIMS  # kind, dtype code or value, ndim, shape
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _header_len(batch_type: type) -> int:
    return 1 + (2 + len(dataclasses.fields(batch_type))) * ITEM_WIDTH  # command, ids, positions


def _encode(item) -> list[int]:
    if isinstance(item, torch.Tensor):
        if item.dtype not in INDEX_DTYPES or item.dim() > MAX_DIMS:
            raise TypeError(f"cannot broadcast a {item.dtype} tensor of {item.dim()} dims")
        shape = list(item.shape) + [0] * (MAX_DIMS - item.dim())
        return [Kind.TENSOR, INDEX_DTYPES.index(item.dtype), item.dim(), *shape]
    if item is None:
        return [Kind.NONE] + [0] * (ITEM_WIDTH - 1)
    if isinstance(item, bool | int):
        kind = Kind.BOOL if isinstance(item, bool) else Kind.INT
        return [kind, int(item)] + [0] * (ITEM_WIDTH - 2)
    raise TypeError(f"cannot broadcast a step input of type {type(item).__name__}")


def send_step(tp: TensorParallel, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> None:
    """Rank 0: broadcast one step's inputs (`batch` is the ForwardBatch dataclass)."""
    items = [input_ids, positions] + [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    header = [Command.STEP] + [v for item in items for v in _encode(item)]
    device = input_ids.device
    dist.broadcast(torch.tensor(header, dtype=torch.long, device=device), src=0)
    tensors = [t.reshape(-1).long() for t in items if isinstance(t, torch.Tensor)]
    dist.broadcast(torch.cat(tensors), src=0)


def send_stop(tp: TensorParallel, batch_type: type, device: torch.device) -> None:
    header = torch.zeros(_header_len(batch_type), dtype=torch.long, device=device)
    header[0] = Command.STOP
    dist.broadcast(header, src=0)


def receive_step(batch_type: type, device: torch.device):
    """Ranks > 0: the next step's (input_ids, positions, batch), or None when rank 0 stops."""
    header = torch.empty(_header_len(batch_type), dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    header = header.tolist()
    if header[0] == Command.STOP:
        return None
    items = [header[1 + i : 1 + i + ITEM_WIDTH] for i in range(0, len(header) - 1, ITEM_WIDTH)]
    shapes = [it[3 : 3 + it[2]] for it in items if it[0] == Kind.TENSOR]
    payload = torch.empty(sum(_numel(s) for s in shapes), dtype=torch.long, device=device)
    dist.broadcast(payload, src=0)
    values, offset = [], 0
    for kind, value, ndim, *shape in items:
        if kind == Kind.TENSOR:
            numel = _numel(shape[:ndim])
            tensor = payload[offset : offset + numel].view(shape[:ndim]).to(INDEX_DTYPES[value])
            values.append(tensor)
            offset += numel
        else:
            values.append({Kind.INT: value, Kind.BOOL: bool(value), Kind.NONE: None}[kind])
    input_ids, positions, *fields = values
    return input_ids, positions, batch_type(*fields)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
