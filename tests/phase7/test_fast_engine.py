"""Phase 7's fast paths on CPU: decode buckets and padding, the kernel-backed engine (Triton
interpreter, float32) against the torch path, lazy detokenization, seeded requests in any batch.

The CUDA graph capture itself needs a GPU (test_gpu_engine.py); what a graph replays is
`ModelRunner._decode_forward` on padded static buffers, and that runs here through the kernels.
"""

import os

import pytest
import torch

from phase7_optim import LLM, SamplingParams
from phase7_optim.attention_backend import TorchAttention
from phase7_optim.cuda_graph import bucket_for, decode_buckets
from phase7_optim.kernels import PAD_SLOT_ID

from .conftest import QWEN3_VOCAB_SIZE

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)
PROMPTS = [[5, 17, 99, 2024, 7], [31337] * 3, list(range(1000, 1021))]


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def with_kernels(llm: LLM) -> LLM:
    """Routes attention through the Triton kernels (the interpreter runs them on CPU)."""
    from phase7_optim.attention_backend import TritonAttention

    llm.engine.runner.kv_cache.attention_backend = TritonAttention()
    return llm


@pytest.fixture(scope="module")
def tiny_llm(tiny_qwen3_tied_dir) -> LLM:
    return LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu", max_num_seqs=8)


# --- buckets -----------------------------------------------------------------------------------


def test_decode_buckets_cover_every_batch_up_to_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]  # 100: not a multiple
    for max_num_seqs in (1, 3, 17, 256, 300, 512):
        buckets = decode_buckets(max_num_seqs)
        assert buckets == sorted(set(buckets)) and buckets[0] == 1
        assert buckets[-1] == max_num_seqs
        for n in range(1, max_num_seqs + 1):
            b = bucket_for(buckets, n)
            assert b >= n and all(not (n <= c < b) for c in buckets)  # the smallest that fits
    with pytest.raises(ValueError, match="fits no bucket"):
        bucket_for(decode_buckets(8), 9)


def test_cpu_runs_the_torch_path_without_graphs(tiny_llm):
    assert tiny_llm.engine.runner.graphs is None
    assert isinstance(tiny_llm.engine.runner.kv_cache.attention_backend, TorchAttention)


class PadTo:
    """Stands in for DecodeGraphs where no GPU exists: the bucket it picks, and a "replay" that
    runs what a graph of that bucket captured, op by op."""

    def __init__(self, rows: int, runner):
        self.rows, self.runner = rows, runner

    def bucket_for(self, num_seqs: int) -> int:
        return self.rows

    def replay(self, rows: int) -> torch.Tensor:
        return self.runner._decode_forward(rows)


def decode_step(llm: LLM):
    """Prefills PROMPTS, then returns the next (decode-only) schedule."""
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, greedy(max_tokens=20))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    out = engine.scheduler.schedule()
    assert all(n == 1 for _, n in out.scheduled) and len(out.scheduled) == len(PROMPTS)
    return out.scheduled


@interpreter
@pytest.mark.parametrize("lm_head_graph_max_batch", [0, 8])
def test_padded_decode_rows_write_nowhere_and_read_nothing(
    tiny_qwen3_tied_dir, lm_head_graph_max_batch
):
    """A decode step padded to a bucket gives the unpadded step's logits (with the LM head in the
    replay or after it), and the padded rows leave every KV slot as the real rows left it."""
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu", max_num_seqs=8,
              lm_head_graph_max_batch=lm_head_graph_max_batch)  # fmt: skip
    llm = with_kernels(llm)
    runner = llm.engine.runner
    # before any step (what graph capture and warm-up run on) the decode order is a permutation
    assert runner.inputs.decode_order.tolist() == list(range(8))
    scheduled = decode_step(llm)
    eager = runner.forward(runner.prepare(scheduled))  # writes this step's K/V
    cache = [t.clone() for t in runner.kv_cache.k + runner.kv_cache.v]

    runner.graphs = PadTo(8, runner)
    step = runner.prepare(scheduled)
    assert step.graph_batch_size == 8
    inputs = runner.inputs
    assert (inputs.slot_mapping[3:8] == PAD_SLOT_ID).all() and (inputs.seq_lens[3:8] == 0).all()
    order = inputs.decode_order[:8].tolist()
    assert sorted(order[:3]) == [0, 1, 2] and sorted(order[3:]) == [3, 4, 5, 6, 7]  # padding last
    with torch.inference_mode():
        padded = runner._decode_forward(8)  # what a graph of bucket 8 replays, all 8 rows
        logits = runner.forward(step)  # the replay, then the LM head where it is not captured
    assert padded.shape[-1] == (logits.shape[-1] if lm_head_graph_max_batch == 8 else 64)
    torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()  # padded rows attend to nothing, without NaN
    live = torch.from_numpy(inputs.slot_mapping[:3]).long()
    for before, after in zip(cache, runner.kv_cache.k + runner.kv_cache.v, strict=True):
        before, after = before.flatten(0, 1), after.flatten(0, 1)  # (slots, H_kv, D)
        torch.testing.assert_close(after[live], before[live])  # rewritten, same values
        after[live] = before[live]
        assert torch.equal(before, after)  # and nothing else written


@interpreter
@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, pytest.param({"max_num_batched_tokens": 8, "block_size": 4}, marks=pytest.mark.slow)],
)
def test_kernel_backed_engine_equals_torch_path(tiny_qwen3_tied_dir, engine_kwargs):
    """Prefill, chunked prefill beside decodes, and decode steps through the kernels (float32,
    interpreter) give the torch path's greedy tokens."""
    make = lambda: LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu", **engine_kwargs)  # noqa: E731
    expected = tokens_of(make().generate(PROMPTS, greedy(), use_tqdm=False))
    actual = tokens_of(with_kernels(make()).generate(PROMPTS, greedy(), use_tqdm=False))
    assert actual == expected


def test_a_mixed_step_counts_its_leading_decodes(tiny_qwen3_tied_dir, monkeypatch):
    """ForwardBatch.num_decodes (what TritonAttention sends to the decode kernel) is the number
    of sequences before the first one with several new tokens, in every eager step."""
    seen = []
    attend = TorchAttention.attend

    def spy(self, q, k_cache, v_cache, batch, kernels):
        q_lens = batch.query_start_loc.diff().tolist()
        seen.append((batch.num_decodes, q_lens))
        return attend(self, q, k_cache, v_cache, batch, kernels)

    monkeypatch.setattr(TorchAttention, "attend", spy)
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu", max_num_batched_tokens=8)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for num_decodes, q_lens in seen:
        leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
        assert num_decodes == leading, q_lens
    assert any(0 < d < len(q_lens) for d, q_lens in seen)  # decodes beside a prompt chunk


def test_decodes_are_ordered_longest_context_first(tiny_qwen3_tied_dir, monkeypatch):
    """Every eager step's ForwardBatch.decode_order (the order the decode kernel starts its
    sequences in on CUDA) lists its leading decodes by context length, longest first."""
    seen = []
    attend = TorchAttention.attend

    def spy(self, q, k_cache, v_cache, batch, kernels):
        lens = batch.seq_lens[: batch.num_decodes].tolist()
        seen.append((batch.decode_order.tolist(), lens))
        return attend(self, q, k_cache, v_cache, batch, kernels)

    monkeypatch.setattr(TorchAttention, "attend", spy)
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", device="cpu", max_num_batched_tokens=8)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for order, lens in seen:
        assert sorted(order) == list(range(len(lens)))
        assert [lens[i] for i in order] == sorted(lens, reverse=True)
    assert any(lens != sorted(lens, reverse=True) for _, lens in seen)  # reordered somewhere


# --- host path ---------------------------------------------------------------------------------


def test_generate_detokenizes_a_request_once_not_every_step(tiny_llm, monkeypatch):
    tokenizer = tiny_llm.get_tokenizer()
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    outs = tiny_llm.generate(PROMPTS, greedy(max_tokens=24), use_tqdm=False)
    assert len(calls) <= 4 * len(PROMPTS)  # a catch-up and a flush, two decodes each
    for out in outs:
        assert out.outputs[0].text == decode(out.outputs[0].token_ids)
    calls.clear()
    tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=24, stop=["\x00"]), use_tqdm=False)
    assert len(calls) >= 24 * len(PROMPTS)  # a stop string is searched in the text every step


def test_streamed_outputs_still_come_every_step(tiny_llm):
    """CUMULATIVE (the default of add_request): an output with the text so far every step."""
    engine = tiny_llm.engine
    request_id = engine.add_request(PROMPTS[0], greedy(max_tokens=5))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    assert len(outs) == 5 and outs[-1].finished
    decode = tiny_llm.get_tokenizer().decode
    for out in outs:
        assert out.outputs[0].text == decode(out.outputs[0].token_ids)


def test_seeded_request_gives_the_same_tokens_whatever_shares_its_batch(tiny_llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = tokens_of(tiny_llm.generate([PROMPTS[0]], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.8, top_k=50, max_tokens=9), greedy(12)]
    crowded = tiny_llm.generate(PROMPTS, [seeded, *others], use_tqdm=False)
    assert tokens_of(crowded)[0] == alone
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=16, ignore_eos=True)
    assert tokens_of(tiny_llm.generate([PROMPTS[0]], other_seed, use_tqdm=False))[0] != alone
    assert all(0 <= t < QWEN3_VOCAB_SIZE for t in alone)
