"""`LLM(...)` takes vLLM's engine arguments (config.py's `engine_config`): an unknown one is a
TypeError that lists the known ones, a vLLM argument without meaning here is refused by name
unless it asks for nothing, and `max_model_len` caps requests and sizes the block tables."""

import pytest

from phase7_optim import LLM, SamplingParams

CPU = dict(dtype="float32", device="cpu")


def test_unknown_and_unsupported_arguments_are_named(tmp_path):
    missing = tmp_path / "nothing-here"  # never read: the arguments fail first
    with pytest.raises(
        TypeError,
        match=r"'max_modl_len' \(did you mean 'max_model_len'\?\); "
        r"the known ones are: .*enforce_eager",
    ):
        LLM(missing, max_modl_len=64, **CPU)  # fmt: skip
    with pytest.raises(ValueError, match=r"vLLM's pipeline_parallel_size=2 is not supported"):
        LLM(missing, pipeline_parallel_size=2, **CPU)


def test_max_model_len_caps_requests(tiny_qwen3_tied_dir):
    llm = LLM(tiny_qwen3_tied_dir, max_model_len=32, trust_remote_code=True, seed=0, **CPU)
    assert llm.engine.kv_cache_config.max_model_len == 32
    assert llm.engine.runner.max_blocks == 2  # 16-token blocks
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(32\)"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=3), use_tqdm=False)
    (out,) = llm.generate([[1] * 30], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
