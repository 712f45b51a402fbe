"""Responses: the OpenAI API's JSON for completions and chat, whole or as streaming chunks.

Problem: the engine speaks token ids, deltas and `TokenLogprobs`; the `openai` client parses a
precise JSON shape that differs between the two endpoints (`text` vs `message` or `delta`; legacy
`logprobs` lists vs chat's `logprobs.content`), and again between a whole response and a streamed
chunk.
Idea: `ChoiceStream` follows one choice of a response: it adds up the deltas the front end made
(output_processor.py: nothing is in them that a stop string later removes) into the totals. The
functions below only shape JSON from those deltas and totals.
"""

from collections.abc import Sequence

from .sampling import TokenLogprobs
from .streaming import OutputDelta
from .tokenizer import Tokenizer


class ChoiceStream:
    """One choice (one engine request) of a response, and everything it has produced so far."""

    def __init__(self, index: int, tokenizer: Tokenizer):
        self.index = index
        self.tokenizer = tokenizer
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.finish_reason: str | None = None

    def add(self, delta: OutputDelta) -> bool:
        """Adds a delta to the totals; True if it is worth sending (new text, new logprobs, or
        the finish reason)."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason
        return bool(delta.text or delta.logprobs or delta.finish_reason)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def usage(prompts: Sequence[Sequence[int]], choices: Sequence[ChoiceStream]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n is
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(choice: ChoiceStream, logprobs: list[TokenLogprobs], offset: int) -> dict:
    """The legacy completions shape: parallel lists; text_offset counts from `offset`."""
    tokens = [choice.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{choice.token_text(t): v for t, v in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(choice: ChoiceStream, logprobs: list[TokenLogprobs]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = choice.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t, v) for t, v in lp.top_logprobs],
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
                "logprobs": None if c.logprobs is None else completion_logprobs(c, c.logprobs, 0),
                "finish_reason": c.finish_reason,
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
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None if c.logprobs is None else chat_logprobs(c, c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_,
    }


def completion_chunk(meta: dict, choice: ChoiceStream, delta: OutputDelta) -> dict:
    logprobs = None
    if delta.logprobs is not None:
        offset = len(choice.text) - len(delta.text)
        logprobs = completion_logprobs(choice, delta.logprobs, offset)
    entry = {"index": choice.index, "text": delta.text, "logprobs": logprobs,
             "finish_reason": delta.finish_reason}  # fmt: skip
    return {**meta, "object": "text_completion", "choices": [entry]}


def chat_chunk(meta: dict, choice: ChoiceStream, delta: OutputDelta) -> dict:
    logprobs = None if delta.logprobs is None else chat_logprobs(choice, delta.logprobs)
    content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
    entry = {"index": choice.index, "delta": content, "logprobs": logprobs,
             "finish_reason": delta.finish_reason}  # fmt: skip
    return {**meta, "object": "chat.completion.chunk", "choices": [entry]}


def chat_role_chunk(meta: dict, choice: ChoiceStream) -> dict:
    """The first chunk of each chat choice: the role, no content yet (as OpenAI streams it)."""
    entry = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None}  # fmt: skip
    return {**meta, "object": "chat.completion.chunk", "choices": [entry]}


def usage_chunk(meta: dict, usage_: dict, chat: bool) -> dict:
    """With stream_options.include_usage: the last chunk, no choices, the request's usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {**meta, "object": kind, "choices": [], "usage": usage_}
