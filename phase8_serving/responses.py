"""Responses: the OpenAI API's JSON for completions and chat, whole or as streaming chunks.

Problem: the engine speaks token ids, deltas and `TokenLogprobs`; the `openai` client parses a
precise JSON shape that differs between the two endpoints (`text` vs `message` or `delta`; legacy
`logprobs` lists vs chat's `logprobs.content`), and again between a whole response and a streamed
chunk.
Idea: `ChoiceStream` follows one choice of a response: it adds up the deltas the front end made
(output_processor.py: nothing is in them that a stop string later removes) into the totals. The
functions below only shape JSON from those deltas and totals.

Logprobs, as OpenAI returns them: the sampled token is always among a position's top logprobs.
Completions list the top `logprobs` tokens plus the sampled one when it is not among them (up to
logprobs + 1 entries; `logprobs: 0` gives the sampled token alone). Chat lists exactly
`top_logprobs` entries, most likely first, the sampled token taking the last place when it is not
among them (vLLM's rule: the sampled token is always there). A completion's `text_offset` counts
the characters of the tokens before it, so a stream, whose text may lag its tokens while a stop
string is held back, gives the same offsets as the whole response. Each choice also carries vLLM's
`stop_reason`: the stop string or `stop_token_ids` entry that ended it (null for EOS or a length).
"""

import time
from collections.abc import Sequence

from .logprobs import TokenLogprobs
from .reasoning import ReasoningStream
from .streaming import OutputDelta
from .tokenizer import Tokenizer
from .tool_calls import ToolCallStream


class ChoiceStream:
    """One choice (one engine request) of a response, and everything it has produced so far.

    vLLM's `return_token_ids`: `prompt_token_ids` holds the prompt's ids, and the response (or the
    choice's first chunk) carries them, and every chunk its new ids; `return_tokens_as_token_ids`
    (`ids_as_tokens`) names logprobs' tokens "token_id:ID", for tokens whose text is not theirs
    alone (a byte of a split character).

    The prompt's logprobs (`prompt_logprobs` k, or `echo` with `logprobs` k) come with the
    choice's first output (the engine scores the prompt while computing it); `echo` (the
    prompt's text and ids) goes out with that first output too, its tokens' logprobs leading
    the choice's (the first token has none: its entry is its bare id)."""

    def __init__(
        self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
        ids_as_tokens: bool = False, echo: tuple[str, list[int]] | None = None,
        echo_logprobs: int | None = None, prompt_logprobs: int | None = None,
    ):  # fmt: skip
        self.index = index
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.ids_as_tokens = ids_as_tokens
        self.echo = echo  # (text, token ids) to send first; None once sent, or without echo
        self.echo_logprobs = echo_logprobs  # the echoed tokens' alternatives (echo + logprobs)
        self.prompt_logprobs_k = prompt_logprobs  # the response's field shows this many (None: no)
        self.awaiting_prompt_logprobs = prompt_logprobs is not None or echo_logprobs is not None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # once they came
        self.num_chunks = 0
        self.text = ""
        self.token_ids: list[int] = []
        # an int: an echoed token without logprobs (the prompt's first)
        self.logprobs: list[TokenLogprobs | int] | None = None
        self.text_offsets: list[int] = []  # per logprob entry: its token's offset in the text
        self.num_token_chars = 0  # characters of the tokens with logprobs so far
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # a chat's text split into reasoning (reasoning.py), content and tool calls
        # (tool_calls.py), when the server reads reasoning or the request has tools
        self.reasoning: ReasoningStream | None = None
        self.tools: ToolCallStream | None = None
        self.message: dict | None = None  # the response's message, once `end_chat` ran

    @property
    def splits(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def end_chat(self) -> None:
        """The response's message from the whole text; "tool_calls" ends it when the model
        called (auto, required)."""
        reasoning, content = None, self.text
        message = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(self.text)
            message["reasoning_content"] = reasoning
        message["content"] = content
        if self.tools is not None:
            message["content"], message["tool_calls"] = self.tools.message(content)
            if self.tools.called:
                self.finish_reason = "tool_calls"
        self.message = message

    def split_delta(self, text: str, finished: bool) -> dict:
        """A stream's delta fields for new text: reasoning, content, tool calls."""
        fields, reasoning = {}, ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, finished)
            if reasoning:
                fields["reasoning_content"] = reasoning
        if self.tools is not None:
            text, calls = self.tools.feed(text, finished)
            if calls:
                fields["tool_calls"] = calls
        if text:
            fields["content"] = text
        return fields

    def add(self, delta: OutputDelta, prompt_logprobs: dict | None = None) -> OutputDelta | None:
        """Adds a delta to the totals; returns it as it is to be sent (with the echo, the first
        time), or None if nothing in it is worth sending (new text, new logprobs, new ids when
        asked, or the finish reason). `prompt_logprobs`: the request's, by choice index, as the
        output processor got them (RequestOutputCollector)."""
        if self.awaiting_prompt_logprobs and prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs.get(self.index)
            self.awaiting_prompt_logprobs = self.prompt_logprobs is None
        if self.echo is not None:
            delta = self._echoed(delta)
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
            for lp in delta.logprobs:
                self.text_offsets.append(self.num_token_chars)
                self.num_token_chars += len(self.token_text(entry_id(lp)))
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        news = delta.text or delta.logprobs or delta.finish_reason
        return delta if news or (self.prompt_token_ids is not None and delta.token_ids) else None

    def _echoed(self, delta: OutputDelta) -> OutputDelta:
        """The first delta, after the prompt's text (and its tokens' logprobs, if asked)."""
        text, ids = self.echo
        self.echo = None
        logprobs = delta.logprobs
        if self.echo_logprobs is not None:
            k, scored = self.echo_logprobs, self.prompt_logprobs or [None] * len(ids)
            echoed = [token if lp is None else
                      TokenLogprobs(lp.token_id, lp.logprob, lp.top_logprobs[:k], lp.rank)
                      for token, lp in zip(ids, scored, strict=True)]  # fmt: skip
            logprobs = echoed + (logprobs or [])
        return delta._replace(text=text + delta.text, logprobs=logprobs)

    def prompt_logprobs_json(self) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id:
        {logprob, rank, decoded_token}} for the token and the k most likely there."""
        k = self.prompt_logprobs_k
        if k is None or self.prompt_logprobs is None:
            return None
        result: list[dict | None] = []
        for lp in self.prompt_logprobs:
            if lp is None:
                result.append(None)
                continue
            entries = {str(lp.token_id): self._logprob(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token, logprob) in enumerate(lp.top_logprobs[:k], start=1):
                entries.setdefault(str(token), self._logprob(token, logprob, rank))
            result.append(entries)
        return result

    def _logprob(self, token: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token_name(token)}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_name(self, token_id: int) -> str:
        """How logprobs name a token: its text, or "token_id:ID"."""
        return f"token_id:{token_id}" if self.ids_as_tokens else self.token_text(token_id)

    def token_ids_fields(self, ids: list[int]) -> dict:
        """A chunk's `token_ids` (its new ids) and, in the choice's first, `prompt_token_ids`;
        nothing unless the request asked for them."""
        self.num_chunks += 1
        if self.prompt_token_ids is None:
            return {}
        first = {"prompt_token_ids": self.prompt_token_ids} if self.num_chunks == 1 else {}
        return {**first, "token_ids": ids}


def entry_id(entry: TokenLogprobs | int) -> int:
    return entry if isinstance(entry, int) else entry.token_id


def token_ids_of(choice: ChoiceStream) -> dict:
    """A whole response's `token_ids` and `prompt_token_ids`: null unless asked (vLLM's keys
    are always there)."""
    asked = choice.prompt_token_ids is not None
    return {"token_ids": choice.token_ids if asked else None,
            "prompt_token_ids": choice.prompt_token_ids}  # fmt: skip


def usage(
    prompts: Sequence[Sequence[int]], choices: Sequence[ChoiceStream],
    cached_tokens: int | None = None,
) -> dict:  # fmt: skip
    """`cached_tokens`: the prompts' tokens found in the prefix cache, reported (OpenAI's
    `prompt_tokens_details`) when the server was started with --enable-prompt-tokens-details."""
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n is
    completion_tokens = sum(len(c.token_ids) for c in choices)
    details = {} if cached_tokens is None else {
        "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        **details,
    }


def with_sampled(lp: TokenLogprobs) -> tuple[tuple[int, float], ...]:
    """Completions: the top logprobs, then the sampled token if it is not among them."""
    if any(t == lp.token_id for t, _ in lp.top_logprobs):
        return lp.top_logprobs
    return (*lp.top_logprobs, (lp.token_id, lp.logprob))


def sampled_in_top(lp: TokenLogprobs) -> tuple[tuple[int, float], ...]:
    """Chat: as many as asked; the sampled token replaces the last if it is not among them."""
    k = len(lp.top_logprobs)
    if k == 0 or any(t == lp.token_id for t, _ in lp.top_logprobs):
        return lp.top_logprobs
    return (*lp.top_logprobs[: k - 1], (lp.token_id, lp.logprob))


def completion_logprobs(
    choice: ChoiceStream, logprobs: list[TokenLogprobs | int] | None, offsets: list[int]
) -> dict | None:
    """The legacy completions shape: parallel lists, one entry per token (None: not asked; an
    echoed token without logprobs, the prompt's first, has None in them)."""
    if logprobs is None:
        return None
    name = choice.token_name
    return {
        "tokens": [name(entry_id(lp)) for lp in logprobs],
        "token_logprobs": [None if isinstance(lp, int) else lp.logprob for lp in logprobs],
        "top_logprobs": [
            None if isinstance(lp, int) else {name(t): v for t, v in with_sampled(lp)}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(choice: ChoiceStream, logprobs: list[TokenLogprobs]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = choice.token_name(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t, v) for t, v in sampled_in_top(lp)],
            }
            for lp in logprobs
        ]  # fmt: skip
    }


def completion_response(meta: dict, choices: Sequence[ChoiceStream], usage_: dict) -> dict:
    return {
        **meta,
        "object": "text_completion",
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c, c.logprobs, c.text_offsets),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": c.prompt_logprobs_json(),  # vLLM's field
                **token_ids_of(c),
            }
            for c in choices
        ],
        "usage": usage_,
    }


def chat_response(meta: dict, choices: Sequence[ChoiceStream], usage_: dict) -> dict:
    return {
        **meta,
        "object": "chat.completion",
        "choices": [
            {
                "index": c.index,
                "message": c.message or {"role": "assistant", "content": c.text},
                "logprobs": None if c.logprobs is None else chat_logprobs(c, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": token_ids_of(c)["token_ids"],
            }
            for c in choices
        ],
        "usage": usage_,
        "prompt_logprobs": choices[0].prompt_logprobs_json(),  # one prompt
        "prompt_token_ids": token_ids_of(choices[0])["prompt_token_ids"],
    }


def completion_chunk(meta: dict, choice: ChoiceStream, delta: OutputDelta) -> dict:
    num_new = len(delta.logprobs or ())  # the delta's entries are the choice's latest
    offsets = choice.text_offsets[len(choice.text_offsets) - num_new :]
    logprobs = completion_logprobs(choice, delta.logprobs, offsets)
    entry = {"index": choice.index, "text": delta.text, "logprobs": logprobs,
             "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
             **choice.token_ids_fields(delta.token_ids),
             **first_prompt_logprobs(choice)}  # fmt: skip
    return {**meta, "object": "text_completion", "choices": [entry]}


def first_prompt_logprobs(choice: ChoiceStream) -> dict:
    """A stream's `prompt_logprobs`, once: in the choice's first chunk after they came."""
    found = choice.prompt_logprobs_json()
    if found is None:
        return {}
    choice.prompt_logprobs_k = None  # sent
    return {"prompt_logprobs": found}


def chat_chunk(meta: dict, choice: ChoiceStream, delta: OutputDelta) -> dict | None:
    """A chat choice's chunk for `delta`; None when a split chat (reasoning, tools) holds all of
    it back for now."""
    logprobs = None if delta.logprobs is None else chat_logprobs(choice, delta.logprobs)
    finish = delta.finish_reason
    if not choice.splits:
        content = {"content": delta.text} if delta.text or not finish else {}
    else:  # reasoning up to </think>, content up to a tool call, the calls as they parse
        content = choice.split_delta(delta.text, finished=finish is not None)
        if finish is not None and choice.tools is not None and choice.tools.called:
            finish = "tool_calls"
        if not content and finish is None and logprobs is None:
            return None
    entry = {"index": choice.index, "delta": content, "logprobs": logprobs,
             "finish_reason": finish, "stop_reason": delta.stop_reason,
             **choice.token_ids_fields(delta.token_ids)}  # fmt: skip
    prompt = first_prompt_logprobs(choice) if choice.index == 0 else {}  # one prompt: once
    return {**meta, "object": "chat.completion.chunk", "choices": [entry], **prompt}


def chat_role_chunk(meta: dict, choice: ChoiceStream) -> dict:
    """The first chunk of each chat choice: the role, no content yet (as OpenAI streams it),
    and the prompt's token ids if asked (vLLM puts a chat's at the top level)."""
    fields = choice.token_ids_fields([])  # a chat choice's first chunk, always
    prompt_ids = fields.pop("prompt_token_ids", None)
    entry = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None, "stop_reason": None, **fields}  # fmt: skip
    top = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
    return {**meta, "object": "chat.completion.chunk", "choices": [entry], **top}


def model_card(name: str, max_model_len: int, root: str | None = None) -> dict:
    """GET /v1/models/{name}, and each entry of GET /v1/models; vLLM's fields beside OpenAI's:
    `root` the checkpoint the name serves, `parent` the base model of an adapter (none here)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "mini-vllm",
            "root": root or name, "parent": None, "max_model_len": max_model_len}  # fmt: skip


def usage_chunk(meta: dict, usage_: dict, chat: bool) -> dict:
    """With stream_options.include_usage: the last chunk, no choices, the request's usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {**meta, "object": kind, "choices": [], "usage": usage_}
