"""BPETokenizer against Hugging Face `tokenizers` (the oracle) on the real Qwen3 tokenizer.json,
plus training on a small corpus, where the oracle is a brute-force pair count and `tokenizers`
reading the file our tokenizer saves."""

import json
import unicodedata
from collections import Counter
from itertools import pairwise

import pytest
import regex
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from phase0_basics import tokenizer as tokenizer_module
from phase0_basics.tokenizer import QWEN_SPLIT_PATTERN, BPETokenizer

# Loading 151k vocab entries and 151k merges; ~1.3 s on the 2-core dev machine.

CORPUS = [
    "Hello, world!",
    "你好世界",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "I'm sure they'll say we've done it; you'd think he's RIGHT, isn'T it?",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "Prices: 1234567890, 3.14159, -42, 1e-9, ١٢٣ (Arabic-Indic), ½ ⅔",
    "Emoji: 😀😃👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "   leading spaces, trailing spaces   ",
    "lines\n\n\nmany newlines\r\nwindows\r\n\ttabs\t\tand\u00a0nbsp\u3000ideographic",
    "日本語のテキストと한국어 텍스트, Ελληνικά, русский текст, עברית, العربية",
    "Café naïve résumé coöperate, and decomposed cafe\u0301",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2=?<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n4<|im_end|><|endoftext|>",
    'mixed: x=你好; y="😀"; z=1_000_000 # comment\n\n    indented<|im_end|>',
    "",
    " ",
    "\n",
    "a",
    "<|im_start|><|im_end|>",
]

TRAIN_CORPUS = [
    "the cat sat on the mat. the dog sat on the log.",
    "low lower lowest newer newest wider widest",
    "hello hello hello world, 你好 你好 世界!",
    "def add(a, b):\n    return a + b\n\n# 123 456 789\n",
] * 3


@pytest.fixture(scope="session")
def qwen3_files(qwen3_tokenizer_dir):
    return qwen3_tokenizer_dir / "tokenizer.json"


@pytest.fixture(scope="session")
def qwen3(qwen3_files):
    # Load time is a benchmark number (benchmarks/tokenizer_speed.py), not a test assertion.
    return BPETokenizer.from_file(qwen3_files)


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_files):
    return tokenizers.Tokenizer.from_file(str(qwen3_files))


@pytest.fixture(scope="session")
def trained():
    return BPETokenizer.train(TRAIN_CORPUS, vocab_size=320, special_tokens=["<|end|>"])


@pytest.mark.parametrize(
    ("text", "ids"),
    [("你好世界", [108386, 99489]), ("Hello, world!", [9707, 11, 1879, 0])],
)
def test_qwen3_known_ids(qwen3, text, ids):
    assert qwen3.encode(text) == ids


def test_qwen3_splits_digits_one_by_one(qwen3):
    assert qwen3.encode("12345") == [qwen3.token_to_id(d) for d in "12345"]


@pytest.mark.parametrize("text", CORPUS)
def test_qwen3_matches_hf(qwen3, hf_qwen3, text):
    ids = qwen3.encode(text)
    assert ids == hf_qwen3.encode(text).ids
    assert qwen3.decode(ids) == hf_qwen3.decode(ids, skip_special_tokens=False)


def test_qwen3_special_tokens(qwen3):
    assert qwen3.token_to_id("<|im_start|>") == 151644
    assert qwen3.token_to_id("<|im_end|>") == 151645
    assert qwen3.token_to_id("<|no such token|>") is None
    assert qwen3.encode("<|im_start|>user")[0] == 151644
    assert qwen3.vocab_size == 151669


# Characters this Python's Unicode tables (14.0 on 3.11) know. `regex` ships newer tables than the
# Rust regex inside `tokenizers`: it calls U+323B0 (CJK Ext. J, Unicode 17) a letter, `tokenizers`
# does not, so on characters newer than either side's tables the two splits honestly differ.
ASSIGNED_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ASSIGNED_TEXT)
def test_qwen3_matches_hf_on_any_text(qwen3, hf_qwen3, text):
    assert qwen3.encode(text) == hf_qwen3.encode(text).ids


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_qwen3_roundtrip(qwen3, text):
    # Qwen3's tokenizer.json NFC-normalizes first, so the roundtrip holds up to NFC.
    assert qwen3.decode(qwen3.encode(text)) == unicodedata.normalize("NFC", text)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 151668), max_size=12))
def test_qwen3_decode_matches_hf_on_any_ids(qwen3, hf_qwen3, ids):
    # Random ids cut UTF-8 sequences anywhere: both must insert U+FFFD the same way.
    assert qwen3.decode(ids) == hf_qwen3.decode(ids, skip_special_tokens=False)


def test_decode_rejects_unknown_id(qwen3):
    with pytest.raises(ValueError, match="unknown token id"):
        qwen3.decode([10**9])


def test_word_cache_overflow_keeps_results(qwen3, monkeypatch):
    text = "a b c d e f g h the cat sat on the mat"
    expected = qwen3.encode(text)
    monkeypatch.setattr(tokenizer_module, "WORD_CACHE_CAPACITY", 3)
    assert qwen3.encode(text) == expected


def test_train_vocab_size(trained):
    assert trained.vocab_size == 320
    assert trained.token_to_id("<|end|>") == 319


def test_train_first_merge_is_most_frequent_pair(trained):
    words = Counter(w.encode() for t in TRAIN_CORPUS for w in regex.findall(QWEN_SPLIT_PATTERN, t))
    pairs = Counter()
    for word, freq in words.items():
        for pair in pairwise(word):
            pairs[pair] += freq
    top = max(pairs.values())
    expected = min(p for p, c in pairs.items() if c == top)  # ties: smallest ids
    assert trained._merge_list[0] == (bytes([expected[0]]), bytes([expected[1]]))


def test_train_tie_break_is_deterministic():
    # " c", "ab" and "cd" each occur once: the pair with the smallest ids, (" ", "c"), wins.
    tok = BPETokenizer.train(["ab cd"], vocab_size=257)
    assert tok._merge_list == [(b" ", b"c")]
    again = BPETokenizer.train(TRAIN_CORPUS, vocab_size=300)
    assert again._merge_list == BPETokenizer.train(TRAIN_CORPUS, vocab_size=300)._merge_list


def test_train_special_tokens_are_atomic(trained):
    end = trained.token_to_id("<|end|>")
    ids = trained.encode("hello<|end|>world<|end|><|end|>")
    assert ids.count(end) == 3
    assert trained.decode(ids[: ids.index(end)]) == "hello"
    # The special token's text is never learned from, so no merge spells part of it.
    assert all(b"<|" not in a + b for a, b in trained._merge_list)


@pytest.mark.parametrize("vocab_size", [0, 255, 256])
def test_train_rejects_too_small_vocab(vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        BPETokenizer.train(TRAIN_CORPUS, vocab_size=vocab_size, special_tokens=["<|end|>"])


def test_train_rejects_duplicate_special_tokens():
    with pytest.raises(ValueError, match="special tokens"):
        BPETokenizer.train(TRAIN_CORPUS, vocab_size=300, special_tokens=["<|x|>", "<|x|>"])


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_trained_roundtrip(trained, text):
    assert trained.decode(trained.encode(text)) == text


def test_trained_saved_file_matches_hf(trained, tmp_path):
    path = tmp_path / "tokenizer.json"
    trained.save(path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    reloaded = BPETokenizer.from_file(tmp_path)
    for text in [*TRAIN_CORPUS, *CORPUS, "the lowest hello<|end|>newest"]:
        assert trained.encode(text) == hf.encode(text).ids == reloaded.encode(text)


def _edited_file(trained, tmp_path, edit):
    path = tmp_path / "tokenizer.json"
    trained.save(path)
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["model"].update(type="WordPiece"), "only BPE"),
        (lambda c: c["model"].update(byte_fallback=True), "byte_fallback"),
        (lambda c: c.update(normalizer={"type": "Lowercase"}), "normalizer"),
        (lambda c: c.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer"),
        (lambda c: c["model"]["vocab"].pop("a"), "byte tokens"),
        (lambda c: c["model"]["merges"].append(["zz", "q"]), "outside the vocab"),
        (lambda c: c["added_tokens"][0].update(lstrip=True), "lstrip"),
    ],
)
def test_from_file_rejects_unsupported(trained, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        BPETokenizer.from_file(_edited_file(trained, tmp_path, edit))


def test_from_file_string_merges_gpt2_regex_ignore_merges(trained, tmp_path):
    def edit(config):
        merges = config["model"]["merges"]
        config["model"]["merges"] = [f"{a} {b}" for a, b in merges]
        config["model"]["ignore_merges"] = True
        config["pre_tokenizer"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
        }

    path = _edited_file(trained, tmp_path, edit)
    tok, hf = BPETokenizer.from_file(path), tokenizers.Tokenizer.from_file(str(path))
    for text in [*TRAIN_CORPUS, "I'm 12345 years old"]:
        assert tok.encode(text) == hf.encode(text).ids


def test_from_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        BPETokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError):
        BPETokenizer.from_file(tmp_path)  # a directory without tokenizer.json
