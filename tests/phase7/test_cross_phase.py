"""Phase 7 on CPU says exactly what phase 6 says: identical greedy token ids.

Phase 7 changes how fast tokens come, never which: on CPU it runs phase 6's torch attention, with
the new host path (numpy step inputs, mirrored block tables), batched sampling, stacked q/k/v and
gate/up matmuls. Both phases load the same checkpoint in float32; phase 6 is the oracle, and its
path is certified by a teacher-forced margin check (top-1 beats top-2 by more than twice float32
drift), so a mismatch is a bug, not rounding. Tiny Qwen3 under several engine configurations
(chunked prefill, odd block sizes, preemption); SmolLM2 (the embedded default) marked slow.
"""

import pytest
import torch

import phase6_qwen3
import phase7_optim

from .conftest import assert_greedy_matches

ATOL = 1e-4  # float32 drift between two implementations of the same model (test_engine.py)
PROMPTS = [[1, 2, 3, 4, 5], [100, 7], [42] * 17, list(range(200, 231)), [151643, 9707, 11, 1879]]
MAX_TOKENS = 12
ENGINE_CONFIGS = {
    "default": {},
    "tiny_chunks": {"max_num_batched_tokens": 5},
    "block_size_7": {"block_size": 7, "max_num_batched_tokens": 16},
    "heavy_preemption": {"block_size": 4, "num_kv_blocks": 12},  # 48 slots: one request at a time
}


def greedy_ids(module, directory, prompts, **engine_kwargs) -> list[list[int]]:
    llm = module.LLM(directory, dtype="float32", device="cpu", **engine_kwargs)
    params = module.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def phase6_oracle(tiny_qwen3_tied_dir) -> list[list[int]]:
    expected = greedy_ids(phase6_qwen3, tiny_qwen3_tied_dir, PROMPTS)
    model = phase7_optim.load_model(tiny_qwen3_tied_dir, dtype=torch.float32).model
    for prompt, continuation in zip(PROMPTS, expected, strict=True):
        assert_greedy_matches(model, torch.tensor([prompt + continuation]), len(prompt), ATOL)
    return expected


QUICK_CONFIGS = {"default"}  # the others run in CI (slow)


@pytest.mark.parametrize(
    "name",
    [n if n in QUICK_CONFIGS else pytest.param(n, marks=pytest.mark.slow) for n in ENGINE_CONFIGS],
)
def test_tiny_qwen3_greedy_ids_equal_phase6(name, tiny_qwen3_tied_dir, phase6_oracle):
    actual = greedy_ids(phase7_optim, tiny_qwen3_tied_dir, PROMPTS, **ENGINE_CONFIGS[name])
    assert actual == phase6_oracle


@pytest.mark.slow
def test_smollm2_greedy_ids_equal_phase6(smollm2_dir):
    prompts = [[1, 504, 3575, 282, 4649, 314], [28, 1500, 2115, 30, 216]]
    expected = greedy_ids(phase6_qwen3, smollm2_dir, prompts)
    model = phase7_optim.load_model(smollm2_dir, dtype=torch.float32).model
    for prompt, continuation in zip(prompts, expected, strict=True):
        assert_greedy_matches(model, torch.tensor([prompt + continuation]), len(prompt), 5e-4)
    assert greedy_ids(phase7_optim, smollm2_dir, prompts, block_size=7) == expected
