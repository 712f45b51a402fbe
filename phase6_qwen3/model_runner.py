"""Model runner: turns the scheduler's decision into tensors, one forward pass, and tokens.

Problem: the scheduler thinks in sequences and token counts; the model wants packed tensors.
Idea: for every scheduled (sequence, num_new_tokens), take the next `num_new_tokens` of its token
ids, their positions (num_computed_tokens onwards) and their cache slots, pack all sequences into
one flat batch, run the model once, and sample a token for each sequence whose new tokens reach
its end (a sequence still mid-prompt samples nothing).

The runner owns the KV cache tensors and one `Sampler` per request (its seeded random stream
survives preemption); it never decides who runs.

Phase 5: slots come from block tables, and the block tables travel to attention in the batch; a
second, CPU-side KV pool holds the blocks of sequences preempted by swapping.

Phase 6 (hybrid models): a Qwen3.5 model keeps a second kind of per-sequence memory, its DeltaNet
state, in a `StatePool` of max_num_seqs slots beside the KV cache (which then holds only the
attention layers). A sequence takes its slot the first time it is scheduled and gives it back
when it finishes or is preempted (zeroed, or copied to the CPU when it is swapped out); the
batch names each sequence's slot.
"""

import torch

from .attention import ForwardBatch
from .block_manager import BlockManager
from .config import EngineConfig
from .kv_cache import KVCache, copy_blocks
from .model import Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM, is_hybrid
from .sampling import Sampler, sample_batch
from .sequence import Sequence, SequenceStatus
from .state_pool import StatePool


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM | Qwen3_5ForCausalLM,
        config: EngineConfig,
        block_manager: BlockManager,
    ):
        self.model = model
        self.block_manager = block_manager
        self.device = next(model.parameters()).device
        c = model.config
        dtype = model.lm_head.weight.dtype
        hybrid = is_hybrid(c)
        num_kv_layers = c.num_attention_layers if hybrid else c.num_layers
        self.kv_cache = KVCache(
            num_kv_layers, config.num_kv_blocks, config.block_size, c.num_kv_heads, c.head_dim,
            dtype, self.device,
        )  # fmt: skip
        self.cpu_kv_cache = KVCache(  # where swapped-out sequences' blocks wait
            num_kv_layers, config.num_cpu_kv_blocks, config.block_size, c.num_kv_heads,
            c.head_dim, dtype, "cpu",
        )  # fmt: skip
        self.state_pool = (
            StatePool(c.state_shape, c.num_deltanet_layers, config.max_num_seqs, dtype, self.device)
            if hybrid
            else None
        )
        # What the model's forward reads and writes besides the batch.
        self.caches = (
            (self.kv_cache,) if self.state_pool is None else (self.kv_cache, self.state_pool)
        )
        self.samplers: dict[int, Sampler] = {}  # seq_id -> its sampler

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Packs the scheduled sequences: -> (input_ids (N,), positions (N,), ForwardBatch)."""
        input_ids, positions, query_start_loc, seq_lens, logits_indices = [], [], [0], [], []
        slot_mapping = []
        for seq, num_new in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += [self.block_manager.slot(seq.seq_id, p) for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:  # caught up: the last token's logits pick the next one
                logits_indices.append(query_start_loc[-1] - 1)
        tables = [self.block_manager.block_tables[seq.seq_id] for seq, _ in scheduled]
        width = max(len(t) for t in tables)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        batch = ForwardBatch(
            query_start_loc=as_tensor(query_start_loc),
            seq_lens=as_tensor(seq_lens),
            slot_mapping=as_tensor(slot_mapping),
            block_tables=as_tensor([t + [0] * (width - len(t)) for t in tables]),  # pads: masked
            logits_indices=as_tensor(logits_indices),
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
            block_size=self.block_manager.block_size,
            state_slots=None
            if self.state_pool is None
            else as_tensor([self.state_pool.slot(seq.seq_id) for seq, _ in scheduled]),
        )
        return as_tensor(input_ids), as_tensor(positions), batch

    @torch.inference_mode()  # no_grad minus autograd's per-op bookkeeping, as vLLM runs
    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward step. Returns the sampled token per scheduled sequence (None mid-prompt)."""
        input_ids, positions, batch = self.prepare(scheduled)
        logits = self.model(input_ids, positions, batch, *self.caches)  # (R, V)
        samples = [s.num_computed_tokens + n == s.num_tokens for s, n in scheduled]
        chosen = [s for (s, _), f in zip(scheduled, samples, strict=True) if f]
        tokens = iter(self.sample(logits, chosen))
        return [next(tokens) if f else None for f in samples]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        for seq in seqs:
            if seq.seq_id not in self.samplers:
                self.samplers[seq.seq_id] = Sampler(seq.params, self.device)
        return sample_batch(logits, [self.samplers[seq.seq_id] for seq in seqs])

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
        self.samplers.pop(seq.seq_id, None)
        if self.state_pool is not None:
            self.state_pool.free(seq.seq_id)
