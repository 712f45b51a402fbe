"""Tensor parallelism on CPU: gloo, 2 processes, the unsharded model as the oracle.

- Shard bookkeeping (no processes): the pieces of all ranks tile every checkpoint tensor, and
  replicated KV heads are the ones their ranks' query heads read.
- Layers (2 spawned processes): each parallel layer, loaded from the same full weights, gives the
  unsharded layer's output on every rank; a tiny Qwen3 (tied, with one KV head for 2 ranks, which
  replicates it) loaded at TP=2 gives the TP=1 logits; the ranks agree on the smallest KV cache.
- The engine: `LLM(..., tensor_parallel_size=2)` returns the same greedy tokens as TP=1, and
  `shutdown()` leaves no process and no process group.
Rank 0 is always this test process and rank 1 a spawned one (starting Python and torch is most of
the time these tests take).
- `load_format="dummy"`: random weights built per shard, from a config.json alone.
Float32 everywhere: TP only reorders the sums of row-parallel layers, an error of ~1e-6.
"""

import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phase7_optim import LLM, SamplingParams
from phase7_optim.attention import ForwardBatch
from phase7_optim.distributed import (
    SINGLE_RANK,
    TensorParallel,
    free_port,
    init_process_group,
    min_over_ranks,
)
from phase7_optim.embedding import ParallelLMHead, VocabParallelEmbedding
from phase7_optim.kv_cache import KVCache
from phase7_optim.linear import QKVParallelLinear, RowParallelLinear, WeightShard
from phase7_optim.loader import DUMMY_WEIGHT_RANGE, checkpoint_targets, load_model
from phase7_optim.mlp import MLP
from tests import assets

ATOL = 1e-5  # float32, sums reordered across 2 ranks
LOGITS_ATOL = 1e-4  # 2 layers of it, logits of size ~10
TP = 2
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 4, 2, 16, 512
PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 40]
QWEN3_VOCAB_SIZE = 151936  # the real vocabulary, so the real tokenizer's ids are all valid
TINY_QWEN3 = dict(  # as tests/phase6's tiny Qwen3
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    initializer_range=0.2,  # logits spread out: greedy argmax has clear winners
    bos_token_id=151643,
    eos_token_id=151645,
)


def test_shards_tile_every_checkpoint_tensor():
    for size in (1, 2, 4):
        ranks = [TensorParallel(r, size) for r in range(size)]
        rows = [RowParallelLinear(INTERMEDIATE, HIDDEN, tp).shard() for tp in ranks]
        assert _covered(rows, INTERMEDIATE) and rows[0].full_shape == (HIDDEN, INTERMEDIATE)
        vocab = [VocabParallelEmbedding(VOCAB, HIDDEN, tp).shard() for tp in ranks]
        assert _covered(vocab, VOCAB)
        qkv = [QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp) for tp in ranks]
        assert _covered([m.shard("q") for m in qkv], HEADS * HEAD_DIM)
        for m in qkv:  # q, k, v stacked in that order in the weight
            q, k, v = (m.shard(s) for s in ("q", "k", "v"))
            assert (q.dest_start, k.dest_start, v.dest_start) == (0, q.size, q.size + k.size)
            assert k.start == v.start


def test_kv_heads_are_replicated_for_the_queries_that_read_them():
    # 4 query heads, 2 KV heads, 4 ranks: rank r holds query head r, which reads KV head r // 2.
    for rank in range(4):
        m = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, TensorParallel(rank, 4))
        assert (m.num_heads, m.num_kv_heads) == (1, 1)
        assert m.shard("k").start == (rank // 2) * HEAD_DIM
        assert m.shard("q").start == rank * HEAD_DIM


def _covered(shards: list[WeightShard], n: int) -> bool:
    pieces = sorted((s.start, s.start + s.size) for s in shards)
    return (
        pieces[0][0] == 0
        and pieces[-1][1] == n
        and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    )


@pytest.mark.parametrize(
    "what, build",
    [
        ("num_heads", lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, 6, 2, TensorParallel(0, 4))),
        ("num_kv_heads", lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, 6, 3, TensorParallel(0, 2))),
        ("vocab_size", lambda: VocabParallelEmbedding(511, HIDDEN, TensorParallel(0, 2))),
        ("input features", lambda: RowParallelLinear(65, HIDDEN, TensorParallel(0, 2))),
        ("tensor_parallel_size", lambda: TensorParallel(0, 0)),
    ],
)
def test_uneven_splits_are_refused_by_name(what, build):
    with pytest.raises(ValueError, match=what):
        build()


# ---- Layers and the model, in 2 spawned processes ----------------------------------------------


def _load_piece(param: torch.Tensor, full: torch.Tensor, shard: WeightShard) -> None:
    with torch.no_grad():
        piece = full.narrow(shard.dim, shard.start, shard.size)
        param.narrow(shard.dim, shard.dest_start, shard.size).copy_(piece)


def _check_layers(tp: TensorParallel) -> None:
    gen = torch.Generator().manual_seed(0)  # the same full weights on every rank
    x = torch.randn(5, HIDDEN, generator=gen)
    # Scaled by 1 / sqrt(fan-in), so outputs are O(1) and ATOL means what it says.
    gate, up = torch.randn(2, INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
    mlp = MLP(HIDDEN, INTERMEDIATE, tp)
    _load_piece(mlp.gate_up_proj.weight, gate, mlp.gate_up_proj.shard(0))
    _load_piece(mlp.gate_up_proj.weight, up, mlp.gate_up_proj.shard(1))
    _load_piece(mlp.down_proj.weight, down, mlp.down_proj.shard())
    want = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T
    torch.testing.assert_close(mlp(x), want, atol=ATOL, rtol=0)

    q_w = torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen) / HIDDEN**0.5
    k_w, v_w = torch.randn(2, KV_HEADS * HEAD_DIM, HIDDEN, generator=gen) / HIDDEN**0.5
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp)
    for name, w in (("q", q_w), ("k", k_w), ("v", v_w)):
        _load_piece(qkv.weight, w, qkv.shard(name))
    q, k, v = qkv(x).split(qkv.local_sizes, dim=-1)
    heads = lambda y, first, n: y.view(5, -1, HEAD_DIM)[:, first : first + n]  # noqa: E731
    torch.testing.assert_close(q.view(5, -1, HEAD_DIM), heads(x @ q_w.T, tp.rank * 2, 2))
    torch.testing.assert_close(k.view(5, -1, HEAD_DIM), heads(x @ k_w.T, tp.rank, 1))
    torch.testing.assert_close(v.view(5, -1, HEAD_DIM), heads(x @ v_w.T, tp.rank, 1))

    table = torch.randn(VOCAB, HIDDEN, generator=gen)
    ids = torch.tensor([0, 255, 256, 511, 3])  # both ranks' ranges, and their edges
    embed, head = VocabParallelEmbedding(VOCAB, HIDDEN, tp), ParallelLMHead(VOCAB, HIDDEN, tp)
    _load_piece(embed.weight, table, embed.shard())
    _load_piece(head.weight, table, head.shard())
    torch.testing.assert_close(embed(ids), table[ids], atol=0, rtol=0)
    torch.testing.assert_close(head(x), x @ table.T, atol=ATOL, rtol=0)


def prefill_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """Every position's logits (T, V) of one prompt prefilled into one block of T slots."""
    T, c = len(prompt), model.config
    dtype = next(model.parameters()).dtype
    kv_heads = model.model.layers[0].self_attn.num_kv_heads  # this rank's
    kv_cache = KVCache(c.num_layers, 1, T, kv_heads, c.head_dim, dtype, "cpu")
    arange = lambda n: torch.arange(n, dtype=torch.int32)  # noqa: E731
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32),
        slot_mapping=arange(T),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        logits_indices=arange(T),
        max_query_len=T,
        max_seq_len=T,
        block_size=T,
    )
    with torch.inference_mode():
        return model(torch.tensor(prompt), torch.arange(T), batch, kv_cache)


def _check_model(tp: TensorParallel, mqa_dir: str) -> None:
    whole = load_model(mqa_dir, torch.float32).model
    shard = load_model(mqa_dir, torch.float32, "cpu", tp).model
    params = sum(p.numel() for p in shard.parameters())
    assert params < sum(p.numel() for p in whole.parameters()), "each rank holds a part"
    for prompt in PROMPTS:
        want = prefill_logits(whole, prompt)
        torch.testing.assert_close(prefill_logits(shard, prompt), want, atol=LOGITS_ATOL, rtol=0)
    dummy = load_model(mqa_dir, torch.float32, "cpu", tp, load_format="dummy").model
    qkv = checkpoint_targets(dummy)["model.layers.0.self_attn.q_proj.weight"].param
    # this rank's 2 of the 4 query heads, then its replica of the one KV head (k and v)
    assert qkv.shape == ((HEADS // TP + 2) * HEAD_DIM, HIDDEN)
    assert all(p.abs().max() <= DUMMY_WEIGHT_RANGE for p in dummy.parameters())


def _rank_main(rank: int, size: int, port: int, mqa_dir: str) -> None:
    tp = TensorParallel(rank, size)
    init_process_group(tp, torch.device("cpu"), port)
    try:
        _check_layers(tp)
        _check_model(tp, mqa_dir)
        # each rank sizes its KV cache from its own memory; all keep the smallest count
        assert min_over_ranks(100 - rank, tp, torch.device("cpu")) == 100 - (size - 1)
        # Both ranks done before either tears gloo down: a rank that closes its sockets while the
        # other still reads the last collective's reply aborts it ("terminate called without an
        # active exception", seen once on the loaded 2-core machine). Not in `finally`: after a
        # failure the other rank may never arrive.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_tiny_qwen3(directory: Path, tied: bool, num_kv_heads: int) -> Path:
    """A random 2-layer Qwen3 saved by transformers (fixed seed), with the real tokenizer files."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**dict(TINY_QWEN3, num_key_value_heads=num_kv_heads),
                         vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=tied)  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # random norm gains: a norm applied on the wrong slice shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.qwen3_tokenizer_dir() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """Untied, 2 KV heads: one per rank at TP=2 (the tied, replicated case is `mqa_dir`)."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("untied"), tied=False, num_kv_heads=KV_HEADS)


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory) -> Path:
    """Tied, and one KV head for 4 query heads: at TP=2 both ranks hold a replica of it."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("mqa"), tied=True, num_kv_heads=1)


@pytest.mark.slow  # spawned ranks; the shard tests above run in this process
def test_parallel_layers_and_model_match_unsharded(mqa_dir):
    args = (TP, free_port(), str(mqa_dir))
    # Rank 0 is this process: one interpreter fewer to start than spawning both.
    rank1 = mp.get_context("spawn").Process(target=_rank_main, args=(1, *args))
    rank1.start()
    try:
        _rank_main(0, *args)
    finally:
        rank1.join()
    assert rank1.exitcode == 0, "rank 1 failed: its traceback is in the captured stderr"


# ---- The engine ------------------------------------------------------------------------------


# A 16-token budget chunks the 40-token prompt; alone, its first steps sample nothing (the LM
# head gathers zero rows).
ENGINE = dict(dtype="float32", max_num_batched_tokens=16)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    outs += llm.generate([PROMPTS[2]], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow  # two spawned ranks over gloo, each importing torch
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_engine_gives_tp1_greedy_tokens_and_shuts_down(tiny_dir, async_scheduling):
    """With overlap scheduling too: rank 0 fills the placeholders into its input ids on the device
    before it broadcasts them, so the other ranks see the same ids without sampling."""
    want = greedy_tokens(LLM(tiny_dir, **ENGINE))
    llm = LLM(tiny_dir, **ENGINE, tensor_parallel_size=TP, async_scheduling=async_scheduling)
    try:
        assert greedy_tokens(llm) == want
    finally:
        llm.shutdown()
    workers = llm.workers
    assert workers.exitcodes == [0] * (TP - 1), "workers exit cleanly"
    assert not dist.is_initialized(), "rank 0 left the process group"


def test_indivisible_model_is_refused_before_any_process_starts(tiny_dir):
    with pytest.raises(ValueError, match="divisible by tensor_parallel_size"):
        LLM(tiny_dir, dtype="float32", tensor_parallel_size=3)
    assert not multiprocessing.active_children() and not dist.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < TP, reason=f"needs {TP} GPUs")
def test_tp2_on_gpus_gives_tp1_greedy_tokens(tiny_dir):
    """NCCL, the Triton kernels, and decode steps replayed from CUDA graphs that hold
    all-reduces: float32, so the sums' order is the only difference."""
    want = greedy_tokens(LLM(tiny_dir, **ENGINE, device="cuda"))
    llm = LLM(tiny_dir, **ENGINE, device="cuda", tensor_parallel_size=TP)
    try:
        assert llm.engine.runner.graphs is not None, "decode steps replay CUDA graphs"
        assert llm.engine.config.async_scheduling, "overlap scheduling is on by default on CUDA"
        assert greedy_tokens(llm) == want
    finally:
        llm.shutdown()
    assert llm.workers.exitcodes == [0] * (TP - 1) and not dist.is_initialized()


def test_dummy_weights_need_only_a_config(tmp_path, mqa_dir):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(mqa_dir / name, tmp_path / name)  # no safetensors
    first = load_model(tmp_path, torch.float32, load_format="dummy").model
    again = load_model(tmp_path, torch.float32, load_format="dummy").model
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: dummy weights are seeded"
        assert 0 < a.abs().max() <= DUMMY_WEIGHT_RANGE, name
    llm = LLM(tmp_path, dtype="float32", load_format="dummy")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="pt")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)  # without "dummy", the missing weights are an error


def test_single_rank_is_the_plain_path(mqa_dir):
    model = load_model(mqa_dir, torch.float32, "cpu", SINGLE_RANK).model
    logits = prefill_logits(model, PROMPTS[1])  # no process group exists, none is needed
    assert logits.shape == (3, model.config.vocab_size) and not dist.is_initialized()
