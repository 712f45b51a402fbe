"""Sampling parameters: what a request asks the sampler for, checked where the request is made.

Problem: a request's settings travel through the engine and meet other requests' in one batch. A
bad value found there (NaN as a temperature, True as a token count, a seed past 64 bits, a token
id past the vocabulary) fails a whole step shared with good requests, or samples garbage.
Idea: `SamplingParams` is frozen and checks every field in `__post_init__`, with its type and
range and an error naming the field, so a `SamplingParams` that exists is valid, and a bad request
fails where it is made, never inside a later batch. Until phase 7 it lives in sampling.py; phase 8
gives it its own file, as vLLM does (`vllm/sampling_params.py`): the server's protocol, the engine
and the output processor need the parameters, only the model runner needs the sampler.

Invariant: a bool is not a token count, 2.5 is not one either, NaN is not a temperature, a seed
fits in 64 bits, and `check_token_ids` holds the ids a request names to the model's vocabulary.

Fields (vLLM's names and meanings): temperature, top_k, top_p and min_p (sampling.py applies
them), max_tokens, seed, ignore_eos, stop_token_ids and stop strings (include_stop_str_in_output),
skip_special_tokens, presence/frequency/repetition penalties, logprobs and prompt_logprobs
(logprobs.py), min_tokens, logit_bias, allowed_token_ids, bad_words (words the reply may not
complete: the engine bans a word's last token where its others end the output) and
structured_outputs (the reply must be JSON, or one of given strings: structured_output.py), and
n (completions of one prompt, run by `LLM` as n requests, vLLM's parallel sampling; the engine
takes one at a time), detokenize (False: token ids without text) and truncate_prompt_tokens
(the prompt's last k tokens).
"""

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .structured_output import compile_spec

# The smallest positive temperature: 1/T multiplies the logits, and float32 overflows to inf (then
# softmax gives NaN) once T nears 1e-38. 1e-5 keeps that far away for any logit below 1e33, and is
# the threshold below which vLLM (_SAMPLING_EPS) treats a temperature as greedy. Use 0 for greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)
MAX_LOGPROBS = 20  # the most alternatives a request may ask for (the OpenAI API's limit)
MAX_ABS_PENALTY = 2.0  # presence/frequency penalties live in [-2, 2] (the OpenAI API's range)
# Beyond these, a penalized logit overflows float32 and softmax gives NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_ABS_LOGIT_BIAS = 100.0  # the OpenAI API's range for logit_bias values
# bad_words are checked on the host for every row, every step: a list of thousands would slow
# each step of everyone's batch
MAX_BAD_WORDS = 1024
PROMPT_LOGPROBS_NEED_ONE_RANK = (
    "prompt_logprobs (and echo with logprobs) need tensor_parallel_size 1: only rank 0 scores"
)
TOP_K_OFF = (-1, 0)  # vLLM's spellings of "no top-k filter"; stored as None


def _check_int(name: str, value: object, minimum: int) -> None:
    """Raises unless `value` is an int (not a bool: True is not a token count) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"SamplingParams.{name} must be >= {minimum}, got {value}")


def _check_real(name: str, value: object) -> None:
    """Raises unless `value` is a finite int or float (not a bool, not NaN, not inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value}")


@functools.lru_cache(maxsize=256)
def _check_spec(kind: str, canonical: str) -> None:
    """Compiles a spec once per distinct spec (n choices, the core's copy): SchemaError if bad."""
    compile_spec(kind, json.loads(canonical))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's: what the reply must be, exactly one of: `json`, a JSON schema (a dict, or its JSON
    text); `json_object=True`, any JSON object; `choice`, one of these strings; `regex`, a
    regular expression the whole reply matches; `grammar`, a context-free grammar (GBNF's
    `root ::= ...` or Lark's `start: ...`) the reply is a sentence of. `reasoning` (a reasoning
    parser: "qwen3", "deepseek_r1"; the server sets it on chats under --reasoning-parser): the
    reply's thoughts, up to `</think>`, stay free, and the grammar applies to the answer after
    them."""

    json: Any = None
    choice: tuple[str, ...] | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    reasoning: str | None = None

    def __post_init__(self):
        kinds = ("json", "choice", "json_object", "regex", "grammar")
        given = [n for n in kinds if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, choice, json_object, regex, "
                f"grammar, got {given or 'none'}"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"StructuredOutputsParams.json_object must be true, got {self.json_object!r}"
            )
        if self.reasoning not in (None, "qwen3", "deepseek_r1"):
            raise ValueError(
                "StructuredOutputsParams.reasoning must be qwen3 or deepseek_r1, "
                f"got {self.reasoning!r}"
            )
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: '[' x 10^5
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        _check_spec(self.kind, json.dumps(self.spec, sort_keys=True))

    @property
    def kind(self) -> str:
        kinds = ("json", "choice", "regex", "grammar")
        return next((k for k in kinds if getattr(self, k) is not None), "json_object")

    @property
    def spec(self) -> Any:
        specs = {"json": self.json, "choice": list(self.choice or ()), "json_object": True,
                 "regex": self.regex, "grammar": self.grammar}  # fmt: skip
        return specs[self.kind]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None  # None (or -1, 0, as in vLLM): no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want fixed lengths)
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the request, like EOS
    stop: tuple[str, ...] = ()  # strings that end the request; the text is cut before them
    include_stop_str_in_output: bool = False  # cut after the stop string instead: keep it
    skip_special_tokens: bool = True  # leave <|im_end|> and friends out of the text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k's
    prompt_logprobs: int | None = None  # k: each prompt token's logprob, rank and the top k's
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the request before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these may be sampled
    bad_words: tuple[str, ...] = ()  # vLLM's: words the reply may not complete
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: JSON, or one of choices
    n: int = 1  # completions of the prompt: `LLM` runs n requests (choice i seeded seed + i)
    detokenize: bool = True  # vLLM's: False gives token ids alone, no text (nothing decoded)
    # vLLM's: keep the prompt's last k tokens (-1: as many as max_model_len); offline `LLM`
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        # Accept vLLM users' habits (a list) but store tuples: params are frozen.
        if not isinstance(self.stop_token_ids, list | tuple):
            raise TypeError(
                f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # one string is one stop, as in vLLM
        if not isinstance(self.stop, list | tuple):
            raise TypeError(
                f"SamplingParams.stop must be a str or a list of str, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(self.stop))
        _check_real("temperature", self.temperature)
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if type(self.top_k) is int and self.top_k in TOP_K_OFF:
            object.__setattr__(self, "top_k", None)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=1)  # None (or -1, 0) disables it
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= SEED_LIMIT:
                raise ValueError(f"SamplingParams.seed must be < 2**64, got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, minimum=0)
        for stop in self.stop:
            if not isinstance(stop, str):
                raise TypeError(f"SamplingParams.stop must hold strings, got {stop!r}")
            if not stop:
                raise ValueError("SamplingParams.stop must not hold an empty string")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise TypeError(
                "SamplingParams.include_stop_str_in_output must be a bool, "
                f"got {self.include_stop_str_in_output!r}"
            )
        if not isinstance(self.skip_special_tokens, bool):
            raise TypeError(
                "SamplingParams.skip_special_tokens must be a bool, "
                f"got {self.skip_special_tokens!r}"
            )
        if not isinstance(self.detokenize, bool):
            raise TypeError(f"SamplingParams.detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self.stop:
            raise ValueError("SamplingParams.stop needs detokenize=True: stop strings are found "
                             "in the text")  # fmt: skip
        if self.truncate_prompt_tokens not in (None, -1):
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"SamplingParams.{name} must be in [{-MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], "
                    f"got {getattr(self, name)}"
                )
        _check_real("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(
                        f"SamplingParams.{name} must be <= {MAX_LOGPROBS}, got {value}"
                    )
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids:
                raise ValueError(
                    "SamplingParams.allowed_token_ids must be a non-empty list of ints, "
                    f"got {self.allowed_token_ids!r}"
                )
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            for token in self.allowed_token_ids:
                _check_int("allowed_token_ids", token, minimum=0)
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))  # one word, as for stop
        if not isinstance(self.bad_words, list | tuple) or not all(
            isinstance(w, str) for w in self.bad_words
        ):
            raise TypeError(
                f"SamplingParams.bad_words must be a list of strings, got {self.bad_words!r}"
            )
        if not all(w.strip() for w in self.bad_words):
            # a blank word would be a ban on nothing (or on a space): say so instead
            raise ValueError(
                f"SamplingParams.bad_words must hold no blank words, got {self.bad_words!r}"
            )
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(
                f"SamplingParams.bad_words holds at most {MAX_BAD_WORDS} words, "
                f"got {len(self.bad_words)}"
            )
        if self.structured_outputs is not None:
            self._check_structured_outputs()

    def _check_structured_outputs(self) -> None:
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "SamplingParams.structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}"
            )
        # Each narrows what may be sampled; with a grammar they could leave nothing (a complete
        # value allows only EOS, which min_tokens forbids).
        for name in ("min_tokens", "allowed_token_ids"):
            if getattr(self, name):
                raise ValueError(
                    f"SamplingParams.{name} cannot be combined with structured_outputs"
                )

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"SamplingParams.logit_bias must be a dict, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # the caller's stays theirs
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token, minimum=0)
            _check_real("logit_bias", bias)
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"SamplingParams.logit_bias values must be in [{-MAX_ABS_LOGIT_BIAS}, "
                    f"{MAX_ABS_LOGIT_BIAS}], got {bias} for token {token}"
                )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError unless every token id these params name is in [0, vocab_size): an
        id past the LM head would index out of range inside a batch shared with others."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):  # fmt: skip
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(
                    f"SamplingParams.{name} holds token ids outside the vocabulary "
                    f"[0, {vocab_size}): {outside[:5]}"
                )

    def check_allowed_tokens(self, eos_token_ids: frozenset[int]) -> None:
        """Raises ValueError if min_tokens would mask every allowed token (each a stop token):
        the first step would have nothing left to sample."""
        if self.allowed_token_ids is None or self.min_tokens == 0:
            return
        stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        if set(self.allowed_token_ids) <= stops:
            raise ValueError(
                "SamplingParams.allowed_token_ids holds only stop tokens, which min_tokens "
                "forbids at first: nothing could be sampled"
            )

    def bad_words_token_ids(
        self, encode: Callable[[str], list[int]]
    ) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as written (leading spaces dropped), and with one leading space
        where that spells it in as many tokens, starting with another (vLLM's rule: " bad" is
        how a word usually appears mid-sentence). Raises ValueError if every allowed token is a
        one-token bad word: nothing could ever be sampled."""
        spellings = []
        for word in self.bad_words:
            alone, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
            spellings.append(tuple(alone))
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                spellings.append(tuple(spaced))
        banned = {word[0] for word in spellings if len(word) == 1}  # banned at every step
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= banned:
            raise ValueError(
                "SamplingParams.allowed_token_ids holds only bad words: nothing could be sampled"
            )
        return tuple(spellings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# A checkpoint's recommended sampling (generation_config.json: Qwen3's temperature 0.6, top_p
# 0.95, top_k 20), used for what a request leaves unset, as vLLM does with
# generation_config="auto" (its default); "vllm" ignores them. max_new_tokens is max_tokens.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                          "max_new_tokens")  # fmt: skip


def generation_defaults(
    model_dir: str | Path, generation_config: str = "auto",
    override: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The sampling defaults `generation_config` gives: "auto" the checkpoint's
    generation_config.json, "vllm" none, or another directory's generation_config.json; then
    `override` (vLLM's override_generation_config: the same keys) over them. Each is checked as
    a `SamplingParams` field would be, so a bad file fails at start-up."""
    if not isinstance(generation_config, str):
        kind = type(generation_config).__name__
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a directory, got {kind}")
    if override is not None and not isinstance(override, dict):
        raise TypeError(f"override_generation_config must be a dict, got {override!r}")
    unknown = sorted(map(str, set(override or {}) - set(GENERATION_CONFIG_KEYS)))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown} are not among "
                         f"{list(GENERATION_CONFIG_KEYS)}")  # fmt: skip
    found, path = {}, "override_generation_config"
    if generation_config != "vllm":
        folder = Path(model_dir if generation_config == "auto" else generation_config)
        file = folder / "generation_config.json"
        if file.is_file():
            found = _read_json_object(file)
            path = f"{file}" + (" with override_generation_config" if override else "")
        elif generation_config != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {folder}")
    found = {**found, **(override or {})}
    defaults = {key: found[key] for key in GENERATION_CONFIG_KEYS if found.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    return defaults


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from e
    if not isinstance(found, dict):
        raise ValueError(f"{path}: not a JSON object")
    return found
