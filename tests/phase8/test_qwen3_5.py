"""Qwen3.5 in phase 8: `LLM(DIR)` and the server (engine core process, streaming) serve a hybrid
checkpoint with the tokens transformers gives, and the dashboard's frame shows its state slots."""

import json

import httpx
import pytest
import torch

from phase8_serving import LLM, SamplingParams
from phase8_serving.api_server import build_app
from phase8_serving.async_engine import AsyncLLM
from phase8_serving.config import ServerConfig
from phase8_serving.snapshot import engine_snapshot
from phase8_serving.tokenizer import Tokenizer
from tests import hybrid
from tests.tolerances import HF_MIN_MARGIN, assert_no_near_tie

from .conftest import ServerHost, tiny_core_spec

MAX_TOKENS = 16
NAME = "tiny-qwen3.5"


@pytest.fixture(scope="module")
def hf_model():
    return hybrid.tiny_qwen3_5()


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    from tests.assets import qwen3_tokenizer_dir

    directory = tmp_path_factory.mktemp("qwen3_5")
    return hybrid.save_tiny_qwen3_5(directory, qwen3_tokenizer_dir(), layout="published")


@pytest.fixture(scope="module")
def prompts():
    return hybrid.prompts_of_lengths([3, 64, 65])


@pytest.fixture(scope="module")
def oracle(hf_model, prompts):
    refs = hybrid.greedy_continuations(hf_model, prompts, MAX_TOKENS)
    for prompt, ref in zip(prompts, refs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1]
        assert_no_near_tie(logits, HF_MIN_MARGIN)
    return refs


def test_offline_llm_serves_the_published_checkpoint(qwen3_5_dir, prompts, oracle):
    llm = LLM(qwen3_5_dir, max_num_batched_tokens=48, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle
    frame = engine_snapshot(llm.engine)
    assert frame["state_slots"] == {"held": 0, "total": 2}


def test_prompt_logprobs_of_a_hybrid_are_transformers(qwen3_5_dir, hf_model, prompts):
    """A hybrid's prompt scored in chunks of 48 tokens (its DeltaNet state carried between
    them): each prompt token's logprob as transformers' forward over the whole prompt."""
    llm = LLM(qwen3_5_dir, max_num_batched_tokens=48, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        with torch.no_grad():
            want = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            assert got[i].logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4)


def test_the_server_streams_the_same_tokens(qwen3_5_dir, prompts, oracle):
    """Through the engine core process and HTTP: streamed deltas add up to the text of
    transformers' tokens, and so does the non-streamed answer."""
    tokenizer = Tokenizer.from_dir(qwen3_5_dir)
    llm = AsyncLLM.spawn(tiny_core_spec(qwen3_5_dir), NAME)
    host = ServerHost()
    try:
        url = host.serve(build_app(llm, ServerConfig(NAME, 512)))
        for prompt, ref in zip(prompts, oracle, strict=True):
            body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "skip_special_tokens": False}  # fmt: skip
            want = tokenizer.decode(ref)
            streamed = []
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:  # fmt: skip
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        streamed.append(json.loads(line[6:])["choices"][0]["text"])
            assert "".join(streamed) == want
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["text"] == want
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    finally:
        host.close()
        llm.shutdown()
