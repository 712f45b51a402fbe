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
- `sample_batch` samples the whole batch on the device; `.tolist()` is the step's only
  device-to-host copy and its only sync.
- Tensor parallelism (distributed.py): rank 0's runner broadcasts each prepared step's buffers
  before running it; the other ranks' runners only receive steps and run `forward`, never
  `prepare` or sampling, and their KV caches hold their ranks' KV heads.

Phase 8: what a server's clients ask for. In a step where some row has a logit bias or is short
of its `min_tokens` (its EOS and stop tokens are then biased to -inf), the logits are biased in
one batched scatter-add; in a step where some row has penalties, they are penalized in one
batched pass; both before `sample_batch`, in vLLM's order. Rows that asked for logprobs get them
from the raw logits, beside their token (`SampledToken`). A step where no row asks for any of
these runs exactly phase 7's path, with its one device-to-host copy; logprobs add their own.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .attention import METADATA_DTYPE, PAD_SLOT_ID, ForwardBatch
from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graph import DecodeGraphs, decode_buckets
from .distributed import send_step
from .kv_cache import KVCache, copy_blocks
from .model import Qwen3ForCausalLM
from .sampling import (
    SamplingBatch,
    TokenLogprobs,
    apply_logit_bias,
    apply_penalties,
    sample_batch,
    token_logprobs,
)
from .sequence import Sequence


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None  # only when the request asked for logprobs


@dataclass
class SampledBatch:
    """One step's sampling, still on the device (no sync yet)."""

    token_ids: torch.Tensor  # (R,) int64: one per sampling row
    raw_logits: torch.Tensor  # (R, V): before penalties; read only for rows that want logprobs
    logprobs: list[int | None]  # per sampling row: how many alternatives it asked for, or None


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

    def copy_to_device(self, num_tokens: int, num_seqs: int, width: int) -> None:
        if not self.on_gpu:
            return
        for name, n in (
            ("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
            ("query_start_loc", num_seqs + 1), ("seq_lens", num_seqs),
            ("logits_indices", num_seqs),
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

    def __init__(self, num_seqs, num_tokens, graph_batch_size, batch, samples):
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.graph_batch_size = graph_batch_size  # the CUDA graph bucket, or None: run eagerly
        self.batch = batch  # ForwardBatch of an eager step, None for a graph replay
        self.samples = samples  # (S,) bool numpy: which scheduled sequences sample a token


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        config: EngineConfig,
        block_manager: BlockManager,
        eos_token_ids: frozenset[int] = frozenset(),  # what min_tokens holds off (rank 0 samples)
    ):
        self.model = model
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
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
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            buckets = decode_buckets(config.max_num_seqs)
            self.graphs = DecodeGraphs(self._decode_forward, buckets)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> PreparedStep:
        """Packs the scheduled sequences into the input buffers and queues their copy."""
        inp, S = self.inputs, len(scheduled)
        inp.wait_for_copies()
        starts, num_new, num_tokens, rows, token_ids = [], [], [], [], []
        mirror, tables = self.host_block_tables, self.block_manager.block_tables
        for seq, n in scheduled:  # per sequence, never per token
            start = seq.num_computed_tokens
            starts.append(start)
            num_new.append(n)
            num_tokens.append(len(seq.token_ids))
            token_ids += seq.token_ids[start : start + n]
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
        if rows > S:
            self._pad(S, rows, N)
        inp.copy_to_device(N + rows - S, rows, width)
        batch = None
        if graph_batch_size is None:
            batch = inp.batch(S, int(samples.sum()), int(num_new.max()), int(ends.max()), width,
                              self.block_size)  # fmt: skip
        return PreparedStep(S, N, graph_batch_size, batch, samples)

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
    def execute(self, scheduled: list[tuple[Sequence, int]], step: PreparedStep) -> SampledBatch:
        """Forward and sampling, queued on the device: -> token ids (R,) of the sampling rows."""
        if self.model.tp.size > 1:  # tensor parallelism: the other ranks run this step too
            send_step(self, step)
        logits = self.forward(step)
        chosen = [s for (s, _), f in zip(scheduled, step.samples.tolist(), strict=True) if f]
        if not chosen:
            return SampledBatch(torch.empty(0, dtype=torch.long, device=self.device), logits, [])
        return self.sample(logits, chosen)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        """logits (R, V) of `seqs`' sampling rows -> their tokens, biased and penalized where
        asked (host-side checks first: a step where no row asks runs no extra pass)."""
        params = [s.params for s in seqs]
        raw_logits = logits
        if any(p.logit_bias or p.min_tokens for p in params):
            biases = [self._logit_bias(s) for s in seqs]
            if any(biases):
                logits = apply_logit_bias(logits, biases)
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                params,
            )  # fmt: skip
        generators = [self._generator(s) for s in seqs]
        batch = SamplingBatch.build(params, generators, logits.shape[-1], self.device)
        return SampledBatch(sample_batch(logits, batch), raw_logits, [p.logprobs for p in params])

    def _logit_bias(self, seq: Sequence) -> dict[int, float]:
        """The request's logit_bias, plus -inf on what may not end it before min_tokens."""
        params = seq.params
        bias = params.logit_bias or {}
        if seq.num_output_tokens >= params.min_tokens:
            return bias
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return {**bias, **dict.fromkeys(stops, float("-inf"))}

    @torch.no_grad()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        """One forward step. Returns the sampled token per scheduled sequence (None mid-prompt)."""
        step = self.prepare(scheduled)
        sampled = self.execute(scheduled, step)
        tokens = sampled.token_ids.tolist()  # the one device -> host copy (logprobs aside)
        samples = iter(self.with_logprobs(sampled, tokens))
        return [next(samples) if f else None for f in step.samples.tolist()]

    def with_logprobs(self, sampled: SampledBatch, tokens: list[int]) -> list[SampledToken]:
        """Each sampled token with its logprobs, computed only for the rows that asked."""
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        wanted = [i for i, k in enumerate(sampled.logprobs) if k is not None]
        if wanted:
            found = token_logprobs(
                sampled.raw_logits[wanted], [tokens[i] for i in wanted],
                [sampled.logprobs[i] for i in wanted],
            )  # fmt: skip
            for i, lp in zip(wanted, found, strict=True):
                logprobs[i] = lp
        return [SampledToken(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]

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
