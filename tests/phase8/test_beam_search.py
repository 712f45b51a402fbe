"""Beam search (vLLM's `LLM.beam_search`, the server's `use_beam_search`).

Oracles: a scripted table of log-probabilities where greedy decoding loses (the search alone);
transformers' forward over each whole beam, searched the same way by this file (the engine's
logprobs come from its cache, a step of one-token requests at a time); greedy decoding, which a
search of one beam without EOS is.
"""

import math

import httpx
import pytest
import torch
import transformers

from phase8_serving import LLM, BeamSearchParams, SamplingParams
from phase8_serving.beam_search import MAX_BEAM_WIDTH, BeamSearch

from .conftest import MAX_MODEL_LEN, assert_openai_error

EOS = 9
# token -> log-probability of each next token, after each prefix (the prompt is [0])
TABLE = {
    (0,): {1: math.log(0.6), 2: math.log(0.4)},
    (0, 1): {3: math.log(0.5), 4: math.log(0.5)},  # 1 leads to two even halves...
    (0, 2): {5: math.log(0.95), EOS: math.log(0.05)},  # ...2 to one sure thing
}


def search(params: BeamSearchParams, table=TABLE) -> list:
    beam_search = BeamSearch([0], params, [EOS])
    while not beam_search.done:
        beam_search.advance([
            sorted(table.get(tuple(b.tokens), {EOS: 0.0}).items(), key=lambda kv: -kv[1])
            [: 2 * params.beam_width] for b in beam_search.beams])  # fmt: skip
    return beam_search.result(lambda ids: ",".join(map(str, ids))).sequences


def test_the_search_finds_what_greedy_misses():
    """Greedy takes 1 (0.6) then 0.3 at best; the likeliest two tokens are 2, 5 (0.38)."""
    (best,) = search(BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True))
    assert best.output_token_ids[0] == 1  # one beam is greedy
    two = search(BeamSearchParams(beam_width=2, max_tokens=2))
    assert [b.output_token_ids for b in two][0] == [2, 5] and two[0].text == "2,5"
    assert math.isclose(two[0].cum_logprob, math.log(0.4 * 0.95))
    assert two[0].logprobs == pytest.approx([math.log(0.4), math.log(0.95)])
    assert [b.finish_reason for b in two] == ["length", "length"]


def test_eos_sets_a_beam_aside_and_the_length_penalty_weighs_lengths():
    """A beam that ends in EOS is complete, its EOS not counted in its length; with the
    penalty at 0 the score is the plain sum, so the short complete beam (2, EOS: 0.02) loses
    to nothing longer that is likelier, and a high penalty favours the long ones."""
    table = {**TABLE, (0, 2, 5): {EOS: math.log(0.01), 6: math.log(0.99)}}
    beams = search(BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=0.0), table)
    stopped = [b for b in beams if b.finish_reason == "stop"]
    assert stopped and all(b.tokens[-1] == EOS for b in stopped)
    scores = [b.cum_logprob for b in beams]
    assert scores == sorted(scores, reverse=True)
    long_first = search(BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=10.0), table)
    assert len(long_first[0].tokens) == 4  # prompt + 3: the longest wins under a high penalty
    ignored = search(BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True), table)
    assert all(b.finish_reason == "length" and len(b.output_token_ids) == 3 for b in ignored)


def test_beam_search_params_are_checked():
    cases = [({"beam_width": 0}, ValueError), ({"beam_width": MAX_BEAM_WIDTH + 1}, ValueError),
             ({"beam_width": 2.0}, TypeError), ({"max_tokens": 0}, ValueError),
             ({"length_penalty": math.nan}, ValueError), ({"length_penalty": 11}, ValueError),
             ({"ignore_eos": 1}, TypeError)]  # fmt: skip
    for bad, error in cases:
        with pytest.raises(error):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)


def reference_search(model, prompt: list[int], params: BeamSearchParams, eos: set[int]) -> list:
    """The same search with transformers' full forward over each beam."""
    beam_search = BeamSearch(prompt, params, eos)
    while not beam_search.done:
        options = []
        for beam in beam_search.beams:
            with torch.no_grad():
                logits = model(torch.tensor([beam.tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), -1).topk(2 * params.beam_width)
            options.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        beam_search.advance(options)
    return beam_search.result(lambda ids: "").sequences


def test_the_engine_searches_as_a_full_forward_does(llm, tiny_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    eos = set(llm.get_tokenizer().eos_token_ids)
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]  # the second fills a block
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    outputs = llm.beam_search(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = reference_search(model, prompt, params, eos)
        assert [b.tokens for b in out.sequences] == [b.tokens for b in expected]
        got = [b.cum_logprob for b in out.sequences]
        assert got == pytest.approx([b.cum_logprob for b in expected], abs=1e-4)
        assert all(b.text == llm.get_tokenizer().decode(b.output_token_ids, True)
                   for b in out.sequences)  # fmt: skip
    assert not llm.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.kv_cache_config.num_blocks


def test_one_beam_without_eos_is_greedy(llm):
    (out,) = llm.beam_search("Hello", BeamSearchParams(1, 6, ignore_eos=True), use_tqdm=False)
    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.sequences[0].output_token_ids == greedy.token_ids


def test_beam_search_refuses_bad_input_before_a_step(llm):
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("hi", SamplingParams())
    with pytest.raises(ValueError, match="max_model_len|context|KV cache"):
        llm.beam_search("hi", BeamSearchParams(2, 10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.beam_search([[]], BeamSearchParams(2, 3), use_tqdm=False)
    assert not llm.has_unfinished_requests()


# -- through the server ------------------------------------------------------------------------


@pytest.fixture
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
        yield client
    live_server.wait_until_idle(timeout=2.0)  # every beam's request gone, every block free


def test_use_beam_search_returns_each_prompts_n_best_beams(http, live_server, tiny_dir):
    """vLLM's test_batch_completions: two equal prompts, n=2: four choices, the two beams
    differ and repeat for the second prompt; they are the offline search's."""
    body = {"prompt": ["Beams:", "Beams:"], "n": 2, "max_tokens": 5, "temperature": 0.0,
            "use_beam_search": True, "return_token_ids": True}  # fmt: skip
    choices = http.post("/v1/completions", json=body).json()["choices"]
    texts = [c["text"] for c in choices]
    assert len(texts) == 4 and texts[0] != texts[1] and texts[:2] == texts[2:]
    offline = LLM(str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    prompt = offline.get_tokenizer().encode("Beams:")
    (expected,) = offline.beam_search([prompt], BeamSearchParams(2, 5), use_tqdm=False)
    assert [c["token_ids"] for c in choices[:2]] == [b.output_token_ids for b in expected.sequences]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 4,
            "use_beam_search": True, "length_penalty": 0.5}  # fmt: skip
    replies = http.post("/v1/chat/completions", json=chat).json()["choices"]
    assert [c["index"] for c in replies] == [0, 1, 2]


@pytest.mark.parametrize(
    "extra, words",
    [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
     ({"seed": 1, "top_p": 0.5}, "top_p, seed"), ({"n": MAX_BEAM_WIDTH + 1}, "at most"),
     ({"use_beam_search": False, "length_penalty": 2.0}, "only with use_beam_search"),
     ({"max_tokens": MAX_MODEL_LEN}, "maximum context length"),
     ({"prompt": [10**6]}, "out of vocabulary"), ({"length_penalty": 1e308}, "length_penalty")],
)  # fmt: skip
def test_beam_search_refuses_what_it_has_no_part_for(http, extra, words):
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, **extra}
    error = assert_openai_error(http.post("/v1/completions", json=body), 400)
    assert words in error["message"]
    neutral = {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "top_p": 1.0,
               "top_k": -1, "presence_penalty": 0, "stream": False}  # fmt: skip
    assert http.post("/v1/completions", json=neutral).status_code == 200
