"""A step's inputs: static (pinned) buffers filled without per-token Python, and sent to the ranks.

Problem: phase 6 built a step's tensors from Python lists, token by token, as new tensors every
step; on a GPU that host work takes longer than the step itself, and a CUDA graph replays only
from the addresses it was captured with.
Idea (vLLM's `InputBatch` and `BlockTable`, in small): allocate every input buffer once at its
largest size, as a pinned host array and its device twin; the model runner fills the host arrays
with numpy and copies them over without blocking. Each sequence's block table is mirrored as a
numpy row that only grows by the blocks added since the last step (`HostBlockTables`).
- `StepInputs.step_views` is the one list of what a step reads (token ids, positions, slots,
  sequence metadata, block tables); `StepInputs.forward_batch` the one place a `ForwardBatch` is
  made from the buffers.
- Tensor parallelism: rank 0 prepares each step and broadcasts it (`send_step`): a header of ints,
  then one in-place broadcast per device buffer, over the same process group as the layers'
  collectives; the other ranks receive straight into their own buffers (`receive_step`) and run
  the same forward pass. Unlike nano-vllm (rank 0 pickles each method call into shared memory and
  sets an event per worker, and every rank prepares its own inputs) and vLLM v1 (its executor
  broadcasts the scheduler's output through a shared-memory message queue, and every worker
  prepares its own inputs), a worker here never sees a sequence: only tensors.

A hybrid model's runner also fills `state_slots`, each sequence's row in the state pool
(state_pool.py); other models neither fill nor copy it.

Invariants:
- rows past a step's sequences (up to a CUDA graph's bucket) are padding: slot PAD_SLOT_ID
  (writes nowhere), state slot PAD_SLOT_ID (no state read or written) and seq_len 0 (reads
  nothing), the convention of attention.py (PAD_SLOT_ID: kernels/__init__.py);
- a host buffer is rewritten only after the copies that read it last step are done
  (`wait_for_copies`);
- every rank receives the buffers a step reads, in the same order, so the forward passes agree;
  with overlap scheduling rank 0 fills the placeholder input ids on the device before it sends
  them (model_runner.py), so the other ranks never need the sampled ids.
"""

import enum

import numpy as np
import torch
import torch.distributed as dist

from .attention import METADATA_DTYPE, ForwardBatch
from .kernels import PAD_SLOT_ID  # Triton-free: the kernels load on first use


class HostBlockTables:
    """The block manager's tables mirrored as numpy rows, one per sequence, each appended to as
    its table grows: a step copies new block ids only, then gathers its rows in one operation."""

    INITIAL_ROWS = 64  # grows by doubling: preempted sequences keep their row until they finish

    def __init__(self, max_blocks: int):
        self.ids = np.zeros((self.INITIAL_ROWS, max_blocks), dtype=np.int32)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.sources: list[list[int] | None] = [None] * self.INITIAL_ROWS  # the mirrored lists
        self.num_blocks = [0] * self.INITIAL_ROWS
        self.free_rows = list(range(self.INITIAL_ROWS - 1, -1, -1))

    def row(self, seq_id: int, table: list[int]) -> int:
        """`seq_id`'s row, brought up to date with `table` (the block manager's list for it)."""
        r = self.row_of.get(seq_id)
        if r is None:
            r = self.row_of[seq_id] = self._take_row()
        if self.sources[r] is not table:  # a new list: first use, or rebuilt after preemption
            self.sources[r], self.num_blocks[r] = table, 0
        done, n = self.num_blocks[r], len(table)
        if n > done:
            self.ids[r, done:n] = table[done:n]
            self.num_blocks[r] = n
        return r

    def _take_row(self) -> int:
        if not self.free_rows:
            old = len(self.sources)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.sources += [None] * old
            self.num_blocks += [0] * old
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def release(self, seq_id: int) -> None:
        r = self.row_of.pop(seq_id, None)
        if r is not None:
            self.sources[r] = None
            self.free_rows.append(r)


class PreparedStep:
    """What `prepare` made of a schedule: the model's inputs, and how to read its outputs."""

    def __init__(self, num_seqs, num_tokens, num_sampled, graph_batch_size, batch, samples,
                 num_fed=0, prev_sampled=None):  # fmt: skip
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.num_sampled = num_sampled  # sequences whose logits are computed
        self.graph_batch_size = graph_batch_size  # the CUDA graph bucket, or None: run eagerly
        self.batch = batch  # ForwardBatch of an eager step, None for a graph replay
        self.samples = samples  # (S,) bool numpy: which scheduled sequences sample (rank 0 only)
        # Overlap scheduling (rank 0 only): input ids that are placeholders, taken on the device
        # from `prev_sampled`, the previous step's sampled ids (R',)
        self.num_fed = num_fed
        self.prev_sampled = prev_sampled
        # prompt_logprobs (rank 0 only): (seq_ids, counts, rows, targets, ks) of the prompt
        # positions this step scores (ModelRunner._prompt_rows), or None
        self.prompt_rows = None

    @property
    def buffer_rows(self) -> tuple[int, int, int]:
        """(tokens, sequences, sampling rows) the step occupies in the input buffers: a graph
        replays its whole bucket, padded rows included."""
        if self.graph_batch_size is None:
            return self.num_tokens, self.num_seqs, self.num_sampled
        return self.graph_batch_size, self.graph_batch_size, self.graph_batch_size


class StepInputs:
    """Host and device buffers of one step's inputs, allocated once at their largest size.

    `inputs.<name>` is a numpy view of a (pinned) host buffer, `inputs.<name>_d` its device
    twin (on CPU the same memory: the model reads the host buffer itself).
    """

    def __init__(
        self, max_tokens, max_seqs, max_blocks, block_size, device: torch.device,
        state_slots: bool = False,  # a hybrid model's: each sequence's state pool slot
    ):  # fmt: skip
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.max_blocks = max_blocks  # block-table columns: a sequence at the model's context
        self.block_size = block_size
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (host, device)
        self.input_ids, self.input_ids_d = self._buffer("input_ids", max_tokens, dtype=torch.long)
        self.positions, self.positions_d = self._buffer("positions", max_tokens, dtype=torch.long)
        self.slot_mapping, self.slot_mapping_d = self._buffer("slot_mapping", max_tokens)
        self.query_start_loc, self.query_start_loc_d = self._buffer("query_start_loc", max_seqs + 1)
        self.seq_lens, self.seq_lens_d = self._buffer("seq_lens", max_seqs)
        self.logits_indices, self.logits_indices_d = self._buffer("logits_indices", max_seqs)
        self.block_tables, self.block_tables_d = self._buffer("block_tables", max_seqs, max_blocks)
        self.decode_order, self.decode_order_d = self._buffer("decode_order", max_seqs)
        # Overlap scheduling, rank 0's own (the ranks receive input ids with them filled in):
        # where in input_ids each placeholder goes, and its row in the previous step's sampled ids
        self.placeholder_indices, self.placeholder_indices_d = self._buffer(
            "placeholder_indices", max_seqs, dtype=torch.long
        )
        self.prev_sampled_rows, self.prev_sampled_rows_d = self._buffer(
            "prev_sampled_rows", max_seqs, dtype=torch.long
        )
        self.has_state_slots = state_slots
        self.state_slots, self.state_slots_d = self._buffer("state_slots", max_seqs)
        self.state_slots_d.fill_(PAD_SLOT_ID)
        self.slot_mapping_d.fill_(PAD_SLOT_ID)  # graph capture and warm-up write nothing
        self.decode_order[:] = np.arange(max_seqs)  # ... and their decode order is a permutation
        self.decode_order_d.copy_(torch.from_numpy(self.decode_order))
        # The host buffers are rewritten next step; the copies reading them must be done by then.
        self.copied = torch.cuda.Event() if self.on_gpu else None

    def _buffer(self, name, *shape, dtype=METADATA_DTYPE) -> tuple[np.ndarray, torch.Tensor]:
        # Pinned pages let the copy run without blocking the host.
        host = torch.zeros(shape, dtype=dtype, pin_memory=self.on_gpu)
        dev = host.to(self.device) if self.on_gpu else host
        self.pairs[name] = (host, dev)
        return host.numpy(), dev

    def step_views(
        self, num_tokens, num_seqs, num_sampled, width
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host, device) views of every buffer a step of this size reads, block tables `width`
        columns wide: what is copied to the device, and what is sent to the other ranks."""
        views = (
            ("input_ids", np.s_[:num_tokens]), ("positions", np.s_[:num_tokens]),
            ("slot_mapping", np.s_[:num_tokens]), ("query_start_loc", np.s_[: num_seqs + 1]),
            ("seq_lens", np.s_[:num_seqs]), ("logits_indices", np.s_[:num_sampled]),
            ("block_tables", np.s_[:num_seqs, :width]), ("decode_order", np.s_[:num_seqs]),
        )  # fmt: skip
        if self.has_state_slots:
            views += (("state_slots", np.s_[:num_seqs]),)
        return [(self.pairs[name][0][rows], self.pairs[name][1][rows]) for name, rows in views]

    def wait_for_copies(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # long done in practice: the last step's tokens were read

    def copy_to_device(self, num_tokens, num_seqs, num_sampled, width, num_fed) -> None:
        if not self.on_gpu:
            return
        views = self.step_views(num_tokens, num_seqs, num_sampled, width)
        for name in ("placeholder_indices", "prev_sampled_rows"):
            host, dev = self.pairs[name]
            views.append((host[:num_fed], dev[:num_fed]))
        for host, dev in views:
            dev.copy_(host, non_blocking=True)
        self.copied.record()

    def forward_batch(
        self, num_seqs, num_tokens, num_sampled, max_query_len, max_seq_len, width, num_decodes
    ) -> ForwardBatch:
        """The `ForwardBatch` of a step of this size: views of the device buffers."""
        return ForwardBatch(
            query_start_loc=self.query_start_loc_d[: num_seqs + 1],
            seq_lens=self.seq_lens_d[:num_seqs],
            slot_mapping=self.slot_mapping_d[:num_tokens],
            block_tables=self.block_tables_d[:num_seqs, :width],
            logits_indices=self.logits_indices_d[:num_sampled],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            num_decodes=num_decodes,
            decode_order=self.decode_order_d[:num_decodes],
            state_slots=self.state_slots_d[:num_seqs] if self.has_state_slots else None,
        )


# ---- Tensor parallelism: a prepared step, rank 0 -> the other ranks ---------------------------


class Command(enum.IntEnum):
    STEP = 0
    STOP = 1


# The header: command, then these (graph bucket 0: an eager step; the maxima and the width are
# an eager step's, 0 for a replay).
HEADER_FIELDS = ("graph_batch_size", "num_seqs", "num_tokens", "num_sampled", "max_query_len",
                 "max_seq_len", "width", "num_decodes")  # fmt: skip


def send_step(inputs: StepInputs, step: PreparedStep) -> None:
    """Rank 0: broadcast a prepared step (already in its device buffers) to the other ranks."""
    b = step.batch
    eager = (
        (0, 0, 0, 0)
        if b is None
        else (b.max_query_len, b.max_seq_len, b.block_tables.shape[1], b.num_decodes)
    )
    values = (step.graph_batch_size or 0, step.num_seqs, step.num_tokens, step.num_sampled, *eager)
    header = torch.tensor((Command.STEP, *values), dtype=torch.long)
    if inputs.on_gpu:  # NCCL sends device tensors; pinned, the copy neither blocks nor syncs
        header = header.pin_memory().to(inputs.device, non_blocking=True)
    dist.broadcast(header, src=0)
    _broadcast_buffers(inputs, step)


def send_stop(device: torch.device) -> None:
    header = torch.zeros(1 + len(HEADER_FIELDS), dtype=torch.long, device=device)
    header[0] = Command.STOP
    dist.broadcast(header, src=0)


def receive_step(inputs: StepInputs) -> PreparedStep | None:
    """Ranks > 0: the next step, received into this rank's buffers; None when rank 0 stops."""
    header = torch.empty(1 + len(HEADER_FIELDS), dtype=torch.long, device=inputs.device)
    dist.broadcast(header, src=0)
    command, *values = header.tolist()
    if command == Command.STOP:
        return None
    h = dict(zip(HEADER_FIELDS, values, strict=True))
    sizes = h["num_seqs"], h["num_tokens"], h["num_sampled"]
    graph_batch_size = h["graph_batch_size"] or None
    batch = None  # views: they are right before the buffers are filled
    if graph_batch_size is None:
        batch = inputs.forward_batch(
            *sizes, h["max_query_len"], h["max_seq_len"], h["width"], h["num_decodes"]
        )
    step = PreparedStep(*sizes, graph_batch_size, batch, samples=None)
    _broadcast_buffers(inputs, step)
    return step


def _broadcast_buffers(inputs: StepInputs, step: PreparedStep) -> None:
    # Block-table rows go whole (contiguous, as a broadcast needs); columns past a sequence's
    # blocks are never read.
    for _, buffer in inputs.step_views(*step.buffer_rows, inputs.max_blocks):
        dist.broadcast(buffer, src=0)
