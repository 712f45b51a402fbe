"""Phase 7 on the GPU (`pytest -m gpu tests/phase7` on the H200): the kernel-backed bf16 engine
against the torch path in float32, CUDA graph replay against eager, no host sync in a step.

Teacher forcing and how a position is certified: the engine (bf16, Triton kernels, CUDA graphs)
generates greedily; its sequences are then run once more, whole, through the float32 torch
attention path (the reference; its element-wise ops run as the fused kernels, float32 inside,
checked on their own in test_fused.py) and through the same path in bf16. bf16 noise is measured,
not assumed: at each generated position, `noise` is the largest |bf16 - fp32| difference of any
logit there. Where the reference's top-1/top-2 margin exceeds 2 * noise, bf16 rounding of that
size cannot swap the two, so the engine's token there must be the reference's top-1; elsewhere
the position is a near-tie and is not compared. Every position is compared against the engine's
own prefix, so one near-tie does not hide the positions after it. The test also requires a good
share of positions to be certified (MIN_CERTIFIED), so it cannot pass by certifying nothing.
"""

import shutil

import pytest
import torch

from phase7_optim import LLM, SamplingParams
from phase7_optim.attention import ForwardBatch
from phase7_optim.attention_backend import TorchAttention
from phase7_optim.kv_cache import KVCache
from phase7_optim.loader import load_model
from tests import assets

CUDA = torch.device("cuda")
# Qwen3-0.6B's attention and MLP shapes, 4 layers: the kernels see the real head_dim and GQA.
SMALL_QWEN3 = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    initializer_range=0.1,  # peaky logits: most greedy steps have a clear winner
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
PROMPT_LENS = [1, 17, 100, 333, 700, 1029, 64, 5]
NEW_TOKENS = 40
MIN_CERTIFIED = 0.3  # of the generated positions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path_factory.mktemp("qwen3-small")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SMALL_QWEN3)).save_pretrained(directory)
    tokenizer_dir = assets.qwen3_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 10000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def step_until_all_decode(engine) -> None:
    """Steps until every request is admitted and past its prompt: the next step is decode-only."""
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()


@torch.inference_mode()
def teacher_forced_logits(model, sequence: list[int]) -> torch.Tensor:
    """(T, V) float32 logits of every position of one sequence, through the torch path."""
    c, T = model.config, len(sequence)
    dtype = model.lm_head.weight.dtype
    cache = KVCache(c.num_layers, 1, T, c.num_kv_heads, c.head_dim, dtype, CUDA, TorchAttention())
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=CUDA)  # noqa: E731
    batch = ForwardBatch(
        query_start_loc=i32([0, T]),
        seq_lens=i32([T]),
        slot_mapping=torch.arange(T, dtype=torch.int32, device=CUDA),
        block_tables=i32([[0]]),
        logits_indices=torch.arange(T, device=CUDA),
        max_query_len=T,
        max_seq_len=T,
        block_size=T,
    )
    positions = torch.arange(T, device=CUDA)
    return model(torch.tensor(sequence, device=CUDA), positions, batch, cache).float()


@pytest.mark.gpu
def test_gpu_kernel_engine_matches_the_fp32_torch_path(checkpoint):
    llm = LLM(checkpoint, dtype="bfloat16", max_num_seqs=8, num_kv_blocks=1024)
    assert llm.engine.runner.graphs is not None  # decode steps replay graphs
    outs = llm.generate(prompts(), greedy(), use_tqdm=False)
    del llm
    reference = load_model(checkpoint, torch.float32, CUDA).model
    bf16 = load_model(checkpoint, torch.bfloat16, CUDA).model
    certified = compared = 0
    for prompt, out in zip(prompts(), outs, strict=True):
        generated = out.outputs[0].token_ids
        sequence = prompt + generated
        rows = slice(len(prompt) - 1, len(sequence) - 1)  # the logits that chose `generated`
        ref = teacher_forced_logits(reference, sequence)[rows]
        noise = (teacher_forced_logits(bf16, sequence)[rows] - ref).abs().amax(dim=-1)  # (T,)
        top2 = ref.topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * noise
        expected = top2.indices[:, 0]
        actual = torch.tensor(generated, device=CUDA)
        assert torch.equal(actual[clear], expected[clear]), f"prompt of {len(prompt)} tokens"
        certified += int(clear.sum())
        compared += len(generated)
    assert certified >= MIN_CERTIFIED * compared, f"only {certified}/{compared} certified"


@pytest.mark.gpu
@pytest.mark.parametrize("lm_head_graph_max_batch", [0, 20])
def test_gpu_graph_replay_equals_eager_for_the_same_step(checkpoint, lm_head_graph_max_batch):
    """max_num_seqs 20 (not a power of two) and 19 sequences: bucket 20, one padded row. Without
    overlap scheduling, so that the step prepared by hand has no placeholders to fill."""
    llm = LLM(
        checkpoint, dtype="bfloat16", max_num_seqs=20, max_num_batched_tokens=2048,
        num_kv_blocks=2048, async_scheduling=False, lm_head_graph_max_batch=lm_head_graph_max_batch,
    )  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs.buckets[-1] == 20
    for p in (prompts() * 3)[:19]:
        engine.add_request(p, greedy(8))
    step_until_all_decode(engine)
    engine.step()  # one decode step through a graph
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == 19 and all(n == 1 for _, n in out.scheduled)
    step = runner.prepare(out.scheduled)
    assert step.graph_batch_size == 20
    with torch.inference_mode():
        replayed = runner.forward(step).clone()
        eager = runner._decode_forward(20)[:19]  # the same buffers, run op by op
        if not lm_head_graph_max_batch:  # the replay ends at the hidden states
            eager = llm.engine.runner.model.compute_logits(eager)
    torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


@pytest.mark.gpu
def test_gpu_only_small_graphs_keep_a_logits_buffer(checkpoint):
    """Graphs of up to 16 rows capture the LM head; larger ones end at the hidden states: what
    they keep allocated is 16 small logits buffers' worth, not the 0.67 GB that 256 rows of
    Qwen3's vocabulary in every bucket would take."""
    llm = LLM(checkpoint, dtype="bfloat16", max_num_seqs=256, num_kv_blocks=1024)
    graphs, c = llm.engine.runner.graphs, llm.engine.runner.model.config
    small = sum(b for b in graphs.buckets if b <= 16)
    large = sum(b for b in graphs.buckets if b > 16)
    assert graphs.output_bytes() == (small * c.vocab_size + large * c.hidden_size) * 2  # bf16
    del llm
    captured = LLM(checkpoint, dtype="bfloat16", max_num_seqs=32, num_kv_blocks=1024,
                   lm_head_graph_max_batch=32)  # fmt: skip
    graphs = captured.engine.runner.graphs
    assert graphs.output_bytes() == sum(graphs.buckets) * c.vocab_size * 2


@pytest.mark.gpu
def test_gpu_graphs_and_eager_generate_the_same_tokens(checkpoint):
    """End to end, the first tokens of every request agree with enforce_eager=True; batches are
    padded to buckets in one and not the other, so bf16 GEMMs may round differently: compare the
    first tokens, where the random model's margins are wide."""
    ps = prompts()
    eager = LLM(checkpoint, dtype="bfloat16", enforce_eager=True, max_num_seqs=8)
    assert eager.engine.runner.graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(ps, greedy(4), use_tqdm=False)]
    del eager
    graphs = LLM(checkpoint, dtype="bfloat16", max_num_seqs=8)
    actual = [o.outputs[0].token_ids for o in graphs.generate(ps, greedy(4), use_tqdm=False)]
    assert actual == expected


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_a_step_never_syncs_before_its_tokens_are_read(
    checkpoint, enforce_eager, async_scheduling
):
    """Preparing a step's inputs, its forward and sampling (greedy, temperature, top-k/top-p,
    seeded rows) queue on the device with no host sync; the step's one sync is the `.tolist()` of
    its tokens. `prepare` also waits on an event (the previous step's input copies, before their
    host buffers are rewritten), which the sync debug mode does not flag: the test checks that
    the event is complete by then, so that wait never blocks. With overlap scheduling, `execute`
    also gathers the previous step's sampled ids into the input ids: on the device, no sync."""
    llm = LLM(checkpoint, dtype="bfloat16", max_num_seqs=8, enforce_eager=enforce_eager,
              async_scheduling=async_scheduling)  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    kinds = [greedy(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=9, seed=3),
             SamplingParams(temperature=1.0, min_p=0.05, max_tokens=9)]  # fmt: skip
    for i, p in enumerate(prompts()[:6]):
        engine.add_request(p, kinds[i % 3])
    calls = []

    def without_syncs(method):
        def wrapped(*args):
            torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
            try:
                calls.append(method.__name__)
                return method(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return wrapped

    prepare_without_syncs = without_syncs(runner.prepare)

    def prepare(*args):
        assert runner.inputs.copied.query()  # the last step's input copies are done: no wait
        return prepare_without_syncs(*args)

    runner.prepare = prepare
    runner.execute = without_syncs(runner.execute)
    for _ in range(12):  # chunked prefills beside decodes (budget 256), then decode steps
        engine.step()
    assert calls == ["prepare", "execute"] * 12


@pytest.mark.gpu
def test_gpu_overlap_gives_the_tokens_of_the_engine_without_it(checkpoint):
    """Overlap scheduling on and off, CUDA graphs on, bf16: greedy and seeded requests (the
    exponential-race kernel, and the filtered path) get identical tokens. Every prompt fits the
    first step's budget and max_tokens is the only stop, so both engines run the same batches
    step for step (a stop token would give the overlapped engine one extra row for a step, and
    a bucket of another size may round bf16 GEMMs differently): equality is exact."""
    params = [
        greedy(24),
        SamplingParams(temperature=0.8, seed=11, max_tokens=31, ignore_eos=True),
        SamplingParams(
            temperature=0.7, top_k=40, top_p=0.9, seed=12, max_tokens=17, ignore_eos=True
        ),
        greedy(1),
    ] * 2
    tokens = {}
    for overlap in (False, True):
        llm = LLM(checkpoint, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=4096,
                  num_kv_blocks=1024, async_scheduling=overlap)  # fmt: skip
        assert (
            llm.engine.runner.graphs is not None and llm.engine.config.async_scheduling is overlap
        )
        outs = llm.generate(prompts(), params, use_tqdm=False)
        tokens[overlap] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == [p.max_tokens for p in params]


@pytest.mark.gpu
def test_gpu_kv_cache_fills_gpu_memory_utilization(checkpoint):
    """num_kv_blocks unset: after start-up, everything on the GPU (this engine, the CUDA context,
    whatever else runs) comes to gpu_memory_utilization of it, less the room kept for the largest
    step's activations (measured by the profiling step) and a block's rounding."""
    utilization = 0.5
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    in_use_before = total - free  # other tests' leftovers, the CUDA context: the cache's too
    llm = LLM(checkpoint, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=utilization)
    kv = llm.engine.kv_cache_config
    free, total = torch.cuda.mem_get_info()
    budget = utilization * total
    step_allowance = 4 * 2**30  # > the largest step (16,384 tokens, 256 sampled rows) here
    late_allocations = 256 * 2**20  # the step buffers, libraries' workspaces made after the profile
    assert budget - step_allowance <= total - free <= budget + late_allocations
    weights = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    assert kv.memory_bytes >= budget - in_use_before - weights - step_allowance
    assert llm.engine.block_manager.num_free_blocks == kv.num_blocks
