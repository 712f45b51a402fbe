"""Protocol: the OpenAI API's request bodies, validated at the door, and its error shape.

Problem: everything a client sends is untrusted: malformed JSON, a string where a number goes,
a negative temperature, a prompt longer than the model's context. Each must come back as a 400
that names the field, in the shape the official `openai` client parses
(`{"error": {"message", "type", "param", "code"}}`), and must never reach the engine.
Idea: pydantic models with the OpenAI API's field names and ranges (strict: "3" is not a number,
NaN is not a temperature). FastAPI derives `/openapi.json` from them, so the schema clients and
fuzzers see is exactly what is enforced. `sampling_params` turns a valid body into the engine's
`SamplingParams`; what needs the tokenized prompt (the context length) is checked there.
vLLM's extras are accepted too: top_k (-1 or 0: off), min_p, repetition_penalty, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, min_tokens, chat_template_kwargs,
return_token_ids, return_tokens_as_token_ids, prompt_logprobs, add_special_tokens,
truncate_prompt_tokens, allowed_token_ids, bad_words, structured_outputs (and its older names
guided_json, guided_choice, guided_regex, guided_grammar). Structured outputs come from OpenAI's
`response_format` (json_object, json_schema) or vLLM's fields, one of them per request; a schema
this server cannot enforce is a 400 that says which keyword.

Chats take `tools` and `tool_choice` (tool_calls.py), and a history's tool calls and results.

Nothing is silently ignored: a field this server does not know is a 400 that names it (pydantic's
`extra="forbid"`), and the OpenAI fields it knows but does not implement (the deprecated
`functions` and `function_call`, `suffix`, `best_of` > n) are accepted only with their do-nothing
values (`function_call: "none"`, `best_of: n`, ...), else a 400 saying so.
"""

import abc
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .beam_search import MAX_ABS_LENGTH_PENALTY, MAX_BEAM_WIDTH
from .sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutputsParams,
)
from .tool_calls import named_schema, required_schema

MAX_N = 16  # completions per prompt one request may ask for
# Stop strings per request: every step searches each of them in every running request's new text
# (in the front end, on the event loop), so thousands would slow everyone's stream.
MAX_STOP_STRINGS = 64
# Any 64-bit signed seed, as vLLM takes (OpenAI's API says only "integer"); choice i of n uses
# seed + i, wrapped into the engine's [0, 2**64) (torch's seed range)
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1

# what beam search has no part for (beam_search.py): asking for it with use_beam_search is a 400;
# NEUTRAL: the values of these fields that ask for nothing, besides their defaults
BEAM_SEARCH_EXCLUDES = (
    "stream", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "stop", "stop_token_ids",
    "include_stop_str_in_output", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "top_p", "top_k", "min_p",
    "seed", "structured_outputs", "guided_json", "guided_choice", "guided_regex", "guided_grammar",
)  # fmt: skip
NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
           "top_p": (1,), "top_k": (-1, 0), "min_p": (0,)}  # fmt: skip
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
StopList = Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)]
BadWords = Annotated[list[str], Field(max_length=MAX_BAD_WORDS)]
# logit_bias keys are token ids spelled in decimal (JSON keys are strings); 10 digits at most, so
# parsing stays cheap and the engine's vocabulary check says the rest
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]
STRICT = ConfigDict(strict=True, extra="forbid")  # "3" is not a number; unknown fields are 400s
# a client's request id: printable ASCII, as an HTTP header carries it (X-Request-Id)
RequestId = Annotated[str, Field(pattern=r"^[\x21-\x7e]{1,256}$")]


def unsupported(detail: str = "") -> PydanticCustomError:
    """The error for a field this server knows but does not implement: a 400 whose message starts
    with the field's name (api_server.py adds it)."""
    message = "not supported by this server" + (f" ({detail})" if detail else "")
    return PydanticCustomError("unsupported", message)  # no context: braces stay as they are


class InvalidRequest(ValueError):
    """A request the server cannot serve as asked; answered with 400 (or `status`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def error_body(message: str, type_: str, param: str | None, code: str | int | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the schema is always enforced; accepted either way


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json (a schema), choice, json_object, regex,
    grammar."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    choice: list[str] | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    structural_tag: Any = None  # vLLM's; not supported here

    @model_validator(mode="after")
    def _supported(self):
        if self.structural_tag is not None:
            raise unsupported("structural_tag; only json, choice, json_object, regex and grammar")
        return self


class SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    PROMPT_FIELD: ClassVar[str]  # where the prompt is, for errors about its length

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off, as in vLLM
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: NonEmptyStr | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[TokenIdKey, Bias] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # vLLM's
    bad_words: BadWords | None = None  # vLLM's
    # vLLM's: None adds them to a prompt (Llama 3's BOS), not to a chat (its template has them)
    add_special_tokens: bool | None = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: which end truncate_prompt_tokens cuts; "right" keeps the prompt's first k tokens
    truncation_side: Literal["left", "right"] | None = None
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's older name for structured_outputs.json
    guided_choice: list[str] | None = None  # vLLM's older name for structured_outputs.choice
    guided_regex: str | None = None  # vLLM's older name for structured_outputs.regex
    guided_grammar: str | None = None  # vLLM's older name for structured_outputs.grammar
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:ID"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as by vLLM
    # vLLM's: the n likeliest continuations by beam search (beam_search.py), not n samples
    use_beam_search: bool = False
    # beam search's score: logprob sum / length ** length_penalty
    length_penalty: float = Field(1.0, ge=-MAX_ABS_LENGTH_PENALTY, le=MAX_ABS_LENGTH_PENALTY)
    # vLLM's: lower runs first, under --scheduling-policy priority (0 otherwise)
    priority: int = Field(0, ge=MIN_SEED, le=MAX_SEED)
    # vLLM's: the response's id is "<kind>-<request_id>" (an X-Request-Id header wins)
    request_id: RequestId | None = None

    @field_validator("bad_words")
    @classmethod
    def _no_blank_words(cls, value: list[str] | None) -> list[str] | None:
        # a blank word would ban nothing, or a space: SamplingParams refuses it too
        for i, word in enumerate(value or ()):
            if not word.strip():
                raise PydanticCustomError("blank", f"word {i} is blank ({word!r})")
        return value

    @model_validator(mode="after")
    def _beam_search_alone(self):
        """Beam search scores the model's log-probabilities and nothing else: a setting that
        would shape its tokens, or a stream of a result known only at the end, is a 400."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies only with use_beam_search")
            return self
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"use_beam_search keeps n beams, at most {MAX_BEAM_WIDTH}: n={self.n}")
        fields = type(self).model_fields
        asked = [name for name in BEAM_SEARCH_EXCLUDES if name in fields and getattr(self, name)
                 not in (fields[name].default, *NEUTRAL.get(name, ()))]  # fmt: skip
        if self.response_format is not None and self.response_format.type != "text":
            asked.append("response_format")
        if getattr(self, "tool_mode", "none") != "none":
            asked.append("tools")
        if asked:
            raise ValueError(f"use_beam_search cannot be combined with {', '.join(asked)}")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self):
        """At most one way to ask for structured outputs, and a spec the grammar can enforce
        (checked here, so a bad schema is a 400 before anything is tokenized)."""

        def asked(name: str) -> bool:  # response_format's "text" asks for nothing
            value = getattr(self, name)
            return value is not None and (name != "response_format" or value.type != "text")

        ways = (
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_choice",
            "guided_regex",
            "guided_grammar",
        )
        given = [name for name in ways if asked(name)]
        if len(given) > 1:
            raise ValueError(f"ask for structured outputs one way, not with {' and '.join(given)}")
        if given:
            self.structured_outputs_params()  # SchemaError (a ValueError) names the problem
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        so, rf = self.structured_outputs, self.response_format
        if so is not None:
            return StructuredOutputsParams(json=so.json_, choice=so.choice,
                                           json_object=so.json_object, regex=so.regex,
                                           grammar=so.grammar)  # fmt: skip
        if self.guided_json is not None:
            return StructuredOutputsParams(json=self.guided_json)
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=self.guided_choice)
        if self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex)
        if self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = rf.json_schema.json_schema
        return StructuredOutputsParams(json=True if schema is None else schema)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @abc.abstractmethod
    def requested_max_tokens(self) -> int | None:
        """The completion length asked for (each endpoint names its own field); None: the rest
        of the context."""

    @abc.abstractmethod
    def requested_logprobs(self) -> int | None:
        """None: no logprobs; k: the sampled token's and the k most likely tokens'."""

    def scored_prompt_logprobs(self) -> int | None:
        """How many alternatives the engine scores each prompt token with (None: no scoring)."""
        return self.prompt_logprobs

    def sampling_params(
        self, num_prompt_tokens: int, max_model_len: int, choice: int,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:  # fmt: skip
        """The engine's params for choice `choice` of this request, for a prompt of that length;
        `defaults` (the model's generation config, ServerConfig.sampling_defaults) fill what the
        request leaves unset."""
        defaults = defaults or {}
        prompt_param = self.PROMPT_FIELD
        if num_prompt_tokens >= max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
                prompt_param,
            )
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:  # the rest of the context, or the generation config's, if less
            max_tokens = max_model_len - num_prompt_tokens
            max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
        elif num_prompt_tokens + max_tokens > max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} in the completion).",
                "max_tokens",
            )
        given = {
            name: value if value is not None else defaults[name]
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )  # fmt: skip
            if (value := getattr(self, name)) is not None or name in defaults
        }
        return SamplingParams(
            **given,
            max_tokens=max_tokens,
            seed=None if self.seed is None else (self.seed + choice) % 2**64,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.scored_prompt_logprobs(),
            min_tokens=self.min_tokens,
            logit_bias=None if self.logit_bias is None else {
                int(token): bias for token, bias in self.logit_bias.items()
            },
            allowed_token_ids=self.allowed_token_ids,
            bad_words=tuple(self.bad_words or ()),
            structured_outputs=self.structured_outputs_params(),
        )  # fmt: skip


def prompt_kind(value: Any) -> str:
    """Which of the four prompt shapes `value` claims to be, from its first item: the prompt is
    validated as that shape alone. Tried one by one, a W prompt of 560 ids first failed as a
    list of strings with 560 errors, and that took three quarters of its validation."""
    if isinstance(value, list) and value:
        return {str: "texts", list: "id_lists"}.get(type(value[0]), "ids")
    return "ids" if isinstance(value, list) else "text"  # [] fails as ids: "at least 1 item"


Prompt = Annotated[
    Annotated[NonEmptyStr, Tag("text")]
    | Annotated[list[NonEmptyStr], Field(min_length=1), Tag("texts")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("ids")]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1), Tag("id_lists")
    ],
    Discriminator(prompt_kind),
]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    PROMPT_FIELD = "prompt"

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI API's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # each choice's text begins with its prompt's
    suffix: str | None = None  # only empty
    best_of: int | None = Field(None, ge=1)  # only n

    @field_validator("suffix")
    @classmethod
    def _off(cls, value):
        if value:
            raise unsupported()
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info) -> int | None:
        n = info.data.get("n")
        if value is None or n is None or value == n:
            return value
        if value < n:
            raise ValueError(f"best_of ({value}) must be >= n ({n})")
        raise unsupported(f"best_of > n: sampling {value} to return the best {n}")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def scored_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` shows the prompt's tokens' logprobs too."""
        if not self.echo or self.logprobs is None:
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)

    @property
    def has_token_ids(self) -> bool:
        """The prompt is token ids (one list or several), not text."""
        return not isinstance(self.prompt, str) and not isinstance(self.prompt[0], str)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text, or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # a named or required call is always generated under its schema


class ChatTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    # A message's other keys go to the chat template as they are, as vLLM's do: a template may
    # read them (Qwen3's reads an assistant turn's `reasoning_content`, which a reply carries
    # under --reasoning-parser), and any role is the template's to render or refuse.
    model_config = ConfigDict(strict=True, extra="allow")
    role: NonEmptyStr  # system, developer, user, assistant, tool, or one the template knows
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's; handed to the template as is
    # What the SDK's response message carries, so a client can append `message.model_dump()` to
    # its history: accepted while they say nothing (no refusal, no tool call, no audio).
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, handed to the template

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        """Names an image or audio part (else pydantic's union error says only that the content
        is not a string)."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise unsupported(f"content part {i} of type {kind!r}; only 'text' parts")
        return value

    @field_validator("refusal", "annotations", "audio", "function_call")
    @classmethod
    def _says_nothing(cls, value):
        if value:  # None, or empty: what a plain reply's message holds
            raise unsupported("only null or empty, as a plain reply holds it")
        return value

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            return "".join(part.text for part in content)
        return content or ""

    def for_template(self) -> dict[str, Any]:
        content = self.text() if isinstance(self.content, list) else self.content
        message = {**(self.model_extra or {}), "role": self.role, "content": content,
                   "name": self.name}  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            # templates test the content (Qwen3's: '</think>' in content): text, even if empty
            message["content"] = content or ""
        return message


# chat fields of OpenAI's this server has no part in -> (the values that ask for nothing, why)
CHAT_NEUTRAL = {
    "store": ((None, False), "no completion is stored for later retrieval"),
    "service_tier": ((None, "auto", "default"), "there is one tier"),
    "prompt_cache_retention": ((None, "in-memory"), "the prefix cache lives in GPU memory"),
    "verbosity": ((None, "medium"), "nothing here makes a reply terser or longer"),
    "modalities": ((None, ["text"]), "the reply is text"),
    "reasoning_effort": ((None,), "Qwen3 thinks or not by chat_template_kwargs' "
                                  "enable_thinking, not by an effort level"),
    "audio": ((None,), "the reply is text"),
    "prediction": ((None,), "there are no predicted outputs here"),
    "web_search_options": ((None,), "there is no web search here"),
}  # fmt: skip


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    PROMPT_FIELD = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still sent by many
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply goes on with the final message
    echo: bool = False  # vLLM's: the reply begins with the final message's content, if its role's
    chat_template_kwargs: dict[str, str | bool | int | float | None] | None = None
    tools: list[ChatTool] | None = None  # rendered by the chat template; tool_calls.py
    # None: "auto" with tools, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # the deprecated spelling of tools: accepted only when it asks for nothing
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None  # only "none"
    parallel_tool_calls: bool | None = None  # false: `required` makes one call (auto: the model's)
    # tags and routing hints that change nothing here, as `user`
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no hint
    safety_identifier: str | None = None
    # OpenAI's asks this server has no part in: accepted at what asks for nothing (CHAT_NEUTRAL)
    store: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    verbosity: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator(*CHAT_NEUTRAL, mode="before")
    @classmethod
    def _asks_for_nothing(cls, value, info):
        allowed, why = CHAT_NEUTRAL[info.field_name]
        if value not in allowed:
            raise unsupported(f"{why}; only {' or '.join(json.dumps(v) for v in allowed)}")
        return value

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value):
        if value:
            raise unsupported("the deprecated functions; send tools")
        return value

    @field_validator("function_call")
    @classmethod
    def _choose_none(cls, value):
        if value not in (None, "none"):
            raise unsupported("the deprecated function_call; send tool_choice")
        return value

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        choice = self.tool_choice
        if choice not in (None, "none") and self.tools is None:  # OpenAI's and vLLM's 400
            asked = repr(choice) if isinstance(choice, str) else "naming a function"
            raise ValueError(f"tool_choice {asked} is only allowed when tools are specified")
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise ValueError("tool_choice asks for a call, but there are no tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {choice.function.name!r}, not among the tools "
                    f"({', '.join(names)})"
                )
        return self

    @property
    def tool_mode(self) -> str:
        """How tools are used: "none", "auto", "required" or "named"."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def tool_schemas(self) -> dict[str, dict[str, Any] | None]:
        """Each tool's parameters' schema, by name (XML calls' values are read by them)."""
        return {t.function.name: t.function.parameters for t in self.tools or ()}

    def tool_function(self) -> FunctionDefinition | None:
        """The named tool_choice's function."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        return next((t.function for t in self.tools or () if t.function.name == name), None)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A named or required tool call is generated under its arguments' schema."""
        mode = self.tool_mode
        if mode not in ("named", "required") or not self.tools:
            return super().structured_outputs_params()
        if super().structured_outputs_params() is not None:
            raise ValueError(f"tool_choice {mode!r} cannot be combined with structured outputs")
        if mode == "named":
            function = self.tool_function()
            if function is None:
                raise ValueError("tool_choice names a function that is not among the tools")
            schema = named_schema(function.parameters)
        else:
            functions = [t.function.model_dump() for t in self.tools]
            schema = required_schema(functions, self.parallel_tool_calls is not False)
        return StructuredOutputsParams(json=schema)

    @model_validator(mode="after")
    def _tool_schemas_compile(self):
        if self.tool_mode in ("named", "required"):
            self.structured_outputs_params()  # SchemaError (a ValueError) names the keyword
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    @model_validator(mode="after")
    def _one_way_to_end(self):
        return check_one_way_to_end(self)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the template, as token
    ids, to count a prompt before sending it."""

    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # None: True for a prompt (Llama 3's BOS), False for messages (the template holds them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | bool | int | float | None] | None = None
    return_token_strs: bool = False  # the tokens' own strings, as the vocabulary spells them

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt_or_messages", "give either prompt or messages")
        return self

    @model_validator(mode="after")
    def _one_way_to_end(self):
        return check_one_way_to_end(self)


def check_one_way_to_end(body):
    """A chat's rendered text ends either with the assistant's turn opened or inside the final
    message (vLLM's rule)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(add_generation_prompt is true unless set to false)"
        )
    return body


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = STRICT
    model: str | None = None
    tokens: list[int]


# --- POST /v1/responses (serving_responses.py): OpenAI's Responses API, run as a chat ---

RESPONSES_INCLUDABLE = ("message.output_text.logprobs",)  # the one `include` this server fills
MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class ResponsesTextPart(BaseModel):
    """An input item's text: `input_text` (what a client writes) or `output_text` (a reply's
    part sent back in a history, with the fields the SDK gives it)."""

    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text part's, as the SDK dumps it
    logprobs: list[Any] | None = None


def _text_parts(value, what: str):
    """Names an image, file or audio part (pydantic's union error would only say the content
    is not a string)."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("input_text", "output_text"):
                raise unsupported(f"{what} part {i} of type {kind!r}; only input_text parts")
    return value


def _joined(content: "str | list[ResponsesTextPart]") -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class ResponsesItem(BaseModel):
    """What every input item may carry: a reply's items, sent back in a history, have an id and
    a status."""

    model_config = STRICT
    id: str | None = None
    status: str | None = None


class ResponsesMessage(ResponsesItem):
    type: Literal["message"] = "message"
    # developer is OpenAI's name for system; the chat template sees "system"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesTextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        return _text_parts(value, "content")


class ResponsesFunctionCall(ResponsesItem):
    """A call the model made (a reply's function_call item, sent back in a history)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # JSON text


class ResponsesFunctionCallOutput(ResponsesItem):
    """What the client's function returned, for the call with this call_id."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[ResponsesTextPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, value):
        return _text_parts(value, "output")


class ReasoningText(BaseModel):
    model_config = STRICT
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ResponsesReasoning(ResponsesItem):
    """A reply's reasoning item sent back in a history: the template sees it as the next
    assistant message's `reasoning_content` (Qwen3's renders it in the latest turn)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # nothing here encrypts


def input_item_kind(value: Any) -> str:
    """An item's `type`; a bare {role, content} is a message (OpenAI's easy input message).
    (`value` is the parsed item when pydantic serializes one.)"""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else "message"
    return getattr(value, "type", "message")


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessage, Tag("message")]
    | Annotated[ResponsesFunctionCall, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponsesReasoning, Tag("reasoning")],
    Discriminator(input_item_kind),
]


class ResponsesFunctionTool(BaseModel):
    """A function the model may call: chat's tool without the `function` wrapper."""

    model_config = STRICT
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class ResponsesTextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)  # json_schema's
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None and self.name is not None):
            raise ValueError("name and schema are required with type 'json_schema', and only then")
        return self


class ResponsesText(BaseModel):
    model_config = STRICT
    format: ResponsesTextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; nothing here makes it terser


class ResponsesReasoningConfig(BaseModel):
    """Accepted while it asks for nothing: a Qwen3 model thinks or not by its template's
    `enable_thinking` (chat_template_kwargs), not by an effort level."""

    model_config = STRICT
    effort: None = None
    summary: None = None
    generate_summary: None = None


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: none here


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Its items and settings become a chat (`chat_request`)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    model: str | None = None
    input: NonEmptyStr | Annotated[list[ResponsesInputItem], Field(min_length=1)]
    instructions: str | None = None  # a system message first; not carried to the next response
    previous_response_id: str | None = None  # go on from a stored response's conversation
    store: bool = True  # keep this response for GET and previous_response_id
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoningConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE)]] | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    user: str | None = None  # accepted and ignored, as by vLLM
    safety_identifier: str | None = None  # likewise
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache needs none
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # a prompt too long is a 400, never cut
    background: Literal[False] | None = None
    max_tool_calls: None = None  # limits built-in tools' calls: there are none here
    # vLLM's extras, as on the chat endpoint
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    presence_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: NonEmptyStr | StopList | None = None
    chat_template_kwargs: dict[str, str | bool | int | float | None] | None = None
    priority: int = Field(0, ge=MIN_SEED, le=MAX_SEED)
    request_id: RequestId | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            if kind != "function":  # web_search, file_search, mcp, ...: built-in tools
                raise unsupported(f"tool {i} of type {kind!r}; only function tools")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None):
        for name in value or ():
            if name not in RESPONSES_INCLUDABLE:
                raise unsupported(f"{name!r}; only {', '.join(RESPONSES_INCLUDABLE)}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str] | None):
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(value)}")
        for key in value or ():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"a key is at most {MAX_METADATA_KEY} characters: {key[:80]!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def logprobs(self) -> bool:
        """Logprobs come back only when `include` asks for them (OpenAI's rule)."""
        return "message.output_text.logprobs" in (self.include or ())

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages: an assistant's function calls (and the reasoning
        before them) one assistant message with tool_calls, each output a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        reasoning: str | None = None  # for the next assistant message
        for item in self.input:
            if isinstance(item, ResponsesReasoning):
                parts = item.content if item.content is not None else item.summary
                reasoning = (reasoning or "") + "".join(p.text for p in parts)
                continue
            if isinstance(item, ResponsesFunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _joined(item.output)})  # fmt: skip
                continue
            if isinstance(item, ResponsesFunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)  # the same turn's calls
                    last["content"] = last["content"] or ""
                    continue
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
            else:
                role = "system" if item.role == "developer" else item.role
                message = {"role": role, "content": _joined(item.content)}
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        return messages

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's settings (not its messages): what it is validated and run with."""
        fields: dict[str, Any] = {
            name: value
            for name in (
                "temperature",
                "top_p",
                "parallel_tool_calls",
                "top_k",
                "min_p",
                "seed",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "stop",
                "chat_template_kwargs",
                "priority",
            )  # fmt: skip
            if (value := getattr(self, name)) is not None
        }
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.logprobs:
            fields["logprobs"], fields["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, ResponsesNamedTool):
            named = {"name": self.tool_choice.name}
            fields["tool_choice"] = {"type": "function", "function": named}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema":
            schema = {"name": form.name, "schema": form.json_schema, "strict": form.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif form is not None:
            fields["response_format"] = {"type": form.type}
        return fields
