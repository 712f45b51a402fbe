"""Qwen3.5 in phase 6: the gated delta rule's two forms, the hybrid model against transformers,
and the engine's second kind of per-sequence memory (state slots) through chunked prefill,
preemption (recompute and swap), aborts and bad checkpoints."""

import json
import logging

import pytest
import torch

from phase6_qwen3 import LLM, SamplingParams
from phase6_qwen3.attention import ForwardBatch
from phase6_qwen3.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule,
    gating,
    prepare_qk,
    recurrent_gated_delta_rule,
)
from phase6_qwen3.kv_cache import KVCache
from phase6_qwen3.loader import CheckpointError, load_model
from phase6_qwen3.qwen3_5 import Qwen3_5Config
from phase6_qwen3.state_pool import StatePool, StateShape
from tests import hybrid
from tests.tolerances import HF_MIN_MARGIN, HF_TINY_ATOL, SAME_MODEL_ATOL, assert_no_near_tie

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    return hybrid.tiny_qwen3_5()


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, qwen3_tokenizer_dir):
    return hybrid.save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory, qwen3_tokenizer_dir):
    directory = tmp_path_factory.mktemp("qwen3_5-published")
    return hybrid.save_tiny_qwen3_5(directory, qwen3_tokenizer_dir, layout="published")


@pytest.fixture(scope="module")
def prompts():
    return hybrid.prompts_of_lengths()


@pytest.fixture(scope="module")
def oracle(hf_model, prompts):
    """transformers' greedy tokens, certified free of near-ties along the whole path."""
    refs = hybrid.greedy_continuations(hf_model, prompts, MAX_TOKENS)
    for prompt, ref in zip(prompts, refs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1]
        assert_no_near_tie(logits, HF_MIN_MARGIN)
    return refs


def random_rule_inputs(T, h_k=2, h_v=4, d_k=16, d_v=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, h_k, d_k, generator=gen), torch.randn(T, h_k, d_k, generator=gen)
    v = torch.randn(T, h_v, d_v, generator=gen)
    a, b = torch.randn(T, h_v, generator=gen), torch.randn(T, h_v, generator=gen)
    A_log, dt_bias = torch.rand(h_v, generator=gen).log(), torch.rand(h_v, generator=gen)
    g, beta = gating(a, b, A_log, dt_bias)
    return q, k, v, g, beta, torch.randn(h_v, d_k, d_v, generator=gen)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_recurrent_and_chunked_forms_equal_transformers(T):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta, state = random_rule_inputs(T)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    qp, kp = prepare_qk(q, k, v.shape[1])
    for form in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        out, final = form(qp, kp, v, g, beta, state.clone())
        torch.testing.assert_close(out, ref_out[0], atol=SAME_MODEL_ATOL, rtol=0)
        torch.testing.assert_close(final, ref_state[0], atol=SAME_MODEL_ATOL, rtol=0)


def run_in_pieces(q, k, v, g, beta, x, weight, cuts, slot=2):
    """The packed rule and conv over one sequence fed in pieces [cuts[i], cuts[i+1]), continuing
    from a pool slot each time, as chunked prefill feeds it."""
    recurrent = torch.zeros(4, v.shape[1], q.shape[2], v.shape[2])
    conv = torch.zeros(4, x.shape[1], weight.shape[1] - 1)
    outs, convs = [], []
    for start, end in zip(cuts, cuts[1:], strict=False):
        span = slice(start, end)
        qsl = [0, end - start]
        convs.append(causal_conv1d(x[span], conv, weight, qsl, [slot]))
        outs.append(
            gated_delta_rule(q[span], k[span], v[span], g[span], beta[span], recurrent, qsl, [slot])
        )
    return torch.cat(outs), torch.cat(convs), recurrent[slot], conv[slot]


def test_prefill_split_at_any_chunk_boundary_equals_one_pass():
    T = 200
    q, k, v, g, beta, _ = random_rule_inputs(T, seed=1)
    x, weight = torch.randn(T, 12), torch.randn(12, 4)
    whole = run_in_pieces(q, k, v, g, beta, x, weight, [0, T])
    for cuts in ([0, 64, 128, T], [0, 63, 65, T], [0, 1, 2, 3, 130, T], [0, 199, T]):
        for got, want in zip(run_in_pieces(q, k, v, g, beta, x, weight, cuts), whole, strict=True):
            torch.testing.assert_close(got, want, atol=SAME_MODEL_ATOL, rtol=0)


def test_a_decode_batch_reads_and_writes_only_its_slots():
    q, k, v, g, beta, _ = random_rule_inputs(3, seed=2)
    pool = torch.randn(5, 4, 16, 8)
    before = pool.clone()
    gated_delta_rule(q, k, v, g, beta, pool, [0, 1, 2, 3], [4, 0, 2])
    for slot in (1, 3):
        assert torch.equal(pool[slot], before[slot])
    qp, kp = prepare_qk(q, k, 4)
    _, want = recurrent_gated_delta_rule(qp[1:2], kp[1:2], v[1:2], g[1:2], beta[1:2], before[0])
    torch.testing.assert_close(pool[0], want, atol=SAME_MODEL_ATOL, rtol=0)


def logits_through_engine_forward(model, ids: list[int]) -> torch.Tensor:
    c, T = model.config, len(ids)
    kv = KVCache(c.num_attention_layers, 1, T, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    pool = StatePool(c.state_shape, c.num_deltanet_layers, 2, torch.float32, "cpu")
    arange = torch.arange(T)
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, T]), seq_lens=torch.tensor([T]), slot_mapping=arange,
        block_tables=torch.tensor([[0]]), logits_indices=arange, max_query_len=T, max_seq_len=T,
        block_size=T, state_slots=torch.tensor([1]),
    )  # fmt: skip
    with torch.inference_mode():
        return model(torch.tensor(ids), arange, batch, kv, pool)


@pytest.mark.parametrize("layout", ["text", "published"])
def test_logits_equal_transformers(layout, qwen3_5_dir, published_dir, hf_model, caplog):
    directory = qwen3_5_dir if layout == "text" else published_dir
    with caplog.at_level(logging.INFO):
        loaded = load_model(directory)
    assert isinstance(loaded.config, Qwen3_5Config)
    assert loaded.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    if layout == "published":
        assert "skipped 2 checkpoint tensors outside the text model" in caplog.text
    ids = hybrid.prompts_of_lengths([150])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    got = logits_through_engine_forward(loaded.model, ids)
    torch.testing.assert_close(got, ref, atol=HF_TINY_ATOL, rtol=0)


def test_greedy_tokens_equal_transformers(qwen3_5_dir, prompts, oracle, caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(qwen3_5_dir)
    assert "prefix caching is off for this hybrid model" in caplog.text
    assert not llm.engine.block_manager.enable_prefix_caching
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == oracle


class CountingPreemptions:
    """Wraps a scheduler's `schedule` to count preemptions, and checks the pool every step."""

    def __init__(self, engine):
        self.engine, self.preempted = engine, 0
        schedule = engine.scheduler.schedule

        def counted():
            out = schedule()
            self.preempted += len(out.preempted)
            return out

        engine.scheduler.schedule = counted

    def check(self) -> None:
        self.engine.scheduler.check_invariants()
        running = {s.seq_id for s in self.engine.scheduler.running}
        self.engine.runner.state_pool.check_invariants(running)


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=48, num_kv_blocks=16, max_num_seqs=4),
        dict(max_num_batched_tokens=32, num_kv_blocks=16, max_num_seqs=4,
             preemption_mode="swap", num_cpu_kv_blocks=64),
    ],
    ids=["recompute", "swap"],
)  # fmt: skip
def test_chunked_prefill_and_preemption_give_identical_tokens(
    settings, qwen3_5_dir, prompts, oracle
):
    llm = LLM(qwen3_5_dir, **settings)
    engine = llm.engine
    counter = CountingPreemptions(engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        counter.check()
    assert counter.preempted > 0, "the settings no longer force a preemption"
    assert [done[i] for i in ids] == oracle
    assert sorted(engine.runner.state_pool.free_slots) == list(range(settings["max_num_seqs"]))


def test_aborts_give_every_slot_back_and_the_engine_still_answers(qwen3_5_dir, prompts, oracle):
    llm = LLM(qwen3_5_dir, max_num_batched_tokens=64, max_num_seqs=3)
    engine, pool = llm.engine, llm.engine.runner.state_pool
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert pool.slots, "nothing was running when the aborts came"
    for i in ids:
        engine.abort_request(i)
    pool.check_invariants(set())
    assert sorted(pool.free_slots) == [0, 1, 2]
    outs = llm.generate(prompts[:3], params, use_tqdm=False)  # slots reused: zeroed, not stale
    assert [o.outputs[0].token_ids for o in outs] == oracle[:3]


def test_state_pool_frees_zeroed_and_swaps_exactly():
    pool = StatePool(StateShape(12, 4, 2, 8, 8), 2, 3, torch.float32, "cpu")
    slot = pool.slot(seq_id=7)
    for tensor in pool.conv + pool.recurrent:
        tensor[slot] = torch.randn(tensor.shape[1:])
    saved = [t[slot].clone() for t in pool.conv + pool.recurrent]
    pool.swap_out(7)
    pool.check_invariants(set())
    pool.slot(seq_id=8)  # someone else takes the freed slot meanwhile
    restored = pool.slot(seq_id=7)
    assert restored != pool.slots[8]
    for tensor, want in zip(pool.conv + pool.recurrent, saved, strict=True):
        assert torch.equal(tensor[restored], want)
    pool.free(7)
    pool.free(8)
    pool.check_invariants(set())  # free slots are zero
    assert pool.recurrent[0].dtype == torch.float32 and not pool.recurrent[0].any()


def test_state_slot_bytes_at_qwen3_5_0_8b_shapes():
    """The README's numbers: a 0.8B sequence's state is ~19 MiB, the KV of ~1,600 tokens."""
    shape = StateShape(conv_channels=2 * 16 * 128 + 16 * 128, conv_width=4, num_heads=16,
                       key_dim=128, value_dim=128)  # fmt: skip
    per_sequence = 18 * shape.bytes_per_slot(torch.bfloat16)
    assert per_sequence == 18 * (6144 * 3 * 2 + 16 * 128 * 128 * 4) == 19_537_920
    kv_per_token = 6 * 2 * 2 * 256 * 2  # 6 attention layers, K and V, 2 KV heads of 256, bf16
    assert per_sequence // kv_per_token == 1590


def edit_config(directory, edit):
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_bad_hybrid_checkpoints_are_clear_errors(tmp_path, qwen3_5_dir):
    import shutil

    unknown = shutil.copytree(qwen3_5_dir, tmp_path / "unknown")
    edit_config(unknown, lambda c: c["layer_types"].__setitem__(1, "sliding_attention"))
    with pytest.raises(CheckpointError, match=r"layer_types\[1\] is 'sliding_attention'"):
        load_model(unknown)

    from safetensors.torch import load_file, save_file

    missing = shutil.copytree(qwen3_5_dir, tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.2\.linear_attn\.A_log"):
        load_model(missing)
