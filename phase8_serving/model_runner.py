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

Phase 8: what a server's clients ask for. In a step where some row has a logit bias or is short
of its `min_tokens` (its EOS and stop tokens are then biased to -inf), the logits are biased in
one batched scatter-add; in a step where some row has penalties, they are penalized in one
batched pass; both before `sample_batch`, in vLLM's order. Rows that asked for logprobs get them
from the raw logits, computed on the device right after sampling and copied back with the
tokens (`SampledTokens.read` pairs each token with them: `SampledToken`). A step where no row
asks for any of these runs exactly phase 7's path, with its one device-to-host copy; logprobs
add their own. Overlap scheduling needs nothing from the host for them: a placeholder token
counts for min_tokens, and the penalties take it from the device, where `execute` has it.
Structured outputs (structured_output.py) are the exception: a row under a grammar keeps only
the tokens its grammar allows after every token so far, so its mask needs the placeholder's value
on the host. `sample` reads it after the step's forward is queued, so the device stays busy while
the host waits for the previous step's copy and walks the grammar.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graph import DecodeGraphs, decode_buckets
from .input_batch import HostBlockTables, PreparedStep, StepInputs, send_step
from .kernels import PAD_SLOT_ID  # Triton-free: the kernels load on first use
from .kv_cache import KVCache, copy_blocks
from .kv_cache_config import KVCacheConfig, kv_cache_dtype
from .logprobs import (
    LogprobsTensors,
    PromptLogprobsTensors,
    TokenLogprobs,
    prompt_token_logprobs,
    token_logprobs,
)
from .model import Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM, is_hybrid
from .sampling import (
    SamplingBatch,
    apply_logit_bias,
    apply_penalties,
    keep_allowed_tokens,
    sample_batch,
)
from .sequence import Sequence, SequenceStatus
from .state_pool import StatePool
from .structured_output import GrammarCache, GrammarMatcher


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None  # only when the request asked for logprobs


@dataclass
class SampledBatch:
    """One step's sampling, still on the device (no sync yet)."""

    token_ids: torch.Tensor  # (R,) int64: one per sampling row
    logprobs: LogprobsTensors | None  # of the rows that asked; None if none did
    prompt: PromptLogprobsTensors | None = None  # prompt positions scored (prompt_logprobs)


class SampledTokens:
    """One step's sampled token ids, one per sequence that sampled, in schedule order.

    `device` (R,) stays on the device: the next step takes its placeholder input ids from it.
    `tolist()` is the host's view: it waits for the copy queued right after sampling (into
    pinned memory, without blocking), so a host that reads step N's tokens after launching step
    N+1 never leaves the device idle.
    """

    def __init__(self, seq_ids: list[int], device: torch.Tensor, host: torch.Tensor, copied,
                 logprobs: LogprobsTensors | None = None,
                 prompt: PromptLogprobsTensors | None = None):  # fmt: skip
        self.row_of = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        self.device = device
        self.host = host  # device's twin in host memory, complete once `copied` has fired
        self.copied = copied  # a CUDA event; None where the device is the CPU (nothing to wait)
        self.logprobs = logprobs  # in host memory once `copied` has fired, like `host`
        self.prompt = prompt  # likewise

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()

    def read(self) -> list[SampledToken]:
        """Each sampled token with its logprobs (None for the rows that did not ask)."""
        tokens = self.tolist()
        if self.logprobs is None:
            return [SampledToken(t, None) for t in tokens]
        logprobs = self.logprobs.tolists(tokens)
        return [SampledToken(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]

    def read_prompt(self) -> dict[int, list[TokenLogprobs]]:
        """By sequence id, the prompt tokens this step scored (prompt_logprobs); after `read`."""
        return {} if self.prompt is None else self.prompt.tolists()


class PreviousTokens:
    """The tokens of the step before, read (waiting for their copy) only if a row asks: what a
    placeholder is, for the host-side rules that need it (bad words)."""

    def __init__(self, previous: SampledTokens | None):
        self.previous, self.tokens = previous, None

    def __call__(self, seq: Sequence) -> int:
        if self.tokens is None:
            self.tokens = self.previous.tolist()
        return self.tokens[self.previous.row_of[seq.seq_id]]


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM | Qwen3_5ForCausalLM,
        config: EngineConfig,  # its batch sizes resolved (`for_device`)
        block_manager: BlockManager,
        kv_cache_config: KVCacheConfig,
        eos_token_ids: frozenset[int] = frozenset(),  # what min_tokens holds off (rank 0 samples)
        grammars: GrammarCache | None = None,  # structured outputs' grammars (rank 0 samples)
    ):
        self.model = model
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
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
        self.grammars = grammars
        self.matchers: dict[int, GrammarMatcher] = {}  # seq_id -> its place in its grammar
        self.grammar_mask_kernel = True  # on a GPU; off: the torch chain (a benchmark's ablation)
        self.scoring: set[int] = set()  # sequences that asked for their prompt's logprobs
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
        if self.scoring:  # only while some request wants its prompt's logprobs
            step.prompt_rows = self._prompt_rows(scheduled, starts, qsl)
        tokens, rows, sampled = step.buffer_rows
        if rows > S:  # padded rows S..rows-1 write nowhere and read nothing
            self._pad(S, rows, N)
        # The decode kernel starts the longest contexts first (kernels/paged_decode.py); a graph's
        # padded rows (seq_len 0) come last.
        decodes = rows if graph_batch_size is not None else num_decodes
        inp.decode_order[:decodes] = np.argsort(-inp.seq_lens[:decodes], kind="stable")
        inp.copy_to_device(tokens, rows, sampled, width, len(fed))
        return step

    def _prompt_rows(self, scheduled, starts, qsl) -> tuple | None:
        """The packed rows of the prompt positions this step scores, and what each scores: the
        hidden state at position p gives the logprob of prompt token p + 1 (the prompt's last
        position predicts the first output instead). A position is scored once, even when a
        preempted sequence recomputes it."""
        seq_ids, counts, rows, targets, ks = [], [], [], [], []
        for i, (seq, n) in enumerate(scheduled):
            if seq.seq_id not in self.scoring:
                continue
            start = int(starts[i])
            first = max(start, seq.num_prompt_scored)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if first >= last:
                continue
            seq.num_prompt_scored = last
            row = int(qsl[i]) - start  # + a position: its row in the packed batch
            seq_ids.append(seq.seq_id)
            counts.append(last - first)
            rows += range(row + first, row + last)
            targets += seq.token_ids[first + 1 : last + 1]
            ks += [seq.params.prompt_logprobs] * (last - first)
        return (seq_ids, counts, rows, targets, ks) if seq_ids else None

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
    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        step: PreparedStep,
        previous: SampledTokens | None = None,
    ) -> SampledBatch:
        """Forward and sampling, queued on the device: -> token ids (R,) of the sampling rows.
        `previous`: the step before, whose tokens the placeholders are (structured outputs)."""
        sampled = None  # (F,) the placeholders' tokens, in schedule order
        if step.num_fed:  # placeholders, gathered on the device before anyone reads input_ids
            inp, n = self.inputs, step.num_fed
            sampled = step.prev_sampled.index_select(0, inp.prev_sampled_rows_d[:n])
            inp.input_ids_d.index_copy_(0, inp.placeholder_indices_d[:n], sampled)
        if self.model.tp.size > 1:  # tensor parallelism: the other ranks run this step too
            send_step(self.inputs, step)
        prompt = None
        if step.prompt_rows is None:
            logits = self.forward(step)
        else:
            logits, prompt = self._forward_scoring(step)
        chosen = [s for (s, _), f in zip(scheduled, step.samples.tolist(), strict=True) if f]
        if not chosen:
            return SampledBatch(torch.empty(0, dtype=torch.long, device=self.device), None, prompt)
        batch = self.sample(logits, chosen, sampled, previous)
        batch.prompt = prompt
        return batch

    def _forward_scoring(self, step: PreparedStep) -> tuple[torch.Tensor, PromptLogprobsTensors]:
        """`forward` of an eager step that scores prompt positions (one tensor-parallel rank):
        the sampling rows' logits, and the scored rows' logprobs from their hidden states."""
        inp, n = self.inputs, step.num_tokens
        input_ids, positions = inp.input_ids_d[:n], inp.positions_d[:n]
        hidden = self.model.model(input_ids, positions, step.batch, *self.caches)  # (N, C)
        logits = self.model.compute_logits(hidden[step.batch.logits_indices])
        seq_ids, counts, rows, targets, ks = step.prompt_rows
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        scored = prompt_token_logprobs(self.model.compute_logits, hidden.index_select(0, index),
                                       seq_ids, counts, targets, ks)  # fmt: skip
        return logits, scored

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        placeholders: torch.Tensor | None = None,
        previous: SampledTokens | None = None,
    ) -> SampledBatch:
        """logits (R, V) of `seqs`' sampling rows -> their tokens, biased and penalized where
        asked (host-side checks first: a step where no row asks runs no extra pass), and the
        logprobs of the rows that ask, from the raw logits. `placeholders` (F,): the last output
        token of each sequence with a placeholder, in order, on the device (overlap scheduling:
        sampled by the step before, unknown to the host); the penalties count it there, and a
        grammar reads it from `previous`, that step's tokens."""
        params = [s.params for s in seqs]
        raw_logits = logits
        if any(p.structured_outputs for p in params):
            logits = self._keep_grammar_tokens(logits, seqs, previous)
        if any(p.logit_bias or p.min_tokens or p.bad_words for p in params):
            read = PreviousTokens(previous)
            biases = [self._logit_bias(s) | self._bad_word_bans(s, read) for s in seqs]
            if any(biases):
                logits = apply_logit_bias(logits, biases)
        if any(p.allowed_token_ids for p in params):
            logits = keep_allowed_tokens(logits, [p.allowed_token_ids for p in params])
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                params, self._placeholder_rows(seqs, placeholders),
            )  # fmt: skip
        # the index of the token each row draws: placeholders (overlap) are drawn, not yet read
        draws = [s.num_output_tokens + s.num_output_placeholders for s in seqs]
        batch = SamplingBatch.build(params, draws, logits.shape[-1], self.device)
        token_ids = sample_batch(logits, batch)
        wanted = [r for r, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return SampledBatch(token_ids, None)
        ks = [params[r].logprobs for r in wanted]
        # now, while the raw logits are there: a graph replay's are overwritten by the next step
        return SampledBatch(token_ids, token_logprobs(raw_logits, token_ids, wanted, ks))

    def _keep_grammar_tokens(
        self, logits: torch.Tensor, seqs: list[Sequence], previous: SampledTokens | None
    ) -> torch.Tensor:
        """logits (R, V) -> float32 logits where each row under a grammar keeps only the tokens
        it allows next (its stop tokens too, once the value is complete); the others unchanged
        (and the logits as they came if every such row is thinking). Each matcher first reads
        the row's tokens it has not read, a placeholder's included."""
        rows, masks, previous_tokens = [], [], None
        for r, seq in enumerate(seqs):
            structured = seq.params.structured_outputs
            if structured is None:
                continue
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:
                matcher = self.grammars.matcher(
                    structured.kind, structured.spec, structured.reasoning
                )
                self.matchers[seq.seq_id] = matcher
            # the tokens it has not read (not the whole output again: a step per token)
            new = seq.token_ids[seq.num_prompt_tokens + matcher.num_read :]
            if seq.num_output_placeholders:  # sampled by `previous`: wait for its copy
                if previous_tokens is None:
                    previous_tokens = previous.tolist()
                new.append(previous_tokens[previous.row_of[seq.seq_id]])
            stops = self.eos_token_ids | frozenset(seq.params.stop_token_ids)
            matcher.read_new(new, stops)
            mask = matcher.mask(stops)  # bit t (little-endian): token t is allowed
            if mask is not None:  # None: a thinking model's thoughts, free
                rows.append(r)
                masks.append(mask)
        if not rows:
            return logits
        to = lambda x: torch.from_numpy(x).to(self.device, non_blocking=True)  # noqa: E731
        packed = to(np.stack(masks))  # (G, ceil(V / 8)) uint8: 8x fewer bytes than bools
        # a new float32 tensor either way: the raw logits stay raw (logprobs)
        if logits.is_cuda and self.grammar_mask_kernel:  # one launch, not ten (the host's)
            from .kernels.grammar_mask import apply_grammar_masks

            mask_of_row = np.full(len(seqs), -1, dtype=np.int32)  # -1: no grammar
            mask_of_row[rows] = np.arange(len(rows), dtype=np.int32)
            return apply_grammar_masks(logits, packed, to(mask_of_row))
        shifts = torch.arange(8, dtype=torch.uint8, device=self.device)
        keep = (packed[:, :, None] >> shifts & 1).bool().flatten(1)[:, : logits.shape[-1]]
        logits = logits.to(torch.float32, copy=True)
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
        return logits

    def _placeholder_rows(
        self, seqs: list[Sequence], placeholders: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) of the placeholders among `seqs`' sampling rows, on the device. A
        sequence that samples has a placeholder exactly when its input is one (`prepare`), so
        they come in the order `placeholders` has."""
        if placeholders is None:
            return None
        rows = [r for r, s in enumerate(seqs) if s.num_output_placeholders]
        assert len(rows) == len(placeholders)
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True), placeholders

    def _logit_bias(self, seq: Sequence) -> dict[int, float]:
        """The request's logit_bias, plus -inf on what may not end it before min_tokens (which
        counts a placeholder token, not yet read, as the token it is)."""
        params = seq.params
        bias = params.logit_bias or {}
        if seq.num_output_tokens + seq.num_output_placeholders >= params.min_tokens:
            return bias
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return {**bias, **dict.fromkeys(stops, float("-inf"))}

    def _bad_word_bans(self, seq: Sequence, read: PreviousTokens) -> dict[int, float]:
        """-inf on the last token of each bad word whose other tokens end the output (vLLM's
        rule: the word may start, it may not be completed); the output's last token may be a
        placeholder, read from the step that sampled it."""
        words = seq.bad_words_token_ids
        longest = max((len(word) - 1 for word in words), default=0)
        # the output's last `longest` tokens (only those: an output may be long, a step short)
        tail = seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - longest) :]
        if longest and seq.num_output_placeholders:
            tail.append(read(seq))
        bans = {}
        for *prefix, last in words:
            if not prefix or tail[len(tail) - len(prefix) :] == prefix:
                bans[last] = float("-inf")
        return bans

    @torch.no_grad()
    def launch(
        self, scheduled: list[tuple[Sequence, int]], previous: SampledTokens | None = None
    ) -> SampledTokens:
        """Queues one step on the device (inputs, forward, sampling, the copy of its tokens to the
        host) and returns without waiting for any of it. `previous`: the step launched before,
        whose tokens this one's placeholders are."""
        step = self.prepare(scheduled, previous)
        sampled = self.execute(scheduled, step, previous)
        ids, logprobs, prompt = sampled.token_ids, sampled.logprobs, sampled.prompt
        samples = step.samples.tolist()
        seq_ids = [s.seq_id for (s, _), f in zip(scheduled, samples, strict=True) if f]
        if not self.sampled_host:  # the CPU: the ids are already in host memory, computed
            return SampledTokens(seq_ids, ids, ids, None, logprobs, prompt)
        self.num_launched += 1
        host = self.sampled_host[self.num_launched % 2][: len(ids)]
        host.copy_(ids, non_blocking=True)
        if logprobs is not None:
            logprobs = logprobs.to_host()
        if prompt is not None:
            prompt = prompt.to_host()
        copied = torch.cuda.Event()
        copied.record()
        return SampledTokens(seq_ids, ids, host, copied, logprobs, prompt)

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
        self.matchers.pop(seq.seq_id, None)
        self.scoring.discard(seq.seq_id)
        self.host_block_tables.release(seq.seq_id)
        if self.state_pool is not None:
            self.state_pool.free(seq.seq_id)

    def shutdown(self) -> None:
        """Frees the CUDA graphs: with tensor parallelism they hold NCCL work, so they must go
        before the process group does (worker.py)."""
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
