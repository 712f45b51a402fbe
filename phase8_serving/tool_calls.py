"""Tool calls: a chat reply that asks the client to run a function, in OpenAI's `tool_calls`.

Problem: a client offers the model functions (`tools`, each a name and a JSON schema of its
arguments) and wants back structured calls it can run, `{"name": ..., "arguments": "<JSON>"}`,
not prose it has to pick apart. The model writes text; how it writes a call is its own
convention, as its chat template tells it when the tools are rendered into the prompt: Qwen3's,
from Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; Qwen3.5's (and
Qwen3-Coder's) XML in the same tags, `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
</function></tool_call>`, each value text that the function's schema says how to read (a number,
a boolean, JSON for an object or array, else the string itself).
Idea, by `tool_choice` (vLLM's behaviour):
- "auto" (the default when tools are given): the model decides. Its text is read for
  `<tool_call>` blocks, JSON or XML inside; what comes before the first is the reply's content,
  each block a call. Streamed, the
  content goes out as it comes, holding back a tail that could begin `<tool_call>`; from the tag
  on, the text is kept and its calls sent when the choice ends.
- a named function: the reply is that function's arguments, generated under the grammar of its
  parameters' schema (structured_output.py), so they always parse; streamed as they come.
- "required": at least one call, generated under the grammar of a JSON array of
  `{"name": <a tool's name>, "parameters": <its arguments>}` objects (vLLM's format).
- "none": tools are rendered, nothing is parsed.
A reply cut by max_tokens before its calls parse keeps its text as content: nothing is invented.
"""

import json
import re
import uuid
from typing import Any

from .streaming import held_back_length

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
# a value's first and last newline are the format's layout, not the value's
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def named_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A named function's reply: its arguments (an object, whatever its schema leaves open)."""
    return parameters if parameters else {"type": "object"}


def required_schema(functions: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """A JSON array of calls, one tool's name and arguments in each (one call only unless
    `parallel`: OpenAI's parallel_tool_calls)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "parameters": named_schema(f.get("parameters")),
            },  # fmt: skip
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "minItems": 1, "items": items, **({} if parallel else {"maxItems": 1})}


def call(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A complete call as a stream's delta carries it (`index`) and a response (without it)."""
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_hermes(
    text: str, schemas: dict[str, dict[str, Any] | None] | None = None
) -> tuple[str | None, list[dict]] | None:
    """Text with `<tool_call>` blocks -> (the content before the first, the calls), or None if a
    block does not hold a call (JSON {"name": str, "arguments": ...}, or XML `<function=...>`)
    or the text has no block. `schemas`: each function's parameters, to read XML values by."""
    if TOOL_CALL_START not in text:
        return None
    calls = []
    for i, match in enumerate(HERMES_BLOCK.finditer(text)):
        body = match.group(1)
        if body.startswith("<function="):
            found = parse_xml_call(body, schemas or {})
            if found is None:
                return None
            calls.append(call(i, *found))
            continue
        try:
            found = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(found, dict) or not isinstance(found.get("name"), str):
            return None
        calls.append(call(i, found["name"], _arguments(found.get("arguments", {}))))
    if not calls:
        return None
    content = text[: text.index(TOOL_CALL_START)].strip()
    return content or None, calls


def parse_xml_call(body: str, schemas: dict[str, dict[str, Any] | None]) -> tuple[str, str] | None:
    """`<function=NAME><parameter=KEY>VALUE</parameter>...</function>` -> (NAME, the arguments as
    JSON text), each value read as its parameter's schema types it; None if it is not one."""
    match = XML_FUNCTION.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {}
    for key, value in XML_PARAMETER.findall(inner):
        key = key.strip()
        arguments[key] = typed_value(value, properties.get(key))
    return name, json.dumps(arguments, ensure_ascii=False)


def typed_value(text: str, schema: Any) -> Any:
    """An XML parameter's text as its schema's type says (vLLM's qwen3_coder rule): numbers,
    booleans and null by their type, objects and arrays (or no simple type) as JSON when it
    parses; a string, or text that does not read as its type, stays text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    if kind in ("integer", "number"):
        try:
            number = float(text.strip())
        except ValueError:
            return text
        return int(number) if kind == "integer" and number.is_integer() else number
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    if kind == "null" and text.strip().lower() in ("null", "none"):
        return None
    if kind is None or kind in ("object", "array") or isinstance(kind, list):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def parse_required(text: str) -> list[dict] | None:
    """A `required` reply (an array of {"name", "parameters"}) -> its calls; None if it does not
    parse as one (cut by max_tokens)."""
    try:
        return [call(i, c["name"], _arguments(c["parameters"]))
                for i, c in enumerate(json.loads(text))]  # fmt: skip
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


class ToolCallStream:
    """One choice's text turned into content and tool calls as it arrives (`feed`), for a
    stream's chunks and, fed once with the whole text, for a response."""

    def __init__(
        self, mode: str, function_name: str | None = None,
        schemas: dict[str, dict[str, Any] | None] | None = None,
    ):  # fmt: skip
        self.mode = mode  # "auto", "named" or "required"
        self.function_name = function_name  # the named function
        self.schemas = schemas or {}  # each function's parameters: XML values are read by them
        self.text = ""  # all of it so far
        self.sent = 0  # characters of `text` sent as content (auto) or arguments (named)
        self.calls: list[dict] = []  # sent so far (complete, or a named call's header)

    def feed(self, new_text: str, finished: bool) -> tuple[str, list[dict]]:
        """-> (content to send now, tool-call deltas to send now)."""
        self.text += new_text
        if self.mode == "named":
            if not self.calls:
                self.calls = [call(0, self.function_name, "")]
                header = self.calls[0]
                return "", [{**header, "function": {**header["function"], "arguments": new_text}}]
            return "", [{"index": 0, "function": {"arguments": new_text}}] if new_text else []
        if self.mode == "required":
            if not finished:
                return "", []
            self.calls = parse_required(self.text) or []
            return ("" if self.calls else self.text), self.calls
        start = self.text.find(TOOL_CALL_START)
        if not finished:  # content up to the tag, or up to a tail that may begin it
            if start < 0:
                start = len(self.text) - held_back_length(self.text, [TOOL_CALL_START])
            end = max(start, self.sent)
            content, self.sent = self.text[self.sent : end], end
            return content, []
        parsed = parse_hermes(self.text, self.schemas)
        if parsed is None:  # no calls: the rest is content
            content, self.sent = self.text[self.sent :], len(self.text)
            return content, []
        self.calls = parsed[1]
        return self.text[self.sent : start].rstrip() if start > self.sent else "", self.calls

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply -> (content, calls without their stream index)."""
        content, calls = self.feed(text, finished=True)
        if self.mode == "named":
            header = calls[0]
            calls = [{**header, "function": {**header["function"], "arguments": self.text}}]
            content = None
        elif self.mode == "auto" and calls:
            content = parse_hermes(self.text, self.schemas)[0]
        return (content if content or not calls else None), [
            {k: v for k, v in c.items() if k != "index"} for c in calls
        ]

    @property
    def called(self) -> bool:
        return bool(self.calls) and self.mode != "named"
