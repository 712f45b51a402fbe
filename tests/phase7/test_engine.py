"""Phase 7 engine: `LLM(checkpoint)` says exactly what transformers says, as tokens and as text.

Oracles: transformers' `generate(do_sample=False)` on the same directory (float32, CPU) for token
ids; `apply_chat_template(tokenize=True)` for chat prompts; the tokenizer's one-shot `decode` for
the streamed text. Greedy agreement is only meaningful where the oracle's top-1/top-2 logit margin
beats float32 noise, so every oracle path is certified with `assert_greedy_matches` (teacher-forced
through our model, margin > 2 * ATOL) before any engine output is compared with it.
Engines are driven step by step so `scheduler.check_invariants()` runs after every step.
"""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from phase7_optim import LLM, CheckpointError, SamplingParams, StepTrace
from phase7_optim.loader import load_model

from .conftest import QWEN3_VOCAB_SIZE, TINY_QWEN3, assert_greedy_matches

ATOL = 1e-4  # tiny Qwen3, float32 (as in test_model.py)
SMOLLM2_ATOL = 5e-4  # 30 float32 layers (as in test_default_model.py)
MAX_TOKENS = 10
CONTEXT = TINY_QWEN3["max_position_embeddings"]
_rng = random.Random(0)
TEXT_PROMPTS = [
    "Hello, world!",
    "你好世界",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
ID_PROMPTS = [[_rng.randrange(QWEN3_VOCAB_SIZE) for _ in range(n)] for n in (1, 33, 70)]
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
SMOLLM2_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def run(llm: LLM, prompts, params):
    """LLM.generate's loop, checking the scheduler's invariants after every step.

    Returns the final outputs in prompt order and, per request, the text after each step.
    """
    params = params if isinstance(params, list) else [params] * len(prompts)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done, texts = {}, {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.block_manager.num_used_blocks == 0, "finished requests hold no blocks"
    return [done[i] for i in ids], [texts[i] for i in ids]


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    outs = []
    for prompt in prompts:
        with torch.inference_mode():
            seq = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False
            )
        outs.append(seq[0, len(prompt) :].tolist())
    return outs


def certify(model, prompts, continuations, atol) -> None:
    """Our model's teacher-forced argmax follows the oracle with a margin above the noise."""
    for prompt, cont in zip(prompts, continuations, strict=True):
        assert_greedy_matches(model, torch.tensor([prompt + cont]), len(prompt), atol)


# --- greedy tokens equal transformers' generate, tiny Qwen3 -----------------------------------


@pytest.fixture(scope="module")
def tiny_prompts(tiny_qwen3_tied_dir) -> list[list[int]]:
    from phase7_optim import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_qwen3_tied_dir)
    return [tokenizer.encode(p) for p in TEXT_PROMPTS] + ID_PROMPTS


def transformers_oracle(directory, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    certify(load_model(directory).model, prompts, expected, ATOL)
    return expected


@pytest.fixture(scope="module")
def tied_oracle(tiny_qwen3_tied_dir, tiny_prompts) -> list[list[int]]:
    return transformers_oracle(tiny_qwen3_tied_dir, tiny_prompts)


def longest_request(prompts) -> int:
    return max(len(p) for p in prompts) + MAX_TOKENS


ENGINE_CONFIGS = {
    "default": lambda prompts: {},
    "tiny_chunks": lambda prompts: {"max_num_batched_tokens": 5},  # every prefill is chunked
    "block_size_1": lambda prompts: {"block_size": 1},
    "block_size_7": lambda prompts: {"block_size": 7, "max_num_batched_tokens": 16},
    "no_prefix_caching": lambda prompts: {"enable_prefix_caching": False},
    # Blocks for the longest request and 3 more: several are admitted, then the newest are
    # preempted and recomputed (with room for the longest alone, admission's watermark would
    # run them one at a time, never preempting).
    "heavy_preemption": lambda prompts: {
        "block_size": 4,
        "num_kv_blocks": -(-longest_request(prompts) // 4) + 3,
    },
}


@pytest.mark.slow  # phase 6's suite again: test_cross_phase.py pins phase 7 to phase 6's tokens
@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_greedy_batch_equals_transformers(name, tiny_qwen3_tied_dir, tiny_prompts, tied_oracle):
    # Submitted together, twice: the second copies hit the prefix cache the first ones filled.
    trace = StepTrace()
    config = ENGINE_CONFIGS[name](tiny_prompts)
    llm = LLM(tiny_qwen3_tied_dir, dtype="float32", trace=trace, **config)
    outputs, _ = run(llm, tiny_prompts * 2, greedy())
    assert token_ids(outputs) == tied_oracle * 2
    if name == "heavy_preemption":
        assert any(step.preempted for step in trace.steps), "the test must preempt"
    if name == "tiny_chunks":
        assert max(sum(s.prefill.values()) for s in trace.steps) <= 5


@pytest.mark.slow
def test_untied_lm_head_greedy_equals_transformers(tiny_qwen3_untied_dir, tiny_prompts):
    expected = transformers_oracle(tiny_qwen3_untied_dir, tiny_prompts)
    outputs, _ = run(LLM(tiny_qwen3_untied_dir, dtype="float32"), tiny_prompts, greedy())
    assert token_ids(outputs) == expected


# --- greedy tokens equal transformers' generate, SmolLM2 --------------------------------------


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, dtype="float32", num_kv_blocks=64)  # 1,024 slots: plenty here


@pytest.mark.slow  # 30 float32 layers of SmolLM2, and transformers beside it
def test_smollm2_greedy_equals_transformers(smollm2_llm, smollm2_hf):
    tokenizer = smollm2_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in SMOLLM2_PROMPTS]
    expected = hf_greedy(smollm2_hf, prompts, SMOLLM2_TOKENS)
    # Real text has close calls; each position's margin must beat 30 layers of float32 drift.
    certify(smollm2_llm.engine.model, prompts, expected, SMOLLM2_ATOL)
    outputs, _ = run(smollm2_llm, prompts, greedy(SMOLLM2_TOKENS))
    assert token_ids(outputs) == expected


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2_llm, smollm2_dir):
    from transformers import AutoTokenizer

    out = smollm2_llm.chat(QUESTION, greedy(32), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text, completion.text
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in smollm2_llm.engine.eos_token_ids  # generation_config's
    rendered = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert out.prompt_token_ids == rendered


@pytest.mark.slow
def test_smollm2_stop_string_ignore_eos_and_special_tokens(smollm2_llm):
    reply = smollm2_llm.chat(QUESTION, greedy(32), use_tqdm=False)[0].outputs[0]
    stopped = smollm2_llm.chat(QUESTION, greedy(32, stop=["Paris"]), use_tqdm=False)[0]
    assert stopped.outputs[0].text == reply.text[: reply.text.index("Paris")]
    assert stopped.outputs[0].finish_reason == "stop"
    # Past EOS: the same tokens up to it, then more; the special token shows only when asked.
    n = len(reply.token_ids) + 2
    params = dict(max_tokens=n, ignore_eos=True)
    hidden, shown = smollm2_llm.chat(
        [QUESTION, QUESTION],
        [greedy(**params), greedy(**params, skip_special_tokens=False)],
        use_tqdm=False,
    )
    for out in (hidden, shown):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids[: len(reply.token_ids)] == reply.token_ids
    assert "<|im_end|>" not in hidden.outputs[0].text
    assert hidden.outputs[0].text.startswith(reply.text)
    assert shown.outputs[0].text.startswith(reply.text + "<|im_end|>")


# --- text: stop strings, stop tokens, max_tokens, detokenization (tiny Qwen3) ------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_qwen3_tied_dir) -> LLM:
    return LLM(tiny_qwen3_tied_dir, dtype="float32")


@pytest.fixture(scope="module")
def long_reply(tiny_llm):
    """A 24-token greedy reply to a fixed prompt, and the per-token texts."""
    out = run(tiny_llm, ["Tell me a story."], greedy(24))[0][0].outputs[0]
    tokenizer = tiny_llm.get_tokenizer()
    assert out.finish_reason == "length"
    return out, [tokenizer.decode([t]) for t in out.token_ids]


def test_max_tokens_finishes_with_length_and_text_is_decode(tiny_llm, long_reply):
    out, _ = long_reply
    assert len(out.token_ids) == 24
    tokenizer = tiny_llm.get_tokenizer()
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_the_text_before_it(tiny_llm, long_reply):
    full, pieces = long_reply
    k = next(i for i in range(8, 24) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1]) >= 2)
    # One stop inside a token, one spanning two tokens (it completes only with the second).
    inside, across = pieces[k].strip()[:2], pieces[k][-1] + pieces[k + 1][:1]
    for stop in (inside, across):
        cut = full.text.index(stop)
        out = run(tiny_llm, ["Tell me a story."], greedy(24, stop=[stop, "never-appears"]))[0][0]
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and len(completion.token_ids) < 24
        assert completion.text == full.text[:cut]
        assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
        assert stop in tiny_llm.get_tokenizer().decode(completion.token_ids)


def test_earliest_stop_string_wins(tiny_llm, long_reply):
    full, pieces = long_reply
    late, early = pieces[20].strip()[:1] or pieces[20], pieces[3].strip()[:1] or pieces[3]
    out = run(tiny_llm, ["Tell me a story."], greedy(24, stop=[late, early]))[0][0].outputs[0]
    assert out.text == full.text[: min(full.text.index(late), full.text.index(early))]


def test_stop_token_ids_end_the_request(tiny_llm, long_reply):
    full, _ = long_reply
    stop_id = full.token_ids[6]
    k = full.token_ids.index(stop_id)  # its first appearance ends the request
    out = run(tiny_llm, ["Tell me a story."], greedy(24, stop_token_ids=[stop_id]))[0][0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids == full.token_ids[: k + 1]  # the stop token is returned...
    tokenizer = tiny_llm.get_tokenizer()
    assert completion.text == tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)


def test_streamed_text_grows_and_equals_decode(tiny_llm, tiny_prompts):
    outputs, texts = run(tiny_llm, tiny_prompts, greedy(MAX_TOKENS))
    tokenizer = tiny_llm.get_tokenizer()
    for out, steps in zip(outputs, texts, strict=True):
        assert all(b.startswith(a) for a, b in zip(steps, steps[1:], strict=False))
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, True)


def test_streamed_text_never_changes_when_a_stop_string_straddles_tokens(tiny_llm, long_reply):
    """A stop string that begins in one token and ends in the next: the step that emits the first
    token must hold its tail back (len(stop) - 1 characters), or the cut would take back text
    already shown."""
    full, pieces = long_reply
    k = next(i for i in range(4, 23) if pieces[i] and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-1] + pieces[k + 1].strip()[:2]  # ends inside token k + 1
    assert stop not in full.text[: full.text.index(stop) + len(stop) - 1]
    outputs, texts = run(tiny_llm, ["Tell me a story."], greedy(24, stop=stop))
    (steps,) = texts
    final = outputs[0].outputs[0]
    assert final.finish_reason == "stop" and final.text == full.text[: full.text.index(stop)]
    assert all(final.text.startswith(text) for text in steps), "streamed text was taken back"
    for text, num_tokens in zip(steps[:-1], range(1, len(steps)), strict=True):
        shown = tiny_llm.get_tokenizer().decode(full.token_ids[:num_tokens], True)
        assert text == shown[: len(shown) - (len(stop) - 1)]  # exactly vLLM's hold-back


# A bigram "script": each token's embedding is a unit vector that the untied LM head maps to the
# next token, and every layer adds nothing (o_proj and down_proj are zero). The model then recites
# a fixed cycle of byte tokens: characters of 2, 3 and 4 UTF-8 bytes, one token per byte, so
# every character is split across tokens. No byte repeats, so each token has one successor.
SCRIPT_TEXT = "é中😀жあ"
SCRIPT_PROMPT = "你好"  # one token; it starts the cycle


def _byte_token_ids(tokenizer) -> list[int]:
    """GPT-2's byte-to-unicode table: byte-level BPE spells byte b as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [tokenizer.backend.token_to_id(chars[b]) for b in SCRIPT_TEXT.encode()]


@pytest.fixture(scope="module")
def scripted_qwen3_dir(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from phase7_optim import Tokenizer

    directory = tmp_path_factory.mktemp("qwen3-scripted")
    tokenizer = Tokenizer.from_dir(qwen3_tokenizer_dir)
    (start,) = tokenizer.encode(SCRIPT_PROMPT)
    cycle = _byte_token_ids(tokenizer)
    chain = [start, *cycle, cycle[0]]
    config = Qwen3Config(vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=False, **TINY_QWEN3)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    basis = torch.eye(config.hidden_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, successor) in enumerate(zip(chain, chain[1:], strict=False)):
            model.model.embed_tokens.weight[token] = basis[i]
            model.lm_head.weight[successor] += basis[i]  # cycle[0] follows two tokens
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / name, directory / name)
    return directory


@pytest.mark.slow
def test_streamed_text_never_splits_a_character(scripted_qwen3_dir):
    llm = LLM(scripted_qwen3_dir, dtype="float32")
    tokenizer = llm.get_tokenizer()
    # Twice round the script, then "é" and the first byte of "中": the request ends mid-character,
    # and only the final flush may show that byte (as U+FFFD, exactly like one-shot decode).
    num_tokens = 2 * len(SCRIPT_TEXT.encode()) + 3
    outputs, texts = run(llm, [SCRIPT_PROMPT], greedy(num_tokens))
    (steps,) = texts
    final = outputs[0].outputs[0]
    assert final.text == tokenizer.decode(final.token_ids) == SCRIPT_TEXT * 2 + "é\ufffd"
    streamed = steps[:-1]
    assert all(b.startswith(a) for a, b in zip(steps, steps[1:], strict=False))
    assert all("\ufffd" not in text for text in streamed)
    assert streamed[-1] == SCRIPT_TEXT * 2 + "é"
    assert len(set(streamed)) < len(streamed), "some steps must hold back a partial character"


@pytest.mark.slow
def test_a_stop_token_inside_a_character_keeps_the_text_before_it(scripted_qwen3_dir):
    """The script's fourth token is the second byte of "中": as a stop token it ends the reply
    after "é" and the first byte of "中". The text is "é" whether it is streamed or decoded once
    at the end (generate, no stop strings), where the split character held the whole text back
    and a stop token's finish never flushed it: the reply's text was lost."""
    llm = LLM(scripted_qwen3_dir, dtype="float32")
    script = llm.generate([SCRIPT_PROMPT], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_tokenizer().decode(script) == "é\ufffd"  # and 中's first two bytes
    params = greedy(20, stop_token_ids=[script[3]])
    final = llm.generate([SCRIPT_PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert (final.text, final.token_ids, final.finish_reason) == ("é", script, "stop")
    outputs, (steps,) = run(llm, [SCRIPT_PROMPT], params)
    assert outputs[0].outputs[0].text == steps[-1] == "é"


# --- bad input ----------------------------------------------------------------------------


def test_bad_prompts_are_value_errors(tiny_llm):
    with pytest.raises(ValueError, match="at least one token"):
        tiny_llm.generate([""], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        tiny_llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        tiny_llm.generate(["Hello"], greedy(CONTEXT), use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 151936\)"):
        tiny_llm.generate([[QWEN3_VOCAB_SIZE]], greedy(), use_tqdm=False)


@pytest.mark.slow
def test_bad_request_among_good_ones_leaves_the_engine_usable(tiny_llm):
    good = ["Hello, world!", "你好世界"]
    expected = token_ids(run(tiny_llm, good, greedy())[0])
    with pytest.raises(ValueError, match="at least one token"):
        tiny_llm.generate([good[0], "", good[1]], greedy(), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()  # nothing half-submitted
    # Engine level: a refused request between two accepted ones.
    engine = tiny_llm.engine
    first = engine.add_request(good[0], greedy())
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.add_request("x" * 10, greedy(CONTEXT))
    second = engine.add_request(good[1], greedy())
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        engine.scheduler.check_invariants()
    assert [done[first], done[second]] == expected


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        LLM(tmp_path / "nowhere")


def test_unsupported_architecture_and_broken_weights(tmp_path, tiny_qwen3_tied_dir):
    checkpoint = shutil.copytree(tiny_qwen3_tied_dir, tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    moe = config | {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}
    (checkpoint / "config.json").write_text(json.dumps(moe))
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM is not supported"):
        LLM(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.2\."):
        LLM(checkpoint)


def test_bad_engine_settings_fail_before_loading(tmp_path):
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        LLM(tmp_path / "never-read", block_size=0)


# --- prefix caching through the chat template ----------------------------------------------

SYSTEM_PROMPT = (
    "You are a careful assistant for a museum of natural history. Answer visitors' questions "
    "about the exhibits briefly and accurately; when you do not know, say so, and suggest which "
    "hall or guide could help. Opening hours are nine to five, every day but Monday. "
) * 2
QUESTIONS = [
    "Where are the dinosaurs?",
    "Is there a café?",
    "When do you open?",
    "Can I take photos?",
    "Where is the meteorite?",
    "Do you have audio guides?",
]


@pytest.mark.slow
def test_shared_system_prompt_hits_the_prefix_cache(tiny_qwen3_tied_dir):
    chats = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
             for q in QUESTIONS]  # fmt: skip
    results = {}
    for caching in (True, False):
        trace = StepTrace()
        llm = LLM(tiny_qwen3_tied_dir, dtype="float32", enable_prefix_caching=caching, trace=trace)
        outputs = llm.chat(chats, greedy(), use_tqdm=False)
        results[caching] = (outputs, llm.engine.block_manager, trace)
    (cached, manager, trace), (uncached, plain, _) = results[True], results[False]
    assert token_ids(cached) == token_ids(uncached)
    assert plain.num_hit_tokens == 0
    # Requests admitted in the first step find an empty cache; every later one reuses all the
    # full blocks of the prefix the chats share (system prompt and template).
    prompts = [out.prompt_token_ids for out in cached]
    shared = next(i for i, ts in enumerate(zip(*prompts, strict=False)) if len(set(ts)) > 1)
    full_blocks = shared // manager.block_size * manager.block_size
    num_late = len(QUESTIONS) - len(trace.steps[0].admitted)
    assert full_blocks > 0 and num_late > 0
    assert manager.num_hit_tokens >= num_late * full_blocks
