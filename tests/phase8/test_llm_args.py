"""`LLM(...)` takes vLLM's engine arguments: this engine's fields, vLLM's other names for them,
vLLM's arguments that mean nothing here at the value that asks for nothing; anything else is a
clear error. `max_model_len` really caps requests, offline and in the server's engine core, and
the KV cache's log lines use it."""

import itertools
import json
import logging

import pytest

from phase8_serving import LLM, SamplingParams, TextPrompt, TokensPrompt
from phase8_serving.cli import build_parser
from phase8_serving.config import VLLM_UNSUPPORTED, EngineConfig, engine_config
from phase8_serving.engine_core import core_info
from phase8_serving.sampling_params import generation_defaults
from phase8_serving.serve import core_spec

CPU = dict(dtype="float32", device="cpu")
CONTEXT = 128  # conftest.TINY_CONFIG's max_position_embeddings


def test_vllm_engine_arguments_reach_the_config():
    config = engine_config(
        "LLM",
        dict(max_model_len=64, gpu_memory_utilization=0.5, tensor_parallel_size=1,
             enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
             enable_prefix_caching=False, num_gpu_blocks_override=12, trust_remote_code=True,
             quantization=None, disable_log_stats=True),
        (),
    )  # fmt: skip
    assert config == EngineConfig(max_model_len=64, gpu_memory_utilization=0.5,
                                  enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=32,
                                  block_size=8, enable_prefix_caching=False,
                                  num_kv_blocks=12)  # fmt: skip


def test_an_unknown_argument_is_named_with_the_known_ones():
    with pytest.raises(
        TypeError,
        match=r"unknown engine argument 'max_num_seq' \(did you mean "
        r"'max_num_seqs'\?\); the known ones are: .*block_size",
    ):
        LLM(max_num_seq=4, **CPU)  # fmt: skip
    with pytest.raises(TypeError, match=r"'frobnicate'; the known ones are: .*max_model_len.*seed"):
        LLM(frobnicate=1, **CPU)


def test_a_vllm_argument_not_supported_here_is_named():
    for name, (neutral, _) in VLLM_UNSUPPORTED.items():
        for value in neutral if isinstance(neutral, tuple) else (neutral,):
            engine_config("LLM", {name: value}, ())  # what asks for nothing passes
    engine_config("LLM", {"task": "generate", "runner": "auto"}, ())  # LLM(model, task=...)
    with pytest.raises(ValueError, match=r"task='embed' .* only task='auto' or task='generate'"):
        engine_config("LLM", {"task": "embed"}, ())
    with pytest.raises(ValueError, match=r"vLLM's quantization='awq' is not supported here"):
        LLM(quantization="awq", **CPU)
    with pytest.raises(ValueError, match=r"vLLM's swap_space=4 .*preemption_mode='swap'"):
        LLM(swap_space=4, **CPU)
    with pytest.raises(TypeError, match="'num_kv_blocks' twice"):
        LLM(num_kv_blocks=4, num_gpu_blocks_override=4, **CPU)


def test_bad_values_fail_before_the_load(tmp_path):
    missing = tmp_path / "nothing-here"  # never read: the arguments fail first
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        LLM(missing, max_model_len=1, **CPU)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        LLM(missing, seed=-1, **CPU)


def test_max_model_len_caps_requests_and_the_log(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="phase8_serving.kv_cache_config"):
        llm = LLM(tiny_dir, max_model_len=24, num_kv_blocks=16, block_size=8, **CPU)
    assert "Maximum concurrency for 24 tokens per request: 5.33x" in caplog.text
    assert llm.engine.kv_cache_config.max_model_len == core_info(llm.engine).max_model_len == 24
    assert llm.engine.runner.max_blocks == 3  # block tables as wide as max_model_len needs
    prompt = [72, 105] * 10  # 20 tokens
    with pytest.raises(
        ValueError,
        match=r"prompt \(20 tokens\) \+ max_tokens \(5\) exceeds "
        r"max_model_len \(24\)",
    ):
        llm.generate([prompt], SamplingParams(max_tokens=5), use_tqdm=False)  # fmt: skip
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


def test_max_model_len_within_the_context_and_the_kv_cache(tiny_dir):
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(129\) is more than the model's context "
        r"\(max_position_embeddings = 128\)",
    ):
        LLM(tiny_dir, max_model_len=CONTEXT + 1, **CPU)  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(40\) is more than the KV cache holds "
        r"\(32 tokens\)",
    ):
        LLM(tiny_dir, max_model_len=40, num_kv_blocks=4, block_size=8, **CPU)  # fmt: skip
    # unset: the context, cut to what the cache holds
    assert (
        LLM(tiny_dir, num_kv_blocks=4, block_size=8, **CPU).engine.kv_cache_config.max_model_len
        == 32
    )
    assert LLM(tiny_dir, **CPU).engine.kv_cache_config.max_model_len == CONTEXT


def test_the_servers_max_model_len_is_the_engines(tiny_dir):
    """`serve --max-model-len` is the engine's flag: it reaches the core's config, and one past
    the model's context fails before any core is spawned."""
    args = build_parser().parse_args(["serve", str(tiny_dir), "--max-model-len", "24"])
    args.model = str(tiny_dir)
    assert core_spec(args).config.max_model_len == 24
    args = build_parser().parse_args(["serve", str(tiny_dir), "--max-model-len", "129"])
    args.model = str(tiny_dir)
    with pytest.raises(ValueError, match="more than the model's context"):
        core_spec(args)


def test_seed_makes_unseeded_sampling_reproducible(tiny_dir):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def sample(**kwargs) -> list[int]:
        llm = LLM(tiny_dir, **CPU, **kwargs)
        return llm.generate([[72, 105]], params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(seed=3) == sample(seed=3) != sample(seed=4)


def test_chat_takes_vllms_chat_template_and_continue_final_message(tiny_dir):
    """`LLM.chat(..., chat_template=, continue_final_message=)`, vLLM's: a template of one's
    own instead of the checkpoint's, and a reply that goes on with the final message (its turn
    left open)."""
    llm = LLM(tiny_dir, **CPU)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    decode = llm.get_tokenizer().decode
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False,
                      chat_template=template)  # fmt: skip
    assert decode(out.prompt_token_ids) == "[user]Hi"
    begun = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer"}]
    (out,) = llm.chat(begun, greedy, use_tqdm=False, add_generation_prompt=False,
                      continue_final_message=True)  # fmt: skip
    assert decode(out.prompt_token_ids).endswith("<|im_start|>assistant\nThe answer")
    (closed,) = llm.chat(begun, greedy, use_tqdm=False, add_generation_prompt=False)
    assert decode(closed.prompt_token_ids).endswith("The answer<|im_end|>\n")
    tokenizer = llm.get_tokenizer()  # as vLLM users build prompts: HF's tokenize=True is ids
    text = tokenizer.apply_chat_template(begun, add_generation_prompt=False)
    ids = tokenizer.apply_chat_template(begun, add_generation_prompt=False, tokenize=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False) == closed.prompt_token_ids
    with pytest.raises(TypeError, match="chat_template"):
        llm.chat(begun, greedy, chat_template=3)
    with pytest.raises(ValueError, match="exclude each other"):
        llm.chat(begun, greedy, continue_final_message=True)


def test_vllms_prompt_dicts_and_cumulative_logprob(tiny_dir):
    """`{"prompt": text}` and `{"prompt_token_ids": ids}` (vLLM's TextPrompt and TokensPrompt)
    are the text and the ids; `cumulative_logprob` is the sum of every token's logprob so far,
    in a whole output and in each streamed one (None without logprobs)."""
    llm = LLM(tiny_dir, **CPU)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    ids = llm.get_tokenizer().encode("Hi")
    plain = llm.generate(["Hi", ids], greedy, use_tqdm=False)
    as_dicts = [TextPrompt(prompt="Hi"), TokensPrompt(prompt_token_ids=ids)]
    dicts = llm.generate(as_dicts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert (dicts[0].prompt, dicts[1].prompt) == ("Hi", None)
    (single,) = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert single.prompt_token_ids == ids
    whole = plain[0].outputs[0]
    assert whole.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in whole.logprobs))
    llm.add_request({"prompt": "Hi"}, greedy, request_id="streamed")
    steps = [out.outputs[0] for _ in range(64) if llm.has_unfinished_requests()
             for out in llm.step()]  # fmt: skip
    totals = list(itertools.accumulate(lp.logprob for step in steps for lp in step.logprobs))
    assert [s.cumulative_logprob for s in steps] == pytest.approx(totals[: len(steps)])
    unasked = llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert unasked.cumulative_logprob is None
    with pytest.raises(ValueError, match=r"one key.*\['multi_modal_data', 'prompt'\]"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {}}, greedy)
    with pytest.raises(TypeError, match=r"prompts\[0\]\['prompt'\] must be a str"):
        llm.generate([{"prompt": ids}], greedy)
    with pytest.raises(TypeError, match=r"prompt\['prompt_token_ids'\] must be a list"):
        llm.add_request({"prompt_token_ids": "Hi"}, greedy)
    assert not llm.has_unfinished_requests()


def test_the_generation_config_samples_what_a_call_leaves_unset(tiny_dir, tmp_path):
    """generation_config="auto" (vLLM's default): a call without sampling_params samples as the
    checkpoint's generation_config.json recommends; "vllm": SamplingParams(); a directory: its
    file. A bad file fails before the load, naming itself."""
    recommends = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 3, "do_sample": True}
    folder = tmp_path / "recommends"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(recommends))
    assert generation_defaults(tiny_dir) == {}  # transformers wrote it without sampling keys
    assert generation_defaults(folder, "auto") == {"temperature": 0.0, "top_k": 20, "max_tokens": 3}
    llm = LLM(tiny_dir, generation_config=str(folder), **CPU)
    expected = SamplingParams(temperature=0.0, top_k=20, max_tokens=3)
    assert llm.get_default_sampling_params() == expected
    (by_default,) = llm.generate("Hi", use_tqdm=False)
    (explicit,) = llm.generate("Hi", expected, use_tqdm=False)
    assert by_default.outputs[0].token_ids == explicit.outputs[0].token_ids
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) <= 3
    assert LLM(tiny_dir, generation_config="vllm", **CPU).get_default_sampling_params() == (
        SamplingParams())  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(ValueError, match=r"recommends/generation_config.json: .*temperature"):
        LLM(tiny_dir, generation_config=str(folder), **CPU)
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(tiny_dir, generation_config=str(tmp_path), **CPU)
    over = LLM(tiny_dir, generation_config="vllm", override_generation_config={
        "temperature": 0.0, "max_new_tokens": 2}, **CPU)  # fmt: skip
    assert over.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=2)
    assert generation_defaults(folder, "auto", {"temperature": 0.5}) == {"temperature": 0.5}
    with pytest.raises(ValueError, match=r"\['seed'\] are not among"):
        LLM(tiny_dir, override_generation_config={"seed": 1}, **CPU)


def test_vllms_logprob_dicts_and_reset_prefix_cache(tiny_dir):
    """A position's logprobs read as vLLM's `dict[int, Logprob]` (the chosen token first), and
    `reset_prefix_cache` makes the same prompt compute every token again, but only when no
    request holds a block."""
    llm = LLM(tiny_dir, **CPU)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2)
    prompt = [72 + i % 40 for i in range(40)]  # 5 blocks of 8
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    position = first.outputs[0].logprobs[0]
    token = first.outputs[0].token_ids[0]
    assert next(iter(position)) == token and position[token].logprob == position.logprob
    top, _ = position.top_logprobs
    assert position[top[0]].rank == 1 and len(position) == len(dict(position)) >= 2
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    llm.add_request(prompt, params, request_id="holds")
    llm.step()  # its blocks are held now
    assert llm.reset_prefix_cache() is False
    llm.abort_request("holds")
    assert llm.reset_prefix_cache() is True
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == first.outputs[0].token_ids


def test_detokenize_false_and_truncate_prompt_tokens(tiny_dir):
    """vLLM's `detokenize=False`: the same token ids and no text, whole or streamed (stop
    strings, found in the text, need it); `truncate_prompt_tokens`: the prompt's last k tokens."""
    llm = LLM(tiny_dir, **CPU)
    greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = [72 + i for i in range(20)]
    (text,) = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)
    (ids,) = llm.generate([prompt], SamplingParams(**greedy, detokenize=False), use_tqdm=False)
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids.outputs[0].text == ""
    llm.add_request(prompt, SamplingParams(**greedy, detokenize=False), request_id="s")
    steps = [out.outputs[0] for _ in range(20) if llm.has_unfinished_requests()
             for out in llm.step()]  # fmt: skip
    assert [t for s in steps for t in s.token_ids] == ids.outputs[0].token_ids
    assert all(s.text == "" for s in steps)
    with pytest.raises(ValueError, match="stop needs detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    (cut,) = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=3),
                          use_tqdm=False)  # fmt: skip
    (last3,) = llm.generate([prompt[-3:]], SamplingParams(**greedy), use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-3:]
    assert cut.outputs[0].token_ids == last3.outputs[0].token_ids
    (whole,) = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=-1),
                            use_tqdm=False)  # fmt: skip
    assert whole.prompt_token_ids == prompt  # -1: as many as the context holds
    for bad in (0, -2, True):
        with pytest.raises((TypeError, ValueError), match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
