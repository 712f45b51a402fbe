"""Model runner: turns the scheduler's decision into tensors, one forward pass, and tokens.

Problem: the scheduler thinks in sequences and token counts; the model wants packed tensors.
Idea: for every scheduled (sequence, num_new_tokens), take the next `num_new_tokens` of its token
ids, their positions (num_computed_tokens onwards) and their cache slots, pack all sequences into
one flat batch, run the model once, and sample a token for each sequence whose new tokens reach
its end (a sequence still mid-prompt samples nothing).

The runner owns the KV cache tensors and one `torch.Generator` per seeded request (its random
stream survives preemption); it never decides who runs.

Phase 5: slots come from block tables, and the block tables travel to attention in the batch; a
second, CPU-side KV pool holds the blocks of sequences preempted by swapping.

Phase 7 (speed): on a GPU, phase 6 spent most of a decode step in Python and in launches: lists
built token by token, new tensors every step, one sampler call and one host sync per request.
- `StepInputs` fills preallocated (pinned) host arrays with numpy, with no per-token Python loop,
  and copies them to preallocated device buffers without blocking; each sequence's block table is
  kept as a numpy row that only grows by the blocks added since the last step.
- Decode-only steps (every scheduled sequence brings one token and samples) replay a CUDA graph
  captured for the smallest bucket that holds the batch (cuda_graph.py); other steps run eagerly.
- `sample_batch` samples the whole batch on the device; the sampled ids are copied to pinned host
  memory without blocking, and `SampledTokens.tolist()` is the step's only sync.
- Overlap scheduling (engine.py): `launch` queues a whole step and returns at once. A sequence
  whose last input token was sampled by the previous step, not yet read by the host (a
  placeholder), gets it on the device: `execute` gathers it from the previous step's
  `SampledTokens.device` into the input ids, so no token makes a round trip through the host.
- Tensor parallelism (distributed.py): rank 0's runner broadcasts each prepared step's buffers
  before running it; the other ranks' runners only receive steps and run `forward`, never
  `prepare` or sampling, and their KV caches hold their ranks' KV heads.
"""

import numpy as np
import torch

from .attention import METADATA_DTYPE, PAD_SLOT_ID, ForwardBatch
from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graph import DecodeGraphs, decode_buckets
from .distributed import send_step
from .kv_cache import KVCache, copy_blocks
from .model import Qwen3ForCausalLM
from .sampling import SamplingBatch, sample_batch
from .sequence import Sequence


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


class StepInputs:
    """Host and device buffers of one step's inputs, allocated once at their largest size.

    `inputs.<name>` is a numpy view of a (pinned) host buffer, `inputs.<name>_d` its device
    twin. Rows past the batch (up to a CUDA graph's bucket) are padding: slot PAD_SLOT_ID (writes
    nowhere) and seq_len 0 (reads nothing), the convention of attention.py.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (host, device)
        self.input_ids, self.input_ids_d = self._buffer("input_ids", max_tokens, dtype=torch.long)
        self.positions, self.positions_d = self._buffer("positions", max_tokens, dtype=torch.long)
        self.slot_mapping, self.slot_mapping_d = self._buffer("slot_mapping", max_tokens)
        self.query_start_loc, self.query_start_loc_d = self._buffer("query_start_loc", max_seqs + 1)
        self.seq_lens, self.seq_lens_d = self._buffer("seq_lens", max_seqs)
        self.logits_indices, self.logits_indices_d = self._buffer("logits_indices", max_seqs)
        self.block_tables, self.block_tables_d = self._buffer("block_tables", max_seqs, max_blocks)
        # placeholders: where in input_ids each goes, and which row of the previous step's
        # sampled ids holds it
        self.placeholder_indices, self.placeholder_indices_d = self._buffer(
            "placeholder_indices", max_seqs, dtype=torch.long
        )
        self.prev_sampled_rows, self.prev_sampled_rows_d = self._buffer(
            "prev_sampled_rows", max_seqs, dtype=torch.long
        )
        self.slot_mapping_d.fill_(PAD_SLOT_ID)  # graph capture and warm-up write nothing
        # The host buffers are rewritten next step; the copies reading them must be done by then.
        self.copied = torch.cuda.Event() if self.on_gpu else None

    def _buffer(self, name, *shape, dtype=METADATA_DTYPE) -> tuple[np.ndarray, torch.Tensor]:
        # Pinned pages let the copy run without blocking the host; on CPU the model reads the
        # host buffer itself.
        host = torch.zeros(shape, dtype=dtype, pin_memory=self.on_gpu)
        dev = host.to(self.device) if self.on_gpu else host
        self.pairs[name] = (host, dev)
        return host.numpy(), dev

    def wait_for_copies(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # long done in practice: the last step's tokens were read

    def copy_to_device(self, num_tokens: int, num_seqs: int, width: int, num_fed: int) -> None:
        if not self.on_gpu:
            return
        for name, n in (
            ("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
            ("query_start_loc", num_seqs + 1), ("seq_lens", num_seqs),
            ("logits_indices", num_seqs), ("placeholder_indices", num_fed),
            ("prev_sampled_rows", num_fed),
        ):  # fmt: skip
            host, dev = self.pairs[name]
            dev[:n].copy_(host[:n], non_blocking=True)
        host, dev = self.pairs["block_tables"]
        dev[:num_seqs, :width].copy_(host[:num_seqs, :width], non_blocking=True)
        self.copied.record()

    def batch(self, num_seqs, num_sampled, max_query_len, max_seq_len, width, block_size):
        return ForwardBatch(
            query_start_loc=self.query_start_loc_d[: num_seqs + 1],
            seq_lens=self.seq_lens_d[:num_seqs],
            slot_mapping=self.slot_mapping_d[: int(self.query_start_loc[num_seqs])],
            block_tables=self.block_tables_d[:num_seqs, :width],
            logits_indices=self.logits_indices_d[:num_sampled],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )


class PreparedStep:
    """What `prepare` made of a schedule: the model's inputs, and how to read its outputs."""

    def __init__(self, num_seqs, num_tokens, graph_batch_size, batch, samples, num_fed=0,
                 prev_sampled=None):  # fmt: skip
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.graph_batch_size = graph_batch_size  # the CUDA graph bucket, or None: run eagerly
        self.batch = batch  # ForwardBatch of an eager step, None for a graph replay
        self.samples = samples  # (S,) bool numpy: which scheduled sequences sample a token
        self.num_fed = num_fed  # input ids that are placeholders, filled from `prev_sampled`
        self.prev_sampled = prev_sampled  # (R',) the previous step's sampled ids, on the device


class SampledTokens:
    """One step's sampled token ids, one per sequence that sampled, in schedule order.

    `device` (R,) stays on the device: the next step takes its placeholder input ids from it.
    `tolist()` is the host's view: it waits for the copy queued right after sampling (into
    pinned memory, without blocking), so a host that reads step N's tokens after launching step
    N+1 never leaves the device idle.
    """

    def __init__(self, seq_ids: list[int], device: torch.Tensor, host: torch.Tensor, copied):
        self.row_of = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        self.device = device
        self.host = host  # device's twin in host memory, complete once `copied` has fired
        self.copied = copied  # a CUDA event; None where the device is the CPU (nothing to wait)

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig, block_manager: BlockManager):
        self.model = model
        self.block_manager = block_manager
        self.device = next(model.parameters()).device
        c = model.config
        dtype = model.lm_head.weight.dtype
        self.kv_cache = KVCache(
            c.num_layers, config.num_kv_blocks, config.block_size, model.num_kv_heads_per_rank,
            c.head_dim, dtype, self.device,
        )  # fmt: skip
        self.cpu_kv_cache = KVCache(  # where swapped-out sequences' blocks wait
            c.num_layers, config.num_cpu_kv_blocks, config.block_size, model.num_kv_heads_per_rank,
            c.head_dim, dtype, "cpu",
        )  # fmt: skip
        self.block_size = config.block_size
        # A block table never outgrows the model's context (the engine rejects longer requests).
        self.max_blocks = -(-min(c.max_position_embeddings, config.num_kv_slots) // self.block_size)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.inputs = StepInputs(max_tokens, config.max_num_seqs, self.max_blocks, self.device)
        self.host_block_tables = HostBlockTables(self.max_blocks)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> a seeded request's stream
        # Host copies of the sampled ids, used in turn: step N's copy is read after step N+1's
        # is queued (overlap scheduling), so one buffer would be overwritten before it is read.
        self.sampled_host = [
            torch.empty(config.max_num_seqs, dtype=torch.long, pin_memory=True)
            for _ in range(2 if self.device.type == "cuda" else 0)
        ]
        self.num_launched = 0
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            buckets = decode_buckets(config.max_num_seqs)
            self.graphs = DecodeGraphs(self._decode_forward, buckets)

    def prepare(
        self, scheduled: list[tuple[Sequence, int]], previous: SampledTokens | None = None
    ) -> PreparedStep:
        """Packs the scheduled sequences into the input buffers and queues their copy. A
        sequence's last input may be a placeholder, sampled by `previous` (the step launched
        before this one): `execute` fills it in on the device."""
        inp, S = self.inputs, len(scheduled)
        inp.wait_for_copies()
        starts, num_new, num_tokens, rows, token_ids = [], [], [], [], []
        fed, fed_rows = [], []  # sequences whose last input is a placeholder; its row in previous
        mirror, tables = self.host_block_tables, self.block_manager.block_tables
        for i, (seq, n) in enumerate(scheduled):  # per sequence, never per token
            start = seq.num_computed_tokens
            starts.append(start)
            num_new.append(n)
            num_tokens.append(seq.num_tokens + seq.num_output_placeholders)
            token_ids += seq.token_ids[start : start + n]
            if start + n > seq.num_tokens:  # a placeholder: only ever one, the last input
                token_ids.append(0)  # overwritten on the device
                fed.append(i)
                fed_rows.append(previous.row_of[seq.seq_id])
            rows.append(mirror.row(seq.seq_id, tables[seq.seq_id]))
        starts, num_new = np.array(starts), np.array(num_new)
        ends = starts + num_new
        qsl = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        N = int(qsl[-1])
        token_seq = np.repeat(np.arange(S), num_new)  # (N,) which sequence each token is in
        positions = np.arange(N) + np.repeat(starts - qsl[:-1], num_new)
        samples = ends == np.array(num_tokens)  # caught up: the last token's logits pick the next
        width = int(-(-ends.max() // self.block_size))
        inp.block_tables[:S, :width] = mirror.ids[rows, :width]

        graph_batch_size = None
        if self.graphs is not None and N == S and samples.all():
            graph_batch_size = self.graphs.bucket_for(S)
        rows = graph_batch_size or S  # padded rows S..rows-1 write nowhere and read nothing
        inp.input_ids[:N] = token_ids
        inp.positions[:N] = positions
        slots = inp.block_tables[token_seq, positions // self.block_size] * self.block_size
        inp.slot_mapping[:N] = slots + positions % self.block_size
        inp.query_start_loc[: S + 1] = qsl
        inp.seq_lens[:S] = ends
        inp.logits_indices[: int(samples.sum())] = qsl[1:][samples] - 1
        inp.placeholder_indices[: len(fed)] = qsl[1:][fed] - 1  # the sequence's last input
        inp.prev_sampled_rows[: len(fed)] = fed_rows
        if rows > S:
            self._pad(S, rows, N)
        inp.copy_to_device(N + rows - S, rows, width, len(fed))
        batch = None
        if graph_batch_size is None:
            batch = inp.batch(S, int(samples.sum()), int(num_new.max()), int(ends.max()), width,
                              self.block_size)  # fmt: skip
        prev_sampled = previous.device if fed else None
        return PreparedStep(S, N, graph_batch_size, batch, samples, len(fed), prev_sampled)

    def _pad(self, num_seqs: int, rows: int, num_tokens: int) -> None:
        inp, pad = self.inputs, rows - num_seqs
        inp.input_ids[num_tokens : num_tokens + pad] = 0
        inp.positions[num_tokens : num_tokens + pad] = 0
        inp.slot_mapping[num_tokens : num_tokens + pad] = PAD_SLOT_ID
        inp.seq_lens[num_seqs:rows] = 0
        inp.query_start_loc[num_seqs + 1 : rows + 1] = num_tokens + np.arange(1, pad + 1)
        inp.logits_indices[num_seqs:rows] = np.arange(num_seqs, rows)

    def _decode_forward(self, rows: int) -> torch.Tensor:
        """A decode step over the first `rows` rows of the device buffers (what graphs capture):
        one token per sequence, every sequence samples -> logits (rows, V)."""
        inp = self.inputs
        batch = ForwardBatch(
            query_start_loc=inp.query_start_loc_d[: rows + 1],
            seq_lens=inp.seq_lens_d[:rows],
            slot_mapping=inp.slot_mapping_d[:rows],
            block_tables=inp.block_tables_d[:rows],  # full width: any context fits the replay
            logits_indices=inp.logits_indices_d[:rows],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size,
        )
        return self.model(inp.input_ids_d[:rows], inp.positions_d[:rows], batch, self.kv_cache)

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """Logits (R, V) of the sequences that sample, on the device (no sync)."""
        if step.graph_batch_size is not None:
            return self.graphs.replay(step.graph_batch_size)[: step.num_seqs]
        input_ids = self.inputs.input_ids_d[: step.num_tokens]
        positions = self.inputs.positions_d[: step.num_tokens]
        return self.model(input_ids, positions, step.batch, self.kv_cache)

    @torch.no_grad()
    def execute(self, scheduled: list[tuple[Sequence, int]], step: PreparedStep) -> torch.Tensor:
        """Forward and sampling, queued on the device: -> token ids (R,) of the sampling rows."""
        if step.num_fed:  # placeholders, gathered on the device before anyone reads input_ids
            inp, n = self.inputs, step.num_fed
            sampled = step.prev_sampled.index_select(0, inp.prev_sampled_rows_d[:n])
            inp.input_ids_d.index_copy_(0, inp.placeholder_indices_d[:n], sampled)
        if self.model.tp.size > 1:  # tensor parallelism: the other ranks run this step too
            send_step(self, step)
        logits = self.forward(step)
        chosen = [s for (s, _), f in zip(scheduled, step.samples.tolist(), strict=True) if f]
        if not chosen:
            return torch.empty(0, dtype=torch.long, device=self.device)
        generators = [self._generator(s) for s in chosen]
        batch = SamplingBatch.build(
            [s.params for s in chosen], generators, logits.shape[-1], self.device
        )
        return sample_batch(logits, batch)

    @torch.no_grad()
    def launch(
        self, scheduled: list[tuple[Sequence, int]], previous: SampledTokens | None = None
    ) -> SampledTokens:
        """Queues one step on the device (inputs, forward, sampling, the copy of its tokens to the
        host) and returns without waiting for any of it. `previous`: the step launched before,
        whose tokens this one's placeholders are."""
        step = self.prepare(scheduled, previous)
        ids = self.execute(scheduled, step)
        samples = step.samples.tolist()
        seq_ids = [s.seq_id for (s, _), f in zip(scheduled, samples, strict=True) if f]
        if not self.sampled_host:  # the CPU: the ids are already in host memory, computed
            return SampledTokens(seq_ids, ids, ids, None)
        self.num_launched += 1
        host = self.sampled_host[self.num_launched % 2][: len(ids)]
        host.copy_(ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return SampledTokens(seq_ids, ids, host, copied)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None  # the device's default stream: nobody asked to reproduce it
        generator = self.generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed)
            self.generators[seq.seq_id] = generator
        return generator

    def swap(self, blocks_to_swap_out, blocks_to_swap_in) -> None:
        """Copies swapped blocks out to the CPU pool, then in to the GPU pool, before the step."""
        copy_blocks(self.kv_cache, self.cpu_kv_cache, blocks_to_swap_out)
        copy_blocks(self.cpu_kv_cache, self.kv_cache, blocks_to_swap_in)

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        self.host_block_tables.release(seq.seq_id)

    def shutdown(self) -> None:
        """Frees the CUDA graphs: with tensor parallelism they hold NCCL work, so they must go
        before the process group does (distributed.py)."""
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
