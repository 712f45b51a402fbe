"""Phase 8's `LLM` says exactly what phase 7's says: identical token ids.

Phase 8 adds serving around phase 7's engine and changes the engine only where a request asks for
penalties or logprobs; a request that asks for neither runs phase 7's code, so its tokens are the
same, bit for bit (same checkpoint, same float32 kernels: no tolerance is involved). Checked on
a tiny 2-layer Qwen3 with spread-out logits (conftest.py's defaults would just repeat the last
token, which a lost KV cache would too) under phase 7's engine configurations (chunked prefill,
an odd block size, preemption), greedy and seeded sampling; asking for logprobs must not change a
token either, and a greedy token's logprob is its top alternative's.
"""

import importlib
import inspect

import pytest

import phase7_optim
import phase8_serving

from .conftest import save_tiny_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [100, 7], [42] * 17, list(range(200, 231)), [258, 72, 105]]
MAX_TOKENS = 12
ENGINE_CONFIGS = {
    "default": {},
    "tiny_chunks": {"max_num_batched_tokens": 5},
    "block_size_7": {"block_size": 7, "max_num_batched_tokens": 16},
    "heavy_preemption": {"block_size": 4, "num_kv_blocks": 12},  # 48 slots: one request at a time
    "fp8_kv_cache": {"kv_cache_dtype": "fp8"},  # the KV cache in fp8, written and read alike
}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.8, top_p=0.9, seed=7),
}


@pytest.fixture(scope="module")
def spread_dir(tmp_path_factory):
    # Larger initial weights than transformers' 0.02: logits spread out, greedy has clear winners.
    directory = tmp_path_factory.mktemp("tiny-spread-qwen3")
    return save_tiny_checkpoint(
        directory, num_hidden_layers=2, initializer_range=0.2, tie_word_embeddings=False
    )


def outputs(module, directory, engine_kwargs: dict, trace=None, **params):
    llm = module.LLM(directory, dtype="float32", device="cpu", trace=trace, **engine_kwargs)
    sampling = module.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]


def num_preemptions(trace) -> int:
    return sum(len(step.preempted) for step in trace.steps)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_token_ids_equal_phase7(name, sampling, spread_dir):
    config, params = ENGINE_CONFIGS[name], SAMPLING[sampling]
    traces = phase7_optim.StepTrace(), phase8_serving.StepTrace()
    expected = [o.token_ids for o in outputs(phase7_optim, spread_dir, config, traces[0], **params)]
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts matter
    actual = outputs(phase8_serving, spread_dir, config, traces[1], **params)
    assert [o.token_ids for o in actual] == expected
    if name == "heavy_preemption":  # the case compares what it names: both engines preempted
        assert num_preemptions(traces[0]) > 0 and num_preemptions(traces[1]) > 0


def test_logprobs_change_no_token(spread_dir):
    expected = [o.token_ids for o in outputs(phase7_optim, spread_dir, {}, temperature=0.0)]
    actual = outputs(phase8_serving, spread_dir, {}, temperature=0.0, logprobs=2)
    assert [o.token_ids for o in actual] == expected
    for completion in actual:
        assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
        for lp in completion.logprobs:
            (top_id, top_logprob), _ = lp.top_logprobs
            assert (top_id, top_logprob) == (lp.token_id, lp.logprob)


def test_mixed_steps_count_the_same_leading_decodes_as_phase7(spread_dir, monkeypatch):
    """Phase 8's runner carries phase 7's mixed-step routing: in every eager step it hands
    attention the same `num_decodes` (the decodes the decode kernel takes on CUDA) in the same
    order (`decode_order`, longest context first), and some of those steps mix decodes with a
    prompt chunk."""
    seen = {}
    for module in (phase7_optim, phase8_serving):
        backend = module.attention_backend.TorchAttention
        attend, counts = backend.attend, seen.setdefault(module.__name__, [])

        def spy(self, q, k_cache, v_cache, batch, kernels, attend=attend, counts=counts):
            order = batch.decode_order.tolist()  # the decode kernel's longest-first order
            counts.append((batch.num_decodes, order, batch.query_start_loc.diff().tolist()))
            return attend(self, q, k_cache, v_cache, batch, kernels)

        monkeypatch.setattr(backend, "attend", spy)
        outputs(module, spread_dir, ENGINE_CONFIGS["tiny_chunks"], temperature=0.0)
    assert seen["phase7_optim"] == seen["phase8_serving"]
    assert any(0 < d < len(q_lens) for d, _, q_lens in seen["phase8_serving"])


def test_decode_path_kernels_are_phase7s_and_launched_alike():
    """Phase 8 serves with phase 7's kernels: every Triton kernel of the decode path has the same
    source, and its wrapper the same programmatic-dependent-launch settings (kernels/pdl.py; phase
    7's test_fused.py checks that none touches memory before its wait)."""
    pytest.importorskip("triton")
    for name in ("fused", "paged_decode", "pdl", "gemv", "sampling"):
        ours = importlib.import_module(f"phase8_serving.kernels.{name}")
        theirs = importlib.import_module(f"phase7_optim.kernels.{name}")
        assert inspect.getsource(ours) == inspect.getsource(theirs), f"kernels/{name}.py differs"
    assert phase8_serving.kernels.paged_decode.TUNED_DECODE_CONFIG.pdl
