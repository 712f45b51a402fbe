"""Reasoning: a thinking model's thoughts apart from its answer, in `reasoning_content`.

Problem: Qwen3 (thinking on, its default) and DeepSeek-R1 write their chain of thought before the
answer, between `<think>` and `</think>`. A client that shows the answer, or parses it as JSON or
tool calls, needs the two apart, and a streaming one wants the thoughts as they come.
Idea (vLLM's `--reasoning-parser`): the server splits each chat choice's text at the tags.
- qwen3: thoughts only if the reply opens with `<think>` (with `enable_thinking: false` the
  template writes an empty think block into the prompt, and the reply is all answer), or if the
  prompt left them open: Qwen3.5's template ends a thinking prompt with `<think>\n`, so its
  reply starts inside the thoughts and is split as deepseek_r1's (`reply_parser`);
- deepseek_r1: its template opens `<think>` in the prompt, so the reply starts inside the
  thoughts: everything before `</think>` is reasoning (all of it, if the tag never comes).
Streamed, text goes out as reasoning until `</think>`, holding back a tail that could begin the
tag (the hold-back rule of stop strings), then as content. A `<tool_call>` before `</think>` ends
the thoughts too (Qwen3.5 may call a tool without closing them: vLLM's rule), and is content.
The content is what tool calls are read from (tool_calls.py).
"""

from .streaming import held_back_length
from .tool_calls import TOOL_CALL_START

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")
PROMPT_TAIL_TOKENS = 32  # where a prompt that opens the thoughts has its `<think>`


def reply_parser(parser: str, tokenizer, prompt_ids: list[int]) -> str:
    """How a reply to this prompt is split: qwen3's as deepseek_r1's when the prompt's last
    think tag opens the thoughts (Qwen3.5's `<think>\n`), so the reply starts inside them."""
    if parser != "qwen3":
        return parser
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
    return "deepseek_r1" if tail.rfind(THINK_START) > tail.rfind(THINK_END) else parser


class ReasoningStream:
    """One choice's text split into (reasoning, content) as it arrives."""

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {REASONING_PARSERS}")
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` already split
        # deepseek_r1's reply starts inside the thoughts; qwen3's may (a leading <think>)
        self.thinking: bool | None = True if parser == "deepseek_r1" else None

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        """-> (reasoning to send now, content to send now)."""
        self.text += new_text
        if self.thinking is None:  # qwen3: does the reply open with <think>?
            stripped = self.text.lstrip()
            if THINK_START.startswith(stripped) and not finished:
                return "", ""  # too early to tell
            self.thinking = stripped.startswith(THINK_START)
            if self.thinking:
                self.sent = self.text.index(THINK_START) + len(THINK_START)
        if not self.thinking:
            content, self.sent = self.text[self.sent :], len(self.text)
            return "", content
        end = self.text.find(THINK_END, self.sent)
        # Qwen3.5 may call a tool before closing its thoughts (vLLM's rule): the call ends them
        call = self.text.find(TOOL_CALL_START, self.sent)
        if call >= 0 and (end < 0 or call < end):
            reasoning, self.thinking = self.text[self.sent : call], False
            content, self.sent = self.text[call:], len(self.text)  # the call is content's
            return reasoning, content
        if end < 0:
            tags = [THINK_END, TOOL_CALL_START]
            keep = 0 if finished else held_back_length(self.text[self.sent :], tags)
            stop = len(self.text) - keep
            reasoning, self.sent = self.text[self.sent : stop], stop
            return reasoning, ""
        reasoning = self.text[self.sent : end]
        self.thinking = False
        self.sent = end + len(THINK_END)
        content = self.text[self.sent :]
        self.sent = len(self.text)
        return reasoning, content

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply -> (reasoning or None, content), whitespace at the seam trimmed."""
        reasoning, content = self.feed(text, finished=True)
        if self.parser == "qwen3" and not reasoning and THINK_END not in text:
            return None, content
        return reasoning.strip("\n") or None, content.lstrip("\n")
