"""CUDA graphs for decode steps: one launch instead of hundreds.

Problem: a decode step of a small model is hundreds of small kernels (28 layers of projections,
norms, RoPE, attention). The GPU finishes each in microseconds; the host needs about as long to
launch it, so the GPU waits on Python. At batch 1 that launch time is most of a step.
Idea (io_uring / DMA descriptor rings: describe the work once, then submit it with one call):
record the kernels of a whole decode step once as a CUDA graph, then replay the recording each
step. A replay reads its inputs from the same addresses every time, so the step's inputs are
copied into static buffers first (input_batch.StepInputs), and a graph only fits the batch
size it was captured with: decode steps are padded up to the next captured size (a bucket).

Invariants:
- buckets are ascending, start at 1 and end at max_num_seqs, so every decode batch has one;
- graphs are captured largest first into one shared memory pool, so the smaller graphs reuse the
  largest one's intermediate memory instead of adding their own;
- a padded row writes no KV slot (slot PAD_SLOT_ID) and reads none (seq_len 0): padding can never
  touch a live sequence's cache (the convention of attention.py);
- nothing inside the captured forward syncs with the host or allocates outside the pool; shapes
  (including the block-table width, fixed at the model's longest context) are fixed at capture;
- a graph's output stays allocated for as long as the graph lives (each replay writes it). Small
  buckets (up to `lm_head_graph_max_batch` rows, 16) capture the LM head: at batch 1 its launch
  from Python after the replay cost 0.1 ms a token on the H200. Larger ones end at the hidden
  states and the LM head runs after the replay, as in vLLM: there a launch is nothing beside the
  step, and a captured head would keep a (rows, vocab) logits buffer per bucket, ~0.67 GB at 256
  sequences and Qwen3's 151,936 ids. The ablation in phase 7's README measures both.
"""

from bisect import bisect_left
from collections.abc import Callable

import torch

SMALL_BUCKETS = (1, 2, 4, 8, 16)  # small batches: powers of two (padding at most doubles a step)
BUCKET_STEP = 16  # above them, every multiple of BUCKET_STEP (padding < BUCKET_STEP rows)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured, ascending: powers of two to 16, multiples of 16, and
    max_num_seqs itself even when it is neither."""
    sizes = {b for b in SMALL_BUCKETS if b < max_num_seqs}
    sizes |= set(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    return sorted(sizes | {max_num_seqs})


def bucket_for(buckets: list[int], num_seqs: int) -> int:
    """The smallest bucket holding `num_seqs` rows."""
    if not 1 <= num_seqs <= buckets[-1]:
        raise ValueError(f"a decode step of {num_seqs} sequences fits no bucket (1..{buckets[-1]})")
    return buckets[bisect_left(buckets, num_seqs)]


class DecodeGraphs:
    """One captured decode step per bucket. `forward(rows)` runs the model on the first `rows`
    rows of the static input buffers and returns its output (hidden states or logits); it is
    called once per bucket to warm up (Triton compiles, cuBLAS picks its kernels) and once more
    under capture."""

    def __init__(self, forward: Callable[[int], torch.Tensor], buckets: list[int]):
        self.buckets = buckets
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its static output (rows, ...)
        pool = None
        with torch.inference_mode():
            for rows in reversed(buckets):  # largest first: the pool is sized by the first
                forward(rows)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[rows] = forward(rows)
                pool = graph.pool()
                self.graphs[rows] = graph
        torch.cuda.synchronize()

    def bucket_for(self, num_seqs: int) -> int:
        return bucket_for(self.buckets, num_seqs)

    def replay(self, rows: int) -> torch.Tensor:
        """Runs the captured step on whatever the static buffers hold now -> its output."""
        self.graphs[rows].replay()
        return self.outputs[rows]

    def output_bytes(self) -> int:
        """What the graphs' outputs keep allocated, all buckets together."""
        return sum(t.numel() * t.element_size() for t in self.outputs.values())
