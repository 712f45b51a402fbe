"""A checkpoint's own tokenizer, chat template, EOS ids, and streaming detokenization.

Problem: a real model only understands the exact token ids, special tokens and conversation
format it was trained with; its `tokenizer.json` (BPE vocabulary, merges, pre-tokenizer rules),
`tokenizer_config.json` (special tokens, Jinja chat template) and `generation_config.json` (which
ids end a reply) define them. Streaming text out token by token has its own trap: one character
(a Chinese character, an emoji) can span several byte-level tokens, and decoding half of it gives
U+FFFD.
Idea:
- encode/decode with Hugging Face `tokenizers` (Rust). Phase 0 built BPE from scratch; real
  checkpoints need fidelity to every pre-tokenizer (SmolLM2 splits digits, phase 0's reader
  refuses that) and speed: on Qwen3's 151k vocabulary, measured on this project's 2-core CPU,
  phase 0 loads in 1.8 s and encodes unseen text at ~3k tokens/s; `tokenizers` takes 0.7 s and
  ~290k tokens/s, with identical ids;
- render the chat template with the same sandboxed Jinja environment transformers uses, so the
  prompt text is byte-identical to `apply_chat_template(..., tokenize=False)`; `check_conversations`
  refuses malformed messages first, with their position, instead of a Jinja traceback;
- detokenize incrementally with vLLM's two offsets: decode a short window of recent tokens and
  emit only what it adds, holding back while the window ends in U+FFFD (an unfinished character).

Invariants:
- `eos_token_ids` is the union of generation_config.json's, config.json's and the tokenizer's EOS;
- the deltas of an `IncrementalDetokenizer`, concatenated (and flushed), equal `decode` of all its
  tokens; for valid UTF-8 text no delta contains a U+FFFD.
"""

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence produces
# Tokens of context decoded before the new ones (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET):
# some decoders (SentencePiece's leading space) need the previous token to render the next.
DETOKENIZE_CONTEXT_TOKENS = 5
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # first found wins


class Tokenizer:
    """Text <-> ids for one checkpoint, plus its chat template and EOS ids."""

    def __init__(
        self,
        backend: RustTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: frozenset[int],
    ):
        self.backend = backend
        self.special_tokens = special_tokens  # e.g. {"eos_token": "<|im_end|>"}
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint has no fast tokenizer")
        backend = RustTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k)}
        eos = _eos_token_ids(model_dir, backend, special.get("eos_token"))
        return cls(backend, special, _chat_template(model_dir, config), eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens` adds what the tokenizer's post-processor adds (Llama 3: BOS);
        a rendered chat template already holds its special tokens, so encode it with False."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for several texts, in parallel; unlike `encode` it lets go of the GIL while it
        works, so a server's event loop goes on while a huge prompt is tokenized in a thread."""
        encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The prompt text for a conversation, as transformers renders it with `tokenize=False`
        (this method's default); with `tokenize=True` its token ids (the template holds the
        special tokens: none are added), as `LLM.get_tokenizer()` users write for vLLM's.

        `continue_final_message` (transformers' rule): the text ends where the final message's
        content does, without the end of its turn, so the model goes on writing it (a reply
        begun by the caller). Extra keyword arguments reach the template, e.g. Qwen3's
        `enable_thinking=False`.
        """
        if self.chat_template is None:
            raise ValueError("this checkpoint's tokenizer_config.json has no chat_template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        chat = [_normalize_message(m) for m in messages]
        text = _compile_template(self.chat_template).render(
            messages=chat,
            tools=tools,  # JSON schemas, as in the OpenAI API
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **template_kwargs},
        )
        if continue_final_message:
            text = _up_to_final_content(text, chat[-1].get("content") or "")
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _up_to_final_content(text: str, final: str) -> str:
    for ending in (final, final.strip()):  # templates may strip the content
        if ending and ending in text:
            return text[: text.rindex(ending) + len(ending)]
    raise ValueError("continue_final_message: the final message's content is not in the text")


def check_conversations(messages: object) -> list[list[dict[str, Any]]]:
    """`chat`'s messages as a list of conversations, each checked before any template runs:
    a non-empty list of {"role": str, "content": str} dicts (transformers also refuses an empty
    conversation). One conversation or a list of them, told apart by the first item."""
    if not isinstance(messages, list | tuple):
        raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    single = not messages or isinstance(messages[0], dict)
    conversations = [messages] if single else list(messages)
    for i, conversation in enumerate(conversations):
        where = "messages" if single else f"messages[{i}]"
        if not isinstance(conversation, list | tuple):
            kind = type(conversation).__name__
            raise TypeError(f"{where} must be a list of message dicts, got {kind}")
        if not conversation:
            raise ValueError(f"{where} is an empty conversation")
        for j, message in enumerate(conversation):
            check_message(f"{where}[{j}]", message)
    return conversations


def check_message(where: str, message: object) -> None:
    if not isinstance(message, dict):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {message!r}")
    if not isinstance(message.get("role"), str):
        raise TypeError(f"{where}['role'] must be a str, got {message.get('role')!r}")
    content = message.get("content")
    # OpenAI clients send content None beside tool calls; the template renders those.
    if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
        raise TypeError(f"{where}['content'] must be a str, got {content!r}")


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """What transformers does to a message before rendering, so both render the same prompt."""
    # None-valued keys are dropped (OpenAI clients send content=None beside tool calls).
    message = {key: value for key, value in message.items() if value is not None}
    # Reasoning arrives under several names; templates read reasoning_content (gpt-oss: thinking).
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token: str | dict) -> str:
    return token["content"] if isinstance(token, dict) else token  # older files store AddedToken


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """transformers >= 4.43 may save the template beside the config as chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return template


def _eos_token_ids(model_dir: Path, backend: RustTokenizer, eos_token: str | None) -> frozenset:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else value or [])
    if eos_token is not None and backend.token_to_id(eos_token) is not None:
        ids.add(backend.token_to_id(eos_token))
    return frozenset(ids)


@functools.lru_cache(maxsize=8)  # one template per loaded checkpoint; compiling costs ~ms
def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers builds (chat_template_utils): same options, same globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template as `apply_chat_template` renders it; a syntax error raises here."""
    return _compile_template(source)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML (<, >, &), which would change the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas (vLLM's offset algorithm).

    `read_offset`: tokens before it are already emitted as text. `prefix_offset`: where the decoded
    window starts, a few tokens earlier, so the new tokens decode in context. Each step costs a
    decode of the window only, not of the whole output.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens=True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    # exercise 6.2: incremental detokenization
    def add_tokens(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete ("" while a character is split)."""
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or the last character is still incomplete
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit what was held back, even an undecodable tail."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = self._decode(self.token_ids[self.prefix_offset :])[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string found
    index: int  # where it starts in the text: the output is truncated there


def find_stop_string(text: str, stops: Sequence[str], num_new_chars: int) -> StopMatch | None:
    """The earliest stop string that ends inside the last `num_new_chars` characters of `text`.

    Only a match touching the new characters can be new; earlier ones were checked last step.
    """
    best: StopMatch | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best.index):
            best = StopMatch(stop, index)
    return best
