"""Byte-level BPE: turning text into the integer ids a model reads, and back.

Problem: a model consumes integers from a fixed vocabulary, but text is an open-ended stream of
Unicode. Characters are too many (and unseen ones would be unknown), bytes make sequences long.

Idea (byte-pair encoding, as in GPT-2 and Qwen): start from the 256 byte values, so any text is
representable, then learn merges of frequent adjacent pairs into longer tokens. A regex first
splits text into words (letters, single digits, punctuation, whitespace runs); merges never cross
a word boundary. Encoding replays the merges on each word, lowest rank (earliest learned) first,
exactly like Hugging Face `tokenizers`. Special tokens (`<|im_start|>`) are cut out of the text
before anything else and map to one id each. Think of it as a compression dictionary that is
allowed to grow only by gluing two existing entries together.

Invariants:
- every byte string has an encoding, and `decode(encode(text)) == text` (up to NFC normalization
  when the tokenizer.json asks for it);
- a merge's inputs always precede it in rank, so replaying merges by rank is well defined;
- the tokenizer works on bytes internally; GPT-2's bytes<->unicode table exists only to read the
  printable strings that `tokenizer.json` stores.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import regex

NUM_BYTES = 256
# The GPT-4 (cl100k) split pattern with digits split one at a time, as Qwen2/Qwen3 use it.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# What a ByteLevel pre-tokenizer with use_regex=true splits on (GPT-2).
GPT2_SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Words repeat a lot (" the", " of"); beyond this many cached words we start over, bounding memory.
WORD_CACHE_CAPACITY = 100_000


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes map to themselves, the rest to chars from U+0100 on.

    tokenizer.json stores tokens as strings; this makes every byte a visible, non-space character
    so that merges can be written as "a b" and a space byte reads as 'Ġ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(NUM_BYTES) if b not in table)
    table.update({b: chr(NUM_BYTES + i) for i, b in enumerate(extra)})
    return table


BYTE_TO_UNICODE = bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


class BPETokenizer:
    """Encodes text to token ids and back, with a vocabulary learned by `train` or read from HF."""

    def __init__(
        self,
        vocab: dict[bytes, int],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: dict[str, int] | None = None,
        split_pattern: str = QWEN_SPLIT_PATTERN,
        nfc: bool = False,
        ignore_merges: bool = False,
    ) -> None:
        """`merges` in rank order; `ignore_merges`: a word found whole in the vocab is one token."""
        self._vocab = vocab
        self._merge_list = list(merges)
        self._split_pattern = split_pattern
        self._special_tokens = dict(special_tokens or {})
        self._nfc = nfc
        self._ignore_merges = ignore_merges
        missing = [b for b in range(NUM_BYTES) if bytes([b]) not in vocab]
        if missing:
            raise ValueError(f"vocab lacks byte tokens {missing[:8]}: not a byte-level BPE vocab")
        self._byte_ids = [vocab[bytes([b])] for b in range(NUM_BYTES)]
        self._id_to_bytes = {i: token for token, i in vocab.items()}
        self._id_to_bytes.update({i: s.encode() for s, i in self._special_tokens.items()})
        # (left id, right id) -> (rank, merged id): encoding never touches strings.
        self._merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (left, right) in enumerate(merges):
            if left not in vocab or right not in vocab or left + right not in vocab:
                raise ValueError(f"merge {left!r} + {right!r} uses a token outside the vocab")
            self._merges.setdefault((vocab[left], vocab[right]), (rank, vocab[left + right]))
        if regex.compile(split_pattern).groups:
            raise ValueError(f"split pattern has capture groups: {split_pattern!r}")
        # A capture group makes split() return both words and any text between matches.
        self._split_re = regex.compile(f"({split_pattern})")
        # Longest first, so "<|im_start|>" wins over any special token that is its prefix.
        specials = sorted(self._special_tokens, key=len, reverse=True)
        self._special_re = regex.compile("(" + "|".join(map(regex.escape, specials)) + ")")
        self._cache: dict[str, list[int]] = {}
        self._vocab_size = max(self._id_to_bytes) + 1

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (one past the largest id)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token, or of a vocab entry spelled as (UTF-8) text."""
        if token in self._special_tokens:
            return self._special_tokens[token]
        return self._vocab.get(token.encode())

    def encode(self, text: str) -> list[int]:
        """Text to ids; special tokens in the text are matched verbatim, never split."""
        ids: list[int] = []
        parts = self._special_re.split(text) if self._special_tokens else [text]
        # split() with one capture group alternates: text, special, text, special, ..., text.
        for i, part in enumerate(parts):
            if i % 2 == 1:
                ids.append(self._special_tokens[part])
                continue
            if self._nfc:
                part = unicodedata.normalize("NFC", part)
            for word in self._split_re.split(part):
                if word:
                    ids += self._encode_word(word)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids to text; byte sequences cut mid-character decode to U+FFFD, as in HF."""
        try:
            data = b"".join(self._id_to_bytes[i] for i in ids)
        except KeyError as e:
            raise ValueError(f"unknown token id {e.args[0]}") from None
        return data.decode("utf-8", errors="replace")

    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            if len(self._cache) >= WORD_CACHE_CAPACITY:
                self._cache.clear()
            ids = self._cache[word] = self._bpe(word.encode())
        return ids

    # exercise 0.1: BPE encoding, the merges replayed by rank
    def _bpe(self, data: bytes) -> list[int]:
        if self._ignore_merges and data in self._vocab:
            return [self._vocab[data]]
        ids = [self._byte_ids[b] for b in data]
        merges = self._merges
        while len(ids) > 1:
            pairs = list(pairwise(ids))
            best = min(pairs, key=lambda p: merges.get(p, (math.inf,))[0])
            if best not in merges:
                break
            ids = _merge_pair(ids, best, merges[best][1])
        return ids

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = ()
    ) -> BPETokenizer:
        """Learn merges until the vocab has `vocab_size` ids (fewer if the texts run out of pairs).

        Ids: bytes are 0-255, merges follow in the order learned, special tokens come last.
        Ties between equally frequent pairs go to the pair with the smaller ids (as HF's trainer).
        """
        if len(set(special_tokens)) != len(special_tokens) or "" in special_tokens:
            raise ValueError(f"special tokens must be distinct and non-empty: {special_tokens}")
        num_regular = vocab_size - len(special_tokens)
        if num_regular < NUM_BYTES:
            raise ValueError(
                f"vocab_size={vocab_size} leaves no room for the {NUM_BYTES} byte tokens "
                f"plus {len(special_tokens)} special tokens"
            )
        split_re = regex.compile(QWEN_SPLIT_PATTERN)
        special_re = regex.compile("|".join(map(regex.escape, special_tokens)) or r"(?!)")
        word_freqs: Counter[bytes] = Counter()
        for text in texts:
            for piece in special_re.split(text):  # special tokens are never learned from
                word_freqs.update(w.encode() for w in split_re.findall(piece))
        id_to_bytes = [bytes([b]) for b in range(NUM_BYTES)]
        merges = _learn_merges(word_freqs, id_to_bytes, num_regular)
        vocab = {token: i for i, token in enumerate(id_to_bytes)}
        specials = {s: len(id_to_bytes) + i for i, s in enumerate(special_tokens)}
        return cls(vocab, [(id_to_bytes[a], id_to_bytes[b]) for a, b in merges], specials)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Read a Hugging Face `tokenizer.json` (or a directory holding one) of a byte-level BPE."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        config = json.loads(path.read_text(encoding="utf-8"))
        vocab, merges, ignore_merges = _read_bpe_model(config.get("model") or {})
        return cls(
            vocab,
            merges,
            special_tokens=_read_added_tokens(config.get("added_tokens") or []),
            split_pattern=_read_split_pattern(config.get("pre_tokenizer")),
            nfc=_read_normalizer(config.get("normalizer")),
            ignore_merges=ignore_merges,
        )

    def save(self, path: str | Path) -> None:
        """Write a Hugging Face `tokenizer.json` that `from_file` and HF `tokenizers` both read."""
        byte_level = {"type": "ByteLevel", "use_regex": False}
        byte_level |= {"add_prefix_space": False, "trim_offsets": False}
        split = {
            "type": "Split",
            "pattern": {"Regex": self._split_pattern},
            "behavior": "Isolated",
            "invert": False,
        }
        flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        config = {
            "version": "1.0",
            "added_tokens": [
                {"id": i, "content": s, **flags, "special": True}
                for s, i in self._special_tokens.items()
            ],
            "normalizer": {"type": "NFC"} if self._nfc else None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "ignore_merges": self._ignore_merges,
                "vocab": {_to_text(token): i for token, i in self._vocab.items()},
                "merges": [[_to_text(a), _to_text(b)] for a, b in self._merge_list],
            },
        }
        Path(path).write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")


def _merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of `pair`, left to right."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


# exercise 0.2: BPE training, the merge loop
def _learn_merges(
    word_freqs: Counter[bytes], id_to_bytes: list[bytes], target_size: int
) -> list[tuple[int, int]]:
    """Greedy BPE training; grows `id_to_bytes` in place and returns the merges in rank order.

    Pair counts are kept incrementally: a merge only touches the words that contain the pair, so
    each step costs the size of those words (plus one max over the pair table), not the corpus.
    """
    words = [list(w) for w in word_freqs]  # byte values double as the ids of byte tokens
    freqs = list(word_freqs.values())
    pair_counts: Counter[tuple[int, int]] = Counter()
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for w, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        for pair in pairwise(word):
            pair_counts[pair] += freq
            where[pair].add(w)
    token_ids = {token: i for i, token in enumerate(id_to_bytes)}
    merges = []
    while len(id_to_bytes) < target_size and pair_counts:
        best = max(pair_counts, key=lambda p: (pair_counts[p], -p[0], -p[1]))
        # Two merges can spell the same bytes ("ab"+"c", "a"+"bc"); they share one id.
        merged = id_to_bytes[best[0]] + id_to_bytes[best[1]]
        if merged not in token_ids:
            token_ids[merged] = len(id_to_bytes)
            id_to_bytes.append(merged)
        merges.append(best)
        for w in where.pop(best):
            old, new = words[w], _merge_pair(words[w], best, token_ids[merged])
            for pair in pairwise(old):
                pair_counts[pair] -= freqs[w]
            for pair in pairwise(new):
                pair_counts[pair] += freqs[w]
                where[pair].add(w)
            words[w] = new
        for pair in [p for p, c in pair_counts.items() if c <= 0]:
            del pair_counts[pair]
    return merges


def _read_bpe_model(model: dict) -> tuple[dict[bytes, int], list[tuple[bytes, bytes]], bool]:
    if model.get("type") != "BPE":
        raise ValueError(f"unsupported tokenizer model {model.get('type')!r}: only BPE is")
    for option in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise ValueError(f"unsupported BPE option {option}={model[option]!r}")
    if model.get("byte_fallback"):
        raise ValueError("byte_fallback BPE (SentencePiece style) is not byte-level BPE")
    vocab = {_to_bytes(token): i for token, i in model["vocab"].items()}
    # Older files write a merge as "a b", newer ones as ["a", "b"].
    pairs = (m.split(" ") if isinstance(m, str) else m for m in model["merges"])
    merges = [(_to_bytes(left), _to_bytes(right)) for left, right in pairs]
    return vocab, merges, bool(model.get("ignore_merges"))


def _to_bytes(token: str) -> bytes:
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in token)
    except KeyError as e:
        raise ValueError(f"token {token!r} is not in GPT-2 byte-level form") from e


def _to_text(token: bytes) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def _read_added_tokens(added_tokens: list[dict]) -> dict[str, int]:
    for token in added_tokens:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            raise ValueError(
                f"added token {token['content']!r}: lstrip/rstrip/single_word unsupported"
            )
    return {token["content"]: token["id"] for token in added_tokens}


def _read_split_pattern(pre_tokenizer: dict | None) -> str:
    """The word-split regex: a Split step followed by ByteLevel, or ByteLevel's own GPT-2 regex."""
    steps = [] if pre_tokenizer is None else [pre_tokenizer]
    if pre_tokenizer and pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer["pretokenizers"]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        split, byte_level = {"pattern": {"Regex": GPT2_SPLIT_PATTERN}}, steps[0]
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split, byte_level = steps
    else:
        raise ValueError(f"unsupported pre_tokenizer steps {kinds}: want [Split, ByteLevel]")
    if byte_level.get("add_prefix_space"):
        raise ValueError("ByteLevel add_prefix_space=true is unsupported")
    if split.get("behavior", "Isolated") != "Isolated" or split.get("invert"):
        raise ValueError(f"unsupported Split behavior {split.get('behavior')!r}")
    pattern = split["pattern"]
    return pattern["Regex"] if "Regex" in pattern else regex.escape(pattern["String"])


def _read_normalizer(normalizer: dict | None) -> bool:
    """True when the text must be NFC-normalized first; nothing else is supported."""
    if normalizer is None or normalizer == {"type": "Sequence", "normalizers": []}:
        return False
    if normalizer.get("type") == "NFC":
        return True
    raise ValueError(f"unsupported normalizer {normalizer.get('type')!r}: only NFC is")
