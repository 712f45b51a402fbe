"""Model runner: turns the scheduler's decision into tensors, one forward pass, and tokens.

Problem: the scheduler thinks in sequences and token counts; the model wants packed tensors.
Idea: for every scheduled (sequence, num_new_tokens), take the next `num_new_tokens` of its token
ids, their positions (num_computed_tokens onwards) and their cache slots, pack all sequences into
one flat batch, run the model once, and sample a token for each sequence whose new tokens reach
its end (a sequence still mid-prompt samples nothing).

The runner owns the KV cache tensors; it never decides who runs.

Phase 5: slots come from block tables, and the block tables travel to attention in the batch; a
second, CPU-side KV pool holds the blocks of sequences preempted by swapping.

Phase 7 (speed): on a GPU, phase 6 spent most of a decode step in Python and in launches: lists
built token by token (a block-table lookup per token for its slot), new tensors every step, and a
sampling pass that draws row by row.
- `prepare` fills preallocated (pinned) host arrays with numpy, with no per-token Python loop,
  and copies them to preallocated device buffers without blocking (input_batch.py).
- Decode-only steps (every scheduled sequence brings one token and samples) replay a CUDA graph
  captured for the smallest bucket that holds the batch (cuda_graph.py); other steps run eagerly.
- `sample_batch` samples the whole batch on the device (a seeded row from its seed and the index
  of the token it draws: sampling.py); the sampled ids are copied to pinned host memory without
  blocking. A step waits on the device twice: in `prepare`, for the copies of the
  previous step's inputs before their host buffers are rewritten (an `Event.synchronize()`,
  already complete when the previous step's tokens were read), and in `SampledTokens.tolist()`,
  for its own tokens.
- Overlap scheduling (engine.py): `launch` queues a whole step and returns at once. A sequence
  whose last input token was sampled by the previous step, not yet read by the host (a
  placeholder), gets it on the device: `execute` gathers it from the previous step's
  `SampledTokens.device` into the input ids, so no token makes a round trip through the host.
- A hybrid model (Qwen3.5) keeps its DeltaNet state in a `StatePool` of max_num_seqs slots beside
  the KV cache (which then holds only its attention layers): a sequence takes its slot the first
  time it is prepared and gives it back when it finishes or is preempted (zeroed, or copied to
  the CPU when it is swapped out); its slot travels in `state_slots`. Graph capture and padded
  rows use PAD_SLOT_ID: no state is read or written for them.
- Tensor parallelism (worker.py): rank 0's runner broadcasts each prepared step's buffers
  before running it; the other ranks' runners only receive steps and run `forward`, never
  `prepare` or sampling, and their KV caches hold their ranks' KV heads.
"""

import numpy as np
import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graph import DecodeGraphs, decode_buckets
from .input_batch import HostBlockTables, PreparedStep, StepInputs, send_step
from .kernels import PAD_SLOT_ID  # Triton-free: the kernels load on first use
from .kv_cache import KVCache, copy_blocks
from .kv_cache_config import KVCacheConfig, kv_cache_dtype
from .model import Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM, is_hybrid
from .sampling import SamplingBatch, sample_batch
from .sequence import Sequence, SequenceStatus
from .state_pool import StatePool


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
    def __init__(
        self,
        model: Qwen3ForCausalLM | Qwen3_5ForCausalLM,
        config: EngineConfig,  # its batch sizes resolved (`for_device`)
        block_manager: BlockManager,
        kv_cache_config: KVCacheConfig,
    ):
        self.model = model
        self.block_manager = block_manager
        self.device = next(model.parameters()).device
        c = model.config
        dtype = model.lm_head.weight.dtype
        hybrid = is_hybrid(c)
        num_kv_layers = c.num_attention_layers if hybrid else c.num_layers
        cache_dtype = kv_cache_dtype(model, config)  # the model's dtype, or fp8
        self.kv_cache = KVCache(
            num_kv_layers, kv_cache_config.num_blocks, config.block_size,
            model.num_kv_heads_per_rank, c.head_dim, cache_dtype, self.device,
        )  # fmt: skip
        self.cpu_kv_cache = KVCache(  # where swapped-out sequences' blocks wait
            num_kv_layers, config.num_cpu_kv_blocks, config.block_size,
            model.num_kv_heads_per_rank, c.head_dim, cache_dtype, "cpu",
        )  # fmt: skip
        self.state_pool = (
            StatePool(c.state_shape, c.num_deltanet_layers, config.max_num_seqs, dtype, self.device)
            if hybrid
            else None
        )
        # What the model's forward reads and writes besides the batch.
        pool = () if self.state_pool is None else (self.state_pool,)
        self.caches = (self.kv_cache, *pool)
        self.block_size = config.block_size
        # A block table never outgrows max_model_len (the engine rejects longer requests).
        self.max_blocks = -(-kv_cache_config.max_model_len // self.block_size)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.inputs = StepInputs(max_tokens, config.max_num_seqs, self.max_blocks, self.block_size,
                                 self.device, state_slots=hybrid)  # fmt: skip
        self.host_block_tables = HostBlockTables(self.max_blocks)
        # Host copies of the sampled ids, used in turn: step N's copy is read after step N+1's
        # is queued (overlap scheduling), so one buffer would be overwritten before it is read.
        self.sampled_host = [
            torch.empty(config.max_num_seqs, dtype=torch.long, pin_memory=True)
            for _ in range(2 if self.device.type == "cuda" else 0)
        ]
        self.num_launched = 0
        self.graphs = None
        self.lm_head_graph_max_batch = config.lm_head_graph_max_batch
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
        starts, num_new, num_tokens, table_rows, token_ids = [], [], [], [], []
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
            table_rows.append(mirror.row(seq.seq_id, tables[seq.seq_id]))
        if self.state_pool is not None:
            inp.state_slots[:S] = [self.state_pool.slot(seq.seq_id) for seq, _ in scheduled]
        starts, num_new = np.array(starts), np.array(num_new)
        ends = starts + num_new
        qsl = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        N = int(qsl[-1])
        token_seq = np.repeat(np.arange(S), num_new)  # (N,) which sequence each token is in
        positions = np.arange(N) + np.repeat(starts - qsl[:-1], num_new)
        samples = ends == np.array(num_tokens)  # caught up: the last token's logits pick the next
        num_sampled = int(samples.sum())
        width = int(-(-ends.max() // self.block_size))
        inp.block_tables[:S, :width] = mirror.ids[table_rows, :width]

        graph_batch_size = None
        if self.graphs is not None and N == S and samples.all():
            graph_batch_size = self.graphs.bucket_for(S)
        inp.input_ids[:N] = token_ids
        inp.positions[:N] = positions
        slots = inp.block_tables[token_seq, positions // self.block_size] * self.block_size
        inp.slot_mapping[:N] = slots + positions % self.block_size
        inp.query_start_loc[: S + 1] = qsl
        inp.seq_lens[:S] = ends
        inp.logits_indices[:num_sampled] = qsl[1:][samples] - 1
        inp.placeholder_indices[: len(fed)] = qsl[1:][fed] - 1  # the sequence's last input
        inp.prev_sampled_rows[: len(fed)] = fed_rows
        batch = None
        ones = num_new == 1  # the leading ones are the decodes the decode kernel takes
        num_decodes = S if ones.all() else int(ones.argmin())
        if graph_batch_size is None:
            batch = inp.forward_batch(
                S, N, num_sampled, int(num_new.max()), int(ends.max()), width, num_decodes
            )
        prev_sampled = previous.device if fed else None
        step = PreparedStep(S, N, num_sampled, graph_batch_size, batch, samples, len(fed),
                            prev_sampled)  # fmt: skip
        tokens, rows, sampled = step.buffer_rows
        if rows > S:  # padded rows S..rows-1 write nowhere and read nothing
            self._pad(S, rows, N)
        # The decode kernel starts the longest contexts first (kernels/paged_decode.py); a graph's
        # padded rows (seq_len 0) come last.
        decodes = rows if graph_batch_size is not None else num_decodes
        inp.decode_order[:decodes] = np.argsort(-inp.seq_lens[:decodes], kind="stable")
        inp.copy_to_device(tokens, rows, sampled, width, len(fed))
        return step

    def _pad(self, num_seqs: int, rows: int, num_tokens: int) -> None:
        inp, pad = self.inputs, rows - num_seqs
        inp.input_ids[num_tokens : num_tokens + pad] = 0
        inp.positions[num_tokens : num_tokens + pad] = 0
        inp.slot_mapping[num_tokens : num_tokens + pad] = PAD_SLOT_ID
        inp.state_slots[num_seqs:rows] = PAD_SLOT_ID
        inp.seq_lens[num_seqs:rows] = 0
        inp.query_start_loc[num_seqs + 1 : rows + 1] = num_tokens + np.arange(1, pad + 1)
        inp.logits_indices[num_seqs:rows] = np.arange(num_seqs, rows)

    def _decode_forward(self, rows: int) -> torch.Tensor:
        """A decode step over the first `rows` rows of the device buffers (what graphs capture):
        one token per sequence, every sequence samples -> logits (rows, V) up to
        `lm_head_graph_max_batch` rows, hidden states (rows, C) above."""
        inp = self.inputs
        # full block-table width: any context fits the replay
        batch = inp.forward_batch(rows, rows, rows, 1, self.max_blocks * self.block_size,
                                  self.max_blocks, rows)  # fmt: skip
        ids, positions = inp.input_ids_d[:rows], inp.positions_d[:rows]
        if rows <= self.lm_head_graph_max_batch:
            return self.model(ids, positions, batch, *self.caches)
        # every row samples: the hidden states are already the rows the LM head takes
        return self.model.model(ids, positions, batch, *self.caches)

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """Logits (R, V) of the sequences that sample, on the device (no sync)."""
        if step.graph_batch_size is not None:
            rows = step.graph_batch_size
            out = self.graphs.replay(rows)[: step.num_seqs]
            if rows <= self.lm_head_graph_max_batch:
                return out
            return self.model.compute_logits(out)  # on the real rows only, not the padding
        input_ids = self.inputs.input_ids_d[: step.num_tokens]
        positions = self.inputs.positions_d[: step.num_tokens]
        return self.model(input_ids, positions, step.batch, *self.caches)

    @torch.no_grad()
    def execute(self, scheduled: list[tuple[Sequence, int]], step: PreparedStep) -> torch.Tensor:
        """Forward and sampling, queued on the device: -> token ids (R,) of the sampling rows."""
        if step.num_fed:  # placeholders, gathered on the device before anyone reads input_ids
            inp, n = self.inputs, step.num_fed
            sampled = step.prev_sampled.index_select(0, inp.prev_sampled_rows_d[:n])
            inp.input_ids_d.index_copy_(0, inp.placeholder_indices_d[:n], sampled)
        if self.model.tp.size > 1:  # tensor parallelism: the other ranks run this step too
            send_step(self.inputs, step)
        logits = self.forward(step)
        chosen = [s for (s, _), f in zip(scheduled, step.samples.tolist(), strict=True) if f]
        if not chosen:
            return torch.empty(0, dtype=torch.long, device=self.device)
        # the index of the token each row draws: placeholders (overlap) are drawn, not yet read
        draws = [s.num_output_tokens + s.num_output_placeholders for s in chosen]
        params = [s.params for s in chosen]
        batch = SamplingBatch.build(params, draws, logits.shape[-1], self.device)
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

    def swap(self, blocks_to_swap_out, blocks_to_swap_in) -> None:
        """Copies swapped blocks out to the CPU pool, then in to the GPU pool, before the step."""
        copy_blocks(self.kv_cache, self.cpu_kv_cache, blocks_to_swap_out)
        copy_blocks(self.cpu_kv_cache, self.kv_cache, blocks_to_swap_in)

    def preempt(self, seq: Sequence) -> None:
        """A preempted sequence's state leaves its slot: to the CPU when its blocks were swapped
        out, else it is dropped (zeroed) and recomputed with the prompt."""
        if self.state_pool is None:
            return
        if seq.status == SequenceStatus.SWAPPED:
            self.state_pool.swap_out(seq.seq_id)
        else:
            self.state_pool.free(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        self.host_block_tables.release(seq.seq_id)
        if self.state_pool is not None:
            self.state_pool.free(seq.seq_id)

    def shutdown(self) -> None:
        """Frees the CUDA graphs: with tensor parallelism they hold NCCL work, so they must go
        before the process group does (worker.py)."""
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
