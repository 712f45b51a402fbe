"""Model runner: turns the scheduler's decision into tensors, one forward pass, and tokens.

Problem: the scheduler thinks in sequences and token counts; the model wants packed tensors.
Idea: for every scheduled (sequence, num_new_tokens), take the next `num_new_tokens` of its token
ids, their positions (num_computed_tokens onwards) and their cache slots, pack all sequences into
one flat batch, run the model once, and sample a token for each sequence whose new tokens reach
its end (a sequence still mid-prompt samples nothing).

The runner owns the KV cache tensors and one `Sampler` per request (its seeded random stream
survives preemption); it never decides who runs.
"""

import torch

from .attention import ForwardBatch
from .block_manager import BlockManager
from .config import EngineConfig
from .kv_cache import KVCache
from .model import TinyTransformer
from .sampling import Sampler
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: TinyTransformer, config: EngineConfig, block_manager: BlockManager):
        self.model = model
        self.block_manager = block_manager
        self.device = next(model.parameters()).device
        c = model.config
        dtype = model.lm_head.weight.dtype
        self.kv_cache = KVCache(
            c.num_layers, config.num_kv_slots, c.num_kv_heads, c.head_dim, dtype, self.device
        )
        self.samplers: dict[int, Sampler] = {}  # seq_id -> its sampler

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Packs the scheduled sequences: -> (input_ids (N,), positions (N,), ForwardBatch)."""
        input_ids, positions, query_start_loc, seq_lens, logits_indices = [], [], [0], [], []
        for seq, num_new in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:  # caught up: the last token's logits pick the next one
                logits_indices.append(query_start_loc[-1] - 1)
        starts = [self.block_manager.regions[seq.seq_id].start for seq, _ in scheduled]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        positions_t = as_tensor(positions)
        token_starts = torch.repeat_interleave(
            as_tensor(starts), as_tensor([n for _, n in scheduled])
        )
        batch = ForwardBatch(
            query_start_loc=as_tensor(query_start_loc),
            seq_lens=as_tensor(seq_lens),
            slot_mapping=token_starts + positions_t,  # contiguous regions: slot = start + position
            context_starts=as_tensor(starts),
            logits_indices=as_tensor(logits_indices),
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
        )
        return as_tensor(input_ids), positions_t, batch

    @torch.inference_mode()  # no_grad minus autograd's per-op bookkeeping, as vLLM runs
    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward step. Returns the sampled token per scheduled sequence (None mid-prompt)."""
        input_ids, positions, batch = self.prepare(scheduled)
        logits = self.model(input_ids, positions, batch, self.kv_cache)  # (R, V)
        samples = [s.num_computed_tokens + n == s.num_tokens for s, n in scheduled]
        chosen = [s for (s, _), f in zip(scheduled, samples, strict=True) if f]
        tokens = iter(self.sample(logits, chosen))
        return [next(tokens) if f else None for f in samples]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if all(s.params.greedy for s in seqs):
            return logits.argmax(dim=-1).tolist()  # one host transfer for the whole batch
        tokens = []
        for row, seq in zip(logits, seqs, strict=True):
            if seq.seq_id not in self.samplers:
                self.samplers[seq.seq_id] = Sampler(seq.params, self.device)
            tokens.append(self.samplers[seq.seq_id](row))
        return tokens

    def release(self, seq: Sequence) -> None:
        self.samplers.pop(seq.seq_id, None)
