"""Structured outputs: a reply that is valid JSON (any object, or one a JSON schema describes),
exactly one of a list of choices, or text a regular expression matches, whatever the model would
rather write.

Problem: a program that asks a model for JSON must parse the reply. Even a good model sometimes
adds prose around it, a trailing comment, a missing brace; a small one rarely writes valid JSON at
all. Checking after the fact and retrying wastes whole generations.
Idea: constrain the sampler. The request's grammar reads the reply byte by byte; before each
sampling step, every token whose bytes the grammar cannot take next gets a logit of -inf, so the
sampler can only pick tokens that keep the reply a prefix of something valid, and EOS only once
it is complete (vLLM does this with xgrammar; this file is the same idea, small enough to read).
- The grammar is a pushdown automaton over bytes. Its state is a stack of frames, the top one
  what comes next: a literal's remaining bytes, a string's body, a number, "the rest of this
  object". Where the grammar allows alternatives (anyOf, an optional property, a number that may
  end or go on) it keeps every stack that is still possible: a state is a set of stacks, as in a
  regular expression's NFA. Frames are tuples, so states hash and each step is memoized.
- A token is allowed when its bytes, fed one by one, leave some stack alive. Walking a trie of
  the vocabulary does all tokens at once: a prefix the grammar rejects prunes every token under
  it. Masks are cached (a stack says all that may follow it, so grammars share them); a walk that
  grows too long keeps to tokens of one or two bytes, which can still spell anything.
- Inside a string almost every token is allowed, and a walk of the whole trie would visit
  ~150k tokens. But a token of plain string bytes (no quote, backslash or control byte; whole
  UTF-8 characters) leaves a string's stack as it was, so those come from one precomputed mask,
  and only the tails of the others (from their first quote, backslash, ...) are walked.

What it produces: no whitespace but an optional single space after ':' and ',' (a model that
likes to pad JSON with newlines cannot loop on them); an object's properties in the schema's
order, each required one present, optional ones possibly left out, no others; strings of valid
UTF-8 with JSON's escapes. JSON Schema keywords that constrain what this grammar does not check
(pattern, minLength, minimum, ...) are refused with an error naming them, never silently ignored;
annotations (title, description, default, format, ...) are ignored, as the standard allows.
A regex becomes a Thompson NFA over characters whose frame gathers a character's UTF-8 bytes.
A context-free grammar (GBNF or Lark's notation) becomes rules of sequences and alternatives
over literals, classes and regexes; left recursion is refused (expanding it would not end).
Under a reasoning parser a chat's grammar starts after the model's `</think>` (`ReasoningGate`):
the thoughts stay free, as in vLLM.
"""

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .reasoning import THINK_END, THINK_START

# Keywords that describe without constraining (JSON Schema 2020-12 treats `format` so too).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "format", "contentEncoding", "contentMediaType", "discriminator",
    "$defs", "definitions",
})  # fmt: skip
SUPPORTED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "minItems", "maxItems", "anyOf", "oneOf", "allOf", "$ref",
})  # fmt: skip
MAX_SCHEMA_NODES = 10_000  # a schema is compiled per request: bound the work a client can ask
MAX_SCHEMA_DEPTH = 64  # subschemas inside subschemas (compiling recurses)
MAX_ITEMS_BOUND = 1_000  # minItems/maxItems are counted in the state; bound how far
MAX_CHOICES = 1_000  # of `choice`, and of an `enum`


class SchemaError(ValueError):
    """A schema (or a choice list) this module cannot, or will not, turn into a grammar."""


# ---------------------------------------------------------------------------------------------
# What a value may be: the schema compiled into nodes (compared by identity in the frames).


class Node:
    __slots__ = ()


class Str(Node):
    __slots__ = ()


class Num(Node):
    __slots__ = ("integer",)

    def __init__(self, integer: bool):
        self.integer = integer


class Literal(Node):
    """One of a few exact byte strings: true, false, null, an enum, a const, a choice."""

    __slots__ = ("options",)

    def __init__(self, options: Iterable[bytes]):
        self.options = tuple(dict.fromkeys(options))


class AnyOf(Node):
    __slots__ = ("options",)

    def __init__(self, options: list[Node]):
        self.options = tuple(options)


class Arr(Node):
    __slots__ = ("item", "min_items", "max_items")

    def __init__(self, item: Node, min_items: int = 0, max_items: int | None = None):
        self.item, self.min_items, self.max_items = item, min_items, max_items


class Obj(Node):
    """An object with known properties, written in order: (key bytes, node, required)."""

    __slots__ = ("props",)

    def __init__(self, props: list[tuple[bytes, Node, bool]]):
        self.props = tuple(props)


class FreeObj(Node):
    """An object with any keys, each value a `value`."""

    __slots__ = ("value",)

    def __init__(self, value: Node | None):
        self.value = value  # None: any JSON value (resolved to ANY when expanded)


class Ref(Node):
    """A `$ref`, resolved after compiling (it may point at an ancestor: recursive schemas)."""

    __slots__ = ("target",)

    def __init__(self):
        self.target: Node | None = None


class Seq(Node):
    """Nodes one after another (a grammar rule's sequence); `Seq(())` reads nothing."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Node]):
        self.items = tuple(items)


class Regex(Node):
    """A regular expression the whole reply must match (compile_regex)."""

    __slots__ = ("nfa",)

    def __init__(self, nfa: "_NFA"):
        self.nfa = nfa


STR, INT, NUM = Str(), Num(integer=True), Num(integer=False)
TRUE_FALSE, NULL = Literal([b"true", b"false"]), Literal([b"null"])
ANY = AnyOf([])  # filled below: any JSON value, objects and arrays of any values included
ANY_OBJ, ANY_ARR = FreeObj(None), Arr(ANY)
ANY.options = (STR, NUM, ANY_OBJ, ANY_ARR, TRUE_FALSE, NULL)


def _dump(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def compile_json_schema(schema: Any) -> Node:
    """A JSON schema (a dict, or True for anything) -> its grammar's root node, or SchemaError."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: '[' x 10^5
            raise SchemaError(f"the JSON schema is not valid JSON: {e}") from None
    return _Compiler(schema).compile_root()


def compile_choice(choices: Any) -> Node:
    """A list of strings -> a grammar whose replies are exactly one of them (their raw text)."""
    if not isinstance(choices, list | tuple) or not choices:
        raise SchemaError(f"choice must be a non-empty list of strings, got {choices!r}")
    if len(choices) > MAX_CHOICES:
        raise SchemaError(f"choice holds {len(choices)} strings; at most {MAX_CHOICES}")
    if not all(isinstance(c, str) and c for c in choices):
        raise SchemaError("choice must hold non-empty strings")
    return Literal(c.encode() for c in choices)


MAX_REGEX_STATES = 5_000  # a{1000}{1000} would make a million


def compile_regex(pattern: Any) -> Node:
    """A regular expression (Python's syntax, a subset: literals and escapes, ., [classes],
    \\d \\w \\s and their negations (ASCII), groups, |, * + ? {m,n}) -> a grammar whose replies
    match it whole. Lookarounds, backreferences and flags are refused."""
    if not isinstance(pattern, str) or not pattern:
        raise SchemaError(f"regex must be a non-empty string, got {pattern!r}")
    return Regex(_NFA(_RegexParser(pattern).parse()))


EMPTY = Seq(())
MAX_GRAMMAR_REPEAT = 100  # {m,n} in a grammar: the copies of its item it makes (and its stacks)
_GRAMMAR_TOKENS = {  # the same order in both notations; GBNF's [classes] are Lark's [optional]
    "space": r"\s+",
    "comment": r"\#[^\n]*|//[^\n]*",
    "define": r"::=|:",
    "alias": r"->",
    "string": r'"(?:[^"\\\n]|\\.)*"[a-zA-Z]*',
    "regex": r"/(?:[^/\\\n]|\\.)+/[a-zA-Z]*",
    "cls": r"\[(?:[^\]\\]|\\.)*\]",
    "repeat": r"\{\s*\d+\s*(?:,\s*\d*\s*)?\}",
    "directive": r"%\w+",
    "name": r"[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\.\d+)?",
    "op": r"[|()*+?\[\]]",
}
_GRAMMAR_TOKEN = {
    gbnf: re.compile("|".join(f"(?P<{kind}>{pattern})" for kind, pattern in _GRAMMAR_TOKENS.items()
                              if kind != ("regex" if gbnf else "cls")))
    for gbnf in (True, False)
}  # fmt: skip
_STRING_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0"}


def compile_grammar(text: Any) -> Node:
    """A context-free grammar -> its root node. Either notation vLLM's backends take: EBNF as
    llama.cpp's GBNF and xgrammar write it (`root ::= "a" item*`, `[a-z]` classes, `# notes`)
    or Lark's (`start: "a" item*`, `/regex/` terminals, `[optional]`, `// notes`). Both:
    "literals", rule names, ( ) groups, | alternatives, * + ?, and GBNF's {m}, {m,}, {m,n}.
    The grammar runs top-down, so left recursion (a rule that can come back to itself, with
    more to read after, before reading a byte) is refused, as are Lark's %import, %ignore and
    flags, by name."""
    if not isinstance(text, str) or not text.strip():
        raise SchemaError(f"grammar must be a non-empty string, got {text!r}")
    return _GrammarParser(text).parse()


class _GrammarParser:
    def __init__(self, text: str):
        self.gbnf = "::=" in text
        self.tokens, i = [], 0
        while i < len(text):
            m = _GRAMMAR_TOKEN[self.gbnf].match(text, i)
            if m is None:
                raise SchemaError(f"grammar, at {i}: unexpected {text[i : i + 10]!r}")
            kind, value, i = m.lastgroup, m.group(), m.end()
            if kind in ("string", "regex") and value[-1] not in '"/':
                raise SchemaError(f"grammar: flags after a literal ({value}) are not supported")
            if kind == "directive":
                raise SchemaError(f"grammar: Lark's {value} is not supported")
            if kind not in ("space", "comment"):
                self.tokens.append((kind, value))
        self.nodes = 0  # made so far: a grammar is compiled per request, so bound the work
        self.depth = 0  # groups open: parsing them recurses
        self.repeated: list[Node] = []  # the items of * + {m,n}: none may match nothing

    def fail(self, what: str):
        raise SchemaError(f"grammar: {what}")

    def parse(self) -> Node:
        tokens = self.tokens
        starts = [i for i in range(len(tokens) - 1)
                  if tokens[i][0] == "name" and tokens[i + 1][0] == "define"]  # fmt: skip
        if not starts or starts[0] != 0:
            self.fail("it must be rules, `name ::= ...` (or Lark's `name: ...`)")
        bodies = {}
        for start, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
            name = tokens[start][1].lstrip("?!").split(".")[0]
            if name in bodies:
                self.fail(f"the rule {name!r} is defined twice")
            bodies[name] = tokens[start + 2 : end]
        self.rules = {name: Ref() for name in bodies}
        for name, body in bodies.items():
            self.body, self.i = body, 0
            self.rules[name].target = self.alternatives()
            if self.i < len(body):
                self.fail(f"unexpected {body[self.i][1]!r} in the rule {name!r}")
        root = "root" if self.gbnf else "start"
        if root not in self.rules:
            self.fail(f"no {root!r} rule: the reply is what it describes")
        _refuse_what_cannot_run(self.rules, self.repeated)
        return self.rules[root]

    def peek(self) -> tuple[str, str] | None:
        return self.body[self.i] if self.i < len(self.body) else None

    def made(self, node: Node) -> Node:
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            self.fail(f"it makes more than {MAX_SCHEMA_NODES} nodes")
        return node

    def alternatives(self) -> Node:
        options = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else self.made(AnyOf(options))

    def sequence(self) -> Node:
        items = []
        while self.peek() not in (None, ("op", "|"), ("op", ")"), ("op", "]")):
            if self.peek()[0] == "alias":  # Lark's `-> name` names a tree; a reply has none
                self.i += 2
                continue
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else self.made(Seq(items))

    def atom(self) -> Node:
        kind, value = self.body[self.i]
        self.i += 1
        if kind == "string":
            data = re.sub(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", _unescape, value[1:-1])
            try:
                return self.made(Literal([data.encode()])) if data else EMPTY
            except UnicodeEncodeError:  # "\ud800": half a surrogate pair is no character
                self.fail(f"{value} is not valid Unicode")
        if kind == "cls":
            return self.made(compile_regex(value))
        if kind == "regex":
            return self.made(compile_regex(value[1:-1].replace("\\/", "/")))
        if kind == "name":
            if value not in self.rules:
                self.fail(f"the rule {value!r} is not defined")
            return self.rules[value]
        if (kind, value) in (("op", "("), ("op", "[")) and (value == "(" or not self.gbnf):
            self.depth += 1
            if self.depth > MAX_SCHEMA_DEPTH:
                self.fail(f"groups nest more than {MAX_SCHEMA_DEPTH} deep")
            inner = self.alternatives()
            self.depth -= 1
            close = ")" if value == "(" else "]"
            if self.peek() != ("op", close):
                self.fail(f"a {value!r} is not closed")
            self.i += 1
            return inner if value == "(" else self.made(AnyOf([inner, EMPTY]))
        self.fail(f"unexpected {value!r}")

    def quantified(self, node: Node) -> Node:
        while self.peek() in (("op", "*"), ("op", "+"), ("op", "?")) or (
            self.peek() is not None and self.peek()[0] == "repeat" and self.gbnf
        ):
            value = self.body[self.i][1]
            self.i += 1
            if value != "?":
                self.repeated.append(node)
            if value == "?":
                node = self.made(AnyOf([node, EMPTY]))
            elif value in "*+":
                star = self.quantified_tail(node, 0, None)
                node = star if value == "*" else self.made(Seq([node, star]))
            else:
                low_text, comma, high_text = value[1:-1].replace(" ", "").partition(",")
                low = int(low_text)
                high = low if not comma else (int(high_text) if high_text else None)
                if high is not None and high < low or max(low, high or 0) > MAX_GRAMMAR_REPEAT:
                    self.fail(f"{value}: at most {MAX_GRAMMAR_REPEAT} repeats, m <= n")
                tail = self.quantified_tail(node, low, high)
                node = self.made(Seq([node] * low + [tail]))
        return node

    def quantified_tail(self, node: Node, low: int, high: int | None) -> Node:
        if high is None:  # item*: a rule that ends, or reads item and recurs in its tail
            star = self.made(Ref())
            star.target = self.made(AnyOf([self.made(Seq([node, star])), EMPTY]))
            return star
        tail = EMPTY
        for _ in range(high - low):  # (x (x (x)?)?)?: up to high - low more
            tail = self.made(AnyOf([self.made(Seq([node, tail])), EMPTY]))
        return tail


def _unescape(m: re.Match) -> str:
    code = m.group(1)
    if code[0] in "xu" and len(code) > 1:
        return chr(int(code[1:], 16))
    return _STRING_ESCAPES.get(code, code)


def _refuse_what_cannot_run(rules: dict[str, Ref], repeated: list[Node]) -> None:
    """A rule reachable from itself before a byte is read, with frames left to read after it,
    would make stacks grow without end as they expand (`expr: expr "+" term`). A rule that only
    comes back in its own tail (item*) keeps the stack as it is, and expanding stops there.
    A repeated item that may match nothing (`("a"?){0,1000}`) is refused too: every way to
    spread the empty matches over the repeats is a stack of its own (a thousand here, and a
    mask that walks the vocabulary with each)."""
    nodes, todo = {}, list(rules.values())  # every node, by id
    while todo:
        node = todo.pop()
        if id(node) not in nodes:
            nodes[id(node)] = node
            todo += {Ref: lambda n: [n.target], AnyOf: lambda n: n.options,
                     Seq: lambda n: n.items}.get(type(node), lambda n: [])(node)  # fmt: skip
    nullable = dict.fromkeys(nodes, False)  # may read nothing: the least fixpoint, from below
    changed = True
    while changed:
        changed = False
        for key, node in nodes.items():
            if isinstance(node, Literal):
                empty = any(not option for option in node.options)
            elif isinstance(node, Regex):
                empty = node.nfa.accept in node.nfa.start
            elif isinstance(node, Seq):
                empty = all(nullable[id(item)] for item in node.items)
            elif isinstance(node, AnyOf):
                empty = any(nullable[id(option)] for option in node.options)
            elif isinstance(node, Ref):
                empty = nullable[id(node.target)]
            else:
                empty = False
            if empty and not nullable[key]:
                nullable[key] = changed = True

    def can_be_empty(node: Node) -> bool:
        return nullable[id(node)]

    if any(can_be_empty(item) for item in repeated):
        raise SchemaError("grammar: a repeated item (*, +, {m,n}) can match nothing, as in "
                          '("a"?)*; repeat what reads something: "a"*')  # fmt: skip

    def edges(node: Node, grows: bool, out: list) -> None:
        """Refs `node` may expand into before reading a byte, and whether frames lie below."""
        todo = [(node, grows)]
        while todo:
            node, grows = todo.pop()
            if isinstance(node, Ref):
                out.append((node, grows))
            elif isinstance(node, AnyOf):
                todo += [(option, grows) for option in node.options]
            elif isinstance(node, Seq):
                for k, item in enumerate(node.items):
                    todo.append((item, grows or k < len(node.items) - 1))
                    if not can_be_empty(item):
                        break

    names = {id(ref): name for name, ref in rules.items()}
    for ref in rules.values():
        todo, seen = [(ref, False)], set()
        while todo:
            node, grew = todo.pop()
            found: list = []
            edges(node.target, False, found)
            for nxt, grows in found:
                if nxt is ref and (grew or grows):
                    raise SchemaError(
                        f"grammar: the rule {names[id(ref)]!r} is left-recursive (it comes back "
                        "to itself before reading a byte); write the repetition with *, as in "
                        'expr: term ("+" term)*'
                    )
                key = (id(nxt), grew or grows)
                if key not in seen:
                    seen.add(key)
                    todo.append((nxt, grew or grows))


DIGIT, WORD = ((0x30, 0x39),), ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE_CHARS = tuple((ord(c), ord(c)) for c in " \t\n\r\f\v")
CLASS_ESCAPES = {"d": (False, DIGIT), "w": (False, WORD), "s": (False, SPACE_CHARS),
                 "D": (True, DIGIT), "W": (True, WORD), "S": (True, SPACE_CHARS)}  # fmt: skip
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
ANY_BUT_NEWLINE = (True, ((0x0A, 0x0A),))


class _RegexParser:
    """Pattern text -> a tree: ("set", negated, ranges), ("cat", [...]), ("alt", [...]),
    ("rep", tree, low, high or None)."""

    def __init__(self, pattern: str):
        self.text, self.i = pattern, 0

    def fail(self, what: str):
        raise SchemaError(f"regex {self.text!r}, at {self.i}: {what}")

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def take(self) -> str:
        if self.i >= len(self.text):
            self.fail("the pattern ends too early")
        self.i += 1
        return self.text[self.i - 1]

    def parse(self):
        if self.peek() == "^":
            self.i += 1  # the whole reply matches: anchors say nothing more
        tree = self.alternation()
        if self.i < len(self.text):
            self.fail(f"unexpected {self.text[self.i]!r}")
        return tree

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.i == len(self.text) - 1:
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def atom(self):
        c = self.take()
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.text.startswith("?P<", self.i):
                self.i = self.text.index(">", self.i) + 1
            elif self.peek() == "?":
                self.fail("lookarounds, flags and other (?...) groups are not supported")
            tree = self.alternation()
            if self.peek() != ")":
                self.fail("a group is not closed")
            self.i += 1
            return tree
        if c == "[":
            return self.char_class()
        if c == ".":
            return ("set", *ANY_BUT_NEWLINE)
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?{":
            self.fail(f"{c!r} repeats nothing")
        if c in "^$":
            self.fail("anchors only at the ends")
        return ("set", False, ((ord(c), ord(c)),))

    def escape(self, in_class: bool):
        c = self.take()
        if c in CLASS_ESCAPES:
            return ("set", *CLASS_ESCAPES[c])
        if c in CHAR_ESCAPES:
            c = CHAR_ESCAPES[c]
        elif c.isalnum():
            self.fail(f"the escape \\{c} is not supported")
        return ("set", False, ((ord(c), ord(c)),))

    def char_class(self):
        negated = self.peek() == "^"
        self.i += negated
        ranges, first = [], True
        while first or self.peek() != "]":
            first = False
            c = self.take()
            if c == "\\":
                item = self.escape(in_class=True)
                if item[1]:
                    self.fail("a negated escape (\\D, \\W, \\S) inside a class is not supported")
                if len(item[2]) > 1 or self.peek() != "-":
                    ranges += item[2]
                    continue
                low = item[2][0][0]
            else:
                low = ord(c)
            if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.take()
                high = self.escape(in_class=True)[2][0][0] if high == "\\" else ord(high)
                if high < low:
                    self.fail("a range runs backwards")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        self.i += 1
        return ("set", negated, tuple(ranges))

    def quantified(self, tree):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and re.match(r"\{\d+(,\d*)?\}", self.text[self.i :]):
                body = self.text[self.i + 1 : self.text.index("}", self.i)]
                self.i = self.text.index("}", self.i) + 1
                low_text, _, high_text = body.partition(",")
                low = int(low_text)
                high = low if "," not in body else (int(high_text) if high_text else None)
                if high is not None and high < low:
                    self.fail("{m,n} with n < m")
            else:
                return tree
            if self.peek() == "?":
                self.i += 1  # lazy or greedy: the same set of strings
            tree = ("rep", tree, low, high)


class _NFA:
    """Thompson's construction: states with epsilon moves and character-set edges; a set of
    states, closed under epsilon moves, is where a partial match may be."""

    def __init__(self, tree):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[tuple, int]]] = []
        first, self.accept = self._build(tree)
        self.start = self.closure([first])
        self._steps: dict[tuple[frozenset, int], frozenset] = {}

    def _new(self) -> int:
        if len(self.eps) >= MAX_REGEX_STATES:
            raise SchemaError(f"the regex is too large (over {MAX_REGEX_STATES} NFA states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def _build(self, tree) -> tuple[int, int]:
        kind = tree[0]
        start = self._new()
        if kind == "set":
            end = self._new()
            self.edges[start].append(((tree[1], tree[2]), end))
            return start, end
        if kind == "cat":
            end = start
            for item in tree[1]:
                a, b = self._build(item)
                self.eps[end].append(a)
                end = b
            return start, end
        if kind == "alt":
            end = self._new()
            for item in tree[1]:
                a, b = self._build(item)
                self.eps[start].append(a)
                self.eps[b].append(end)
            return start, end
        _, item, low, high = tree  # rep: `low` copies, then optional ones or a loop
        end = start
        for _ in range(low):
            a, b = self._build(item)
            self.eps[end].append(a)
            end = b
        if high is None:
            a, b = self._build(item)
            self.eps[end].append(a)
            self.eps[b].append(a)
            last = self._new()
            self.eps[end].append(last)
            self.eps[b].append(last)
            return start, last
        last = self._new()
        for _ in range(high - low):
            self.eps[end].append(last)
            a, b = self._build(item)
            self.eps[end].append(a)
            end = b
        self.eps[end].append(last)
        return start, last

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def reads_more(self, states: frozenset) -> bool:
        return any(self.edges[s] for s in states)

    def may_read(self, states: frozenset, low: int, high: int) -> bool:
        """Whether some character in [low, high] can be read from `states` (a negated set is
        taken as open unless one of its ranges covers all of them)."""
        for s in states:
            for (negated, ranges), _ in self.edges[s]:
                if negated:
                    if not any(lo <= low and high <= hi for lo, hi in ranges):
                        return True
                elif any(lo <= high and low <= hi for lo, hi in ranges):
                    return True
        return False

    def step(self, states: frozenset, char: int) -> frozenset:
        key = (states, char)
        after = self._steps.get(key)
        if after is None:
            moved = [t for s in states for (negated, ranges), t in self.edges[s]
                     if any(lo <= char <= hi for lo, hi in ranges) != negated]  # fmt: skip
            after = self._steps[key] = self.closure(moved)
        return after


class _Compiler:
    def __init__(self, root: Any):
        self.root = root
        self.refs: dict[str, Ref] = {}
        self.num_nodes = 0
        self.depth = 0  # of the subschema being compiled

    def compile_root(self) -> Node:
        node = self.compile(self.root, "schema")
        done = 0
        while done < len(self.refs):  # a target may hold refs of its own
            pointer, ref = list(self.refs.items())[done]
            ref.target = self.compile(self._resolve(pointer), pointer)
            done += 1
        for pointer, ref in self.refs.items():
            seen, target = {id(ref)}, ref.target
            while isinstance(target, Ref):  # a $ref to a $ref ... to itself names no value
                if id(target) in seen:
                    raise SchemaError(f"$ref {pointer!r} refers to itself without a value")
                seen.add(id(target))
                target = target.target
        return node

    def _resolve(self, pointer: str) -> Any:
        if pointer == "#":
            return self.root
        if not pointer.startswith("#/"):
            raise SchemaError(f"$ref {pointer!r}: only references inside the schema ('#/...')")
        target = self.root
        for part in pointer[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"$ref {pointer!r} points at nothing in the schema")
            target = target[part]
        return target

    def compile(self, schema: Any, where: str) -> Node:
        self.num_nodes += 1
        if self.num_nodes > MAX_SCHEMA_NODES:
            raise SchemaError(f"the JSON schema is too large (over {MAX_SCHEMA_NODES} subschemas)")
        if self.depth >= MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} subschemas")
        self.depth += 1
        try:
            return self._compile(schema, where)
        finally:
            self.depth -= 1

    def _compile(self, schema: Any, where: str) -> Node:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise SchemaError(f"{where} must be an object (or true), got {schema!r}")
        unknown = sorted(set(schema) - SUPPORTED - ANNOTATIONS)
        if unknown:
            raise SchemaError(
                f"{where}: JSON Schema keyword(s) {', '.join(map(repr, unknown))} not supported "
                f"(supported: {', '.join(sorted(SUPPORTED))})"
            )
        if "$ref" in schema:
            pointer = schema["$ref"]
            if not isinstance(pointer, str):
                raise SchemaError(f"{where}: $ref must be a string")
            if len(schema.keys() - ANNOTATIONS) > 1:
                raise SchemaError(f"{where}: $ref beside other keywords is not supported")
            return self.refs.setdefault(pointer, Ref())
        if "const" in schema:
            return Literal([self._literal(schema["const"], where)])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{where}: enum must be a non-empty list")
            if len(values) > MAX_CHOICES:
                raise SchemaError(
                    f"{where}: enum holds {len(values)} values; at most {MAX_CHOICES}"
                )
            return Literal(self._literal(v, where) for v in values)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}: {key} must be a non-empty list of schemas")
                if key == "allOf" and len(options) > 1:
                    raise SchemaError(f"{where}: allOf of more than one schema is not supported")
                rest = {k: v for k, v in schema.items() if k != key and k not in ANNOTATIONS}
                # oneOf is generated as anyOf: the options rarely overlap in practice
                nodes = [
                    self.compile({**rest, **o} if rest and isinstance(o, dict) else o,
                                 f"{where}.{key}[{i}]")
                    for i, o in enumerate(options)
                ]  # fmt: skip
                return nodes[0] if len(nodes) == 1 else AnyOf(nodes)
        types = schema.get("type")
        if types is None:  # what the other keywords imply, else any value
            if "properties" in schema or "additionalProperties" in schema:
                types = "object"
            elif "items" in schema:
                types = "array"
            else:
                return ANY
        if isinstance(types, list):
            if not types:
                raise SchemaError(f"{where}: type must not be an empty list")
            nodes = [self._typed(schema, t, where) for t in types]
            return nodes[0] if len(nodes) == 1 else AnyOf(nodes)
        return self._typed(schema, types, where)

    def _typed(self, schema: dict, kind: Any, where: str) -> Node:
        simple = {"string": STR, "integer": INT, "number": NUM, "boolean": TRUE_FALSE,
                  "null": NULL}  # fmt: skip
        if kind in simple:
            return simple[kind]
        if kind == "array":
            item = self.compile(schema.get("items", True), f"{where}.items")
            low = self._count(schema, "minItems", 0, where)
            high = self._count(schema, "maxItems", None, where)
            if high is not None and high < low:
                raise SchemaError(f"{where}: maxItems ({high}) is below minItems ({low})")
            return Arr(item, low, high)
        if kind == "object":
            return self._object(schema, where)
        raise SchemaError(f"{where}: unknown type {kind!r}")

    def _count(self, schema: dict, key: str, default: int | None, where: str) -> int | None:
        value = schema.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value:
            raise SchemaError(f"{where}: {key} must be a non-negative integer, got {value!r}")
        if value > MAX_ITEMS_BOUND:
            raise SchemaError(f"{where}: {key} above {MAX_ITEMS_BOUND} is not supported")
        return value

    def _object(self, schema: dict, where: str) -> Node:
        props = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(props, dict):
            raise SchemaError(f"{where}: properties must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}: required must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{where}: required names properties it does not define: {missing}")
        extra = schema.get("additionalProperties", True)
        if not props:
            if extra is False:
                return Literal([b"{}"])
            value = None if extra is True else self.compile(extra, f"{where}.additionalProperties")
            return FreeObj(value)
        nodes = [(_dump(name), self.compile(sub, f"{where}.properties.{name}"), name in required)
                 for name, sub in props.items()]  # fmt: skip
        return Obj(nodes)

    def _literal(self, value: Any, where: str) -> bytes:
        try:
            return _dump(value)
        except ValueError:
            raise SchemaError(f"{where}: {value!r} is not a JSON value") from None


# ---------------------------------------------------------------------------------------------
# The automaton. A stack is a tuple of frames, its top the last; a state is a frozenset of
# stacks; the empty stack means the value is complete. Frames:
#   ("v", node)             a value of `node` comes next (expanded before any byte is read)
#   ("l", bytes, i)         a literal, bytes[i:] still to read
#   ("s", mode, pend, lo, hi)  a string's body: mode 0 plain, 1 after '\', 2-5 reading \uXXXX's
#                           hex digits; pend UTF-8 continuation bytes still due, the next in
#                           [lo, hi]
#   ("n", integer, phase)   a number (phases below)
#   ("a", node, count)      an array after `count` items: ',' and another, or ']'
#   ("o", node, index, wrote)  an object whose properties before `index` are written
#   ("f", node, wrote)      a free object: ',' and another member, or '}'
#   ("w",)                  an optional space
#   ("x", nfa, states, pending)  a regex: its NFA's states, a character's first UTF-8 bytes

STRING_BODY = ("s", 0, 0, 0x80, 0xBF)
SPACE = ("w",)
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
# number phases: 0 start, 1 after '-', 2 a leading 0, 3 integer digits, 4 after '.', 5 fraction
# digits, 6 after 'e', 7 after the exponent's sign, 8 exponent digits
NUMBER_ENDS = frozenset({2, 3, 5, 8})


def _lit(text: bytes) -> tuple:
    return ("l", text, 0)


def _expand(stack: tuple, out: set, seen: set) -> None:
    """Adds to `out` every stack `stack` can be without reading a byte whose top reads one (or
    that is empty: complete). `seen` stops a schema that refers to itself without consuming.
    A worklist, not recursion: a grammar's chain of rules may run deeper than Python's stack."""
    todo = [stack]
    while todo:
        stack = todo.pop()
        if stack not in seen:
            seen.add(stack)
            _expand_top(stack, out, todo)


def _expand_top(stack: tuple, out: set, todo: list) -> None:
    """One step of `_expand`: `stack` into `out` if its top reads a byte, the stacks it becomes
    without reading one into `todo`."""
    if not stack:
        out.add(stack)
        return
    top, rest = stack[-1], stack[:-1]
    kind = top[0]
    if kind in "ls":
        out.add(stack)
    elif kind == "x":
        nfa, states = top[1], top[2]
        if nfa.reads_more(states) or top[3]:
            out.add(stack)
        if not top[3] and nfa.accept in states:  # the match may end here
            todo.append(rest)
    elif kind == "n":
        out.add(stack)
        if top[2] in NUMBER_ENDS:
            todo.append(rest)
    elif kind == "w":
        todo.append(rest)
        out.add(rest + (_lit(b" "),))
    elif kind == "v":
        _expand_value(top[1], rest, out, todo)
    elif kind == "a":
        _, node, count = top
        if count >= node.min_items:
            out.add(rest + (_lit(b"]"),))
        if node.max_items is None or count < node.max_items:
            todo.append(rest + (("a", node, count + 1), ("v", node.item), SPACE, _lit(b",")))
    elif kind == "o":
        _, node, index, wrote = top
        for j in range(index, len(node.props)):
            key, value, required = node.props[j]
            member = rest + (("o", node, j + 1, True), ("v", value), SPACE, _lit(key + b":"))
            todo.append(member + (SPACE, _lit(b",")) if wrote else member)
            if required:
                break
        else:
            out.add(rest + (_lit(b"}"),))
    elif kind == "f":
        _, node, wrote = top
        out.add(rest + (_lit(b"}"),))
        member = rest + (("f", node, True), ("v", node.value or ANY), SPACE, _lit(b":"),
                         STRING_BODY, _lit(b'"'))  # fmt: skip
        out.add(member + (SPACE, _lit(b",")) if wrote else member)
    else:
        raise AssertionError(f"unknown frame {top!r}")


def _expand_value(node: Node, rest: tuple, out: set, todo: list) -> None:
    if isinstance(node, Str):
        out.add(rest + (STRING_BODY, _lit(b'"')))
    elif isinstance(node, Num):
        out.add(rest + (("n", node.integer, 0),))
    elif isinstance(node, Literal):
        for option in node.options:
            out.add(rest + (_lit(option),))
    elif isinstance(node, AnyOf):
        for option in node.options:
            todo.append(rest + (("v", option),))
    elif isinstance(node, Ref):
        todo.append(rest + (("v", node.target),))
    elif isinstance(node, Arr):
        if node.min_items == 0:
            out.add(rest + (_lit(b"[]"),))
        if node.max_items != 0:
            todo.append(rest + (("a", node, 1), ("v", node.item), _lit(b"[")))
    elif isinstance(node, Obj):
        out.add(rest + (("o", node, 0, False), _lit(b"{")))
    elif isinstance(node, FreeObj):
        out.add(rest + (("f", node, False), _lit(b"{")))
    elif isinstance(node, Regex):
        todo.append(rest + (("x", node.nfa, node.nfa.start, b""),))
    elif isinstance(node, Seq):
        todo.append(rest + tuple(("v", item) for item in reversed(node.items)))
    else:
        raise AssertionError(f"unknown node {node!r}")


def _utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """A multi-byte character's first byte -> (continuation bytes, the next's range); None if it
    cannot start one (ASCII is handled by the caller)."""
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if byte == 0xE0:
        return 2, 0xA0, 0xBF  # no overlong forms
    if 0xE1 <= byte <= 0xEC or 0xEE <= byte <= 0xEF:
        return 2, 0x80, 0xBF
    if byte == 0xED:
        return 2, 0x80, 0x9F  # no surrogates
    if byte == 0xF0:
        return 3, 0x90, 0xBF
    if 0xF1 <= byte <= 0xF3:
        return 3, 0x80, 0xBF
    if byte == 0xF4:
        return 3, 0x80, 0x8F  # nothing past U+10FFFF
    return None


def _step_string(top: tuple, rest: tuple, byte: int) -> tuple | None:
    _, mode, pend, lo, hi = top
    if pend:
        return rest + (("s", 0, pend - 1, 0x80, 0xBF),) if lo <= byte <= hi else None
    if mode == 1:
        if byte in ESCAPES:
            return rest + (STRING_BODY,)
        return rest + (("s", 2, 0, 0x80, 0xBF),) if byte == ord("u") else None
    if mode >= 2:
        if byte not in HEX:
            return None
        return rest + ((STRING_BODY if mode == 5 else ("s", mode + 1, 0, 0x80, 0xBF)),)
    if byte == ord('"'):
        return rest
    if byte == ord("\\"):
        return rest + (("s", 1, 0, 0x80, 0xBF),)
    if byte < 0x20:
        return None  # control characters must be escaped
    if byte < 0x80:
        return rest + (STRING_BODY,)
    lead = _utf8_lead(byte)
    return None if lead is None else rest + (("s", 0, *lead),)


def _step_number(top: tuple, rest: tuple, byte: int) -> tuple | None:
    _, integer, phase = top
    digit = byte in DIGITS
    nxt = None
    if phase == 0:
        nxt = 1 if byte == ord("-") else 2 if byte == ord("0") else 3 if digit else None
    elif phase == 1:
        nxt = 2 if byte == ord("0") else 3 if digit else None
    elif phase in (2, 3):
        if digit and phase == 3:
            nxt = 3
        elif not integer:
            nxt = 4 if byte == ord(".") else 6 if byte in b"eE" else None
    elif phase in (4, 5):
        nxt = 5 if digit else 6 if phase == 5 and byte in b"eE" else None
    elif phase == 6:
        nxt = 7 if byte in b"+-" else 8 if digit else None
    elif phase in (7, 8):
        nxt = 8 if digit else None
    return None if nxt is None else rest + (("n", integer, nxt),)


def _step(stack: tuple, byte: int) -> tuple | None:
    """One byte read by a stack whose top reads bytes -> the stack after it (None: rejected)."""
    if not stack:
        return None  # complete: nothing may follow
    top, rest = stack[-1], stack[:-1]
    kind = top[0]
    if kind == "l":
        _, text, i = top
        if text[i] != byte:
            return None
        return rest if i + 1 == len(text) else rest + (("l", text, i + 1),)
    if kind == "s":
        return _step_string(top, rest, byte)
    if kind == "x":
        return _step_regex(top, rest, byte)
    return _step_number(top, rest, byte)


def _step_regex(top: tuple, rest: tuple, byte: int) -> tuple | None:
    """A regex reads characters: a multi-byte one's bytes wait in the frame until it is whole."""
    _, nfa, states, pending = top
    data = pending + bytes([byte])
    if data[0] >= 0x80:
        lead = _utf8_lead(data[0])
        if lead is None:
            return None
        need, lo, hi = lead
        if len(data) == 2 and not lo <= byte <= hi:
            return None
        if len(data) > 2 and not 0x80 <= byte <= 0xBF:
            return None
        if len(data) <= need:  # unfinished: go on only if a character it may become matches
            fill = need + 1 - len(data)
            low = data + (bytes([lo]) + b"\x80" * (fill - 1) if len(data) == 1 else b"\x80" * fill)
            high = data + (bytes([hi]) + b"\xbf" * (fill - 1) if len(data) == 1 else b"\xbf" * fill)
            if not nfa.may_read(states, ord(low.decode()), ord(high.decode())):
                return None
            return rest + (("x", nfa, states, data),)
    after = nfa.step(states, ord(data.decode()))
    return rest + (("x", nfa, after, b""),) if after else None


# ---------------------------------------------------------------------------------------------
# The vocabulary, as bytes and as tries to walk.


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as a printable character; this undoes it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _plain_split(data: bytes) -> int:
    """How many leading bytes of `data` a JSON string's body takes as they are: no quote,
    backslash or control byte, whole UTF-8 characters only."""
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b < 0x80:
            if b < 0x20 or b in (0x22, 0x5C):
                return i
            i += 1
            continue
        lead = _utf8_lead(b)
        if lead is None or i + lead[0] >= n:  # not a character, or one the next token ends
            return i
        pend, lo, hi = lead
        if not lo <= data[i + 1] <= hi or any(
            c < 0x80 or c > 0xBF for c in data[i + 2 : i + 1 + pend]
        ):
            return i
        i += 1 + pend
    return n


class _Trie:
    """Tokens sharing their first `depth` bytes; children are built on first visit, so a walk
    that a grammar prunes early never builds most of the trie."""

    __slots__ = ("depth", "items", "ending", "_children")

    def __init__(self, items: list[tuple[bytes, int]], depth: int):
        self.depth = depth
        self.items = items
        self.ending = [t for data, t in items if len(data) == depth]
        self._children: dict[int, _Trie] | None = None

    def children(self) -> dict[int, "_Trie"]:
        if self._children is None:
            groups: dict[int, list] = {}
            for data, t in self.items:
                if len(data) > self.depth:
                    groups.setdefault(data[self.depth], []).append((data, t))
            self._children = {b: _Trie(g, self.depth + 1) for b, g in groups.items()}
            self.items = []  # the children hold them now
        return self._children


def check_byte_level(tokenizer) -> None:
    """Raises SchemaError unless the tokenizer is byte-level BPE, whose tokens map to bytes."""
    if type(tokenizer.backend.decoder).__name__ != "ByteLevel":
        raise SchemaError(
            "structured outputs need a byte-level BPE tokenizer (GPT-2's, Qwen's); this model's "
            f"decoder is {type(tokenizer.backend.decoder).__name__}"
        )


class Vocabulary:
    """A tokenizer's tokens as bytes, for the grammar: special tokens never match (EOS is
    allowed separately, once the value is complete)."""

    def __init__(
        self, token_bytes: dict[int, bytes], vocab_size: int, added: dict[str, int] | None = None
    ):
        self.vocab_size = vocab_size  # the LM head's width: a mask covers it all
        self.token_bytes = token_bytes
        self.added = added or {}  # the added tokens' texts (`</think>`) -> their ids
        items = [(data, t) for t, data in token_bytes.items() if data and t < vocab_size]
        self.root = _Trie(items, 0)
        # in a string: tokens of plain bytes keep its stack as it is; the rest, walked from
        # their first other byte (their tail)
        self.plain = np.zeros(vocab_size, dtype=bool)
        tails = []
        for data, t in items:
            cut = _plain_split(data)
            if cut == len(data):
                self.plain[t] = True
            else:
                tails.append((data[cut:], t))
        self.tails = _Trie(tails, 0)
        # every byte is a token of its own, so these spell anything the grammar takes
        self.short = _Trie([(data, t) for data, t in items if len(data) <= 2], 0)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> "Vocabulary":
        check_byte_level(tokenizer)
        backend = tokenizer.backend
        to_byte = _byte_decoder()
        added = backend.get_added_tokens_decoder()
        special = set(added)
        token_bytes = {}
        for text, t in backend.get_vocab(with_added_tokens=False).items():
            if t in special:
                continue
            try:
                token_bytes[t] = bytes(to_byte[c] for c in text)
            except KeyError:
                continue  # not a byte-level token: never generated under a grammar
        tags = {token.content: t for t, token in added.items() if t < vocab_size}
        return cls(token_bytes, vocab_size, tags)


# ---------------------------------------------------------------------------------------------
# A compiled grammar (shared by every request with the same schema) and one request's matcher.


class _WalkTooLong(Exception):
    pass


MAX_WALK_NODES = 150_000  # trie nodes a mask's walk may visit (~0.3 s), outside string bodies
MAX_CACHED_MASKS = 2048  # for every grammar together; packed, a 152k vocabulary's is 19 KB
MAX_CACHED_STEPS = 500_000  # (state, byte) -> state, per grammar; then the memo starts over


class MaskCache(dict):
    """Packed masks by stack (or set of stacks), least recently added out first. A stack says
    all that may follow it, whatever grammar it came from, so grammars share one cache."""

    def put(self, key, packed: np.ndarray) -> np.ndarray:
        if len(self) >= MAX_CACHED_MASKS:
            self.pop(next(iter(self)))
        self[key] = packed
        return packed


def start_state(root: Node) -> frozenset:
    start: set = set()
    _expand((("v", root),), start, set())
    return frozenset(start)


class Grammar:
    def __init__(self, root: Node, vocab: Vocabulary, masks: MaskCache | None = None):
        self.vocab = vocab
        self.start = start_state(root)
        self._advance: dict[tuple[frozenset, int], frozenset] = {}
        self._masks = MaskCache() if masks is None else masks

    def advance(self, state: frozenset, byte: int) -> frozenset:
        key = (state, byte)
        nxt = self._advance.get(key)
        if nxt is None:
            out: set = set()
            for stack in state:
                after = _step(stack, byte)
                if after is not None:
                    _expand(after, out, set())
            if len(self._advance) >= MAX_CACHED_STEPS:
                self._advance.clear()
            nxt = self._advance[key] = frozenset(out)
        return nxt

    def advance_token(self, state: frozenset, token: int) -> frozenset:
        key = (state, -1 - token)  # beside the bytes' keys: one lookup per token read again
        after = self._advance.get(key)
        if after is None:
            after = state
            for byte in self.vocab.token_bytes.get(token, b""):
                after = self.advance(after, byte)
                if not after:
                    break
            self._advance[key] = after
        return after

    def mask(self, state: frozenset) -> np.ndarray:
        """Packed bits (little-endian within a byte) of the tokens `state` may read next: the
        union of what its stacks allow. A stack in a string's body has a mask of its own (the
        plain-string shortcut); the others are walked together, one walk for an enum of 1,000.
        The union is kept by state too: a step's rows mostly come back to states seen before."""
        packed = self._masks.get(state)
        if packed is None:
            packed = self._masks.put(state, self._union(state))
        return packed

    def _union(self, state: frozenset) -> np.ndarray:
        strings = [s for s in state if s and s[-1] == STRING_BODY]
        others = frozenset(s for s in state if s and s[-1] != STRING_BODY)
        masks = [self._cached(frozenset([s]), string=True) for s in strings]
        if others:
            masks.append(self._cached(others, string=False))
        if not masks:
            return np.zeros(-(-self.vocab.vocab_size // 8), dtype=np.uint8)
        return masks[0] if len(masks) == 1 else np.bitwise_or.reduce(masks)

    def _cached(self, stacks: frozenset, string: bool) -> np.ndarray:
        packed = self._masks.get(stacks)
        if packed is None:
            allowed = np.zeros(self.vocab.vocab_size, dtype=bool)
            if string:
                allowed |= self.vocab.plain
                self._walk(self.vocab.tails, stacks, allowed)
            else:
                try:
                    self._walk(self.vocab.root, stacks, allowed, [MAX_WALK_NODES])
                except _WalkTooLong:
                    # A state that takes nearly anything at a position it never was before (a
                    # regex's .{0,500}) would cost a walk of the whole vocabulary each step.
                    # Tokens of one or two bytes can still spell whatever it takes; a mask may
                    # allow fewer tokens than are valid, never more.
                    allowed[:] = False
                    self._walk(self.vocab.short, stacks, allowed)
            packed = self._masks.put(stacks, np.packbits(allowed, bitorder="little"))
        return packed

    def _walk(self, node: _Trie, state: frozenset, allowed: np.ndarray, budget=None) -> None:
        for byte, child in node.children().items():
            nxt = self.advance(state, byte)
            if nxt:
                if budget is not None:
                    budget[0] -= 1
                    if budget[0] < 0:
                        raise _WalkTooLong
                if child.ending:
                    allowed[child.ending] = True
                self._walk(child, nxt, allowed, budget)


class GrammarMatcher:
    """One request's place in its grammar: the output tokens read so far."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.state = grammar.start
        self.num_read = 0  # output tokens read
        self.dead_end = False  # the last mask allowed no token: only stop tokens then

    @property
    def is_complete(self) -> bool:
        return () in self.state

    def read(self, tokens: list[int], stop_tokens: frozenset[int]) -> None:
        """Reads the output tokens (all of them so far) past `num_read`."""
        self.read_new(tokens[self.num_read :], stop_tokens)

    def read_new(self, new_tokens: list[int], stop_tokens: frozenset[int]) -> None:
        """Reads the output tokens that follow the `num_read` read so far. After a complete
        value only stop tokens (EOS) come; any token the grammar rejects is a bug in the
        masking (AssertionError)."""
        for token in new_tokens:
            if token in stop_tokens and (self.is_complete or self.dead_end):
                pass  # the reply ends here (or, under ignore_eos, goes on with stop tokens)
            else:
                state = self.grammar.advance_token(self.state, token)
                assert state, f"token {token} is outside the grammar: the mask let it through"
                self.state = state
            self.num_read += 1

    def mask(self, stop_tokens: Iterable[int]) -> np.ndarray:
        packed = self.grammar.mask(self.state)
        # A schema can lead where no byte goes on (an array of an item that refers only to
        # itself): then the reply may only end, never sample from logits that are all -inf.
        self.dead_end = not self.is_complete and not packed.any()
        if self.is_complete or self.dead_end:
            packed = packed.copy()
            for t in stop_tokens:
                if t < self.grammar.vocab.vocab_size:
                    packed[t >> 3] |= 1 << (t & 7)
        return packed


class ReasoningGate:
    """A grammar that waits out a thinking model's thoughts (vLLM's structured outputs under a
    reasoning parser): the thoughts are free, the answer after them follows the grammar.

    Its phases mirror the server's split of the text (reasoning.py): deepseek_r1's reply starts
    inside the thoughts; qwen3's opens them only with a first `<think>`, so its first token may be
    that tag or what the grammar takes. The tags are the tokenizer's own tokens (Qwen3's and
    DeepSeek-R1's are): a tag spelled out in pieces is text, and the grammar's if it is read."""

    def __init__(self, matcher: GrammarMatcher, parser: str, start: int | None, end: int):
        self.matcher = matcher  # reads the answer's tokens only
        self.start, self.end = start, end
        self.phase = "thinking" if parser == "deepseek_r1" else "may_open"
        self.num_read = 0  # output tokens read, the thoughts' included

    def read_new(self, new_tokens: list[int], stop_tokens: frozenset[int]) -> None:
        for token in new_tokens:
            if self.phase == "thinking":
                if token == self.end:
                    self.phase = "answer"
            elif self.phase == "may_open" and token == self.start:
                self.phase = "thinking"
            else:
                self.phase = "answer"
                self.matcher.read_new([token], stop_tokens)
            self.num_read += 1

    def mask(self, stop_tokens: Iterable[int]) -> np.ndarray | None:
        """The grammar's mask; None while thinking (every token may come)."""
        if self.phase == "thinking":
            return None
        packed = self.matcher.mask(stop_tokens)
        if self.phase == "may_open" and self.start is not None:
            packed = packed.copy()  # the cached mask stays the grammar's
            packed[self.start >> 3] |= 1 << (self.start & 7)
        return packed


@dataclass(frozen=True)
class GrammarKey:
    kind: str  # "json", "json_object", "choice", "regex" or "grammar"
    spec: str  # the schema or the choices, as canonical JSON


def compile_spec(kind: str, spec: Any) -> Node:
    if kind == "json":
        root = compile_json_schema(spec)
    elif kind == "json_object":
        root = ANY_OBJ
    elif kind == "choice":
        root = compile_choice(spec)
    elif kind == "regex":
        root = compile_regex(spec)
    elif kind == "grammar":
        root = compile_grammar(spec)
    else:
        raise SchemaError(f"unknown structured output kind {kind!r}")
    if not start_state(root):
        raise SchemaError("the JSON schema allows no value")
    return root


class GrammarCache:
    """Compiled grammars by request spec, so requests with the same schema share masks."""

    MAX_GRAMMARS = 64

    def __init__(self, vocab_factory):
        self._vocab_factory = vocab_factory  # built on first use: ~1-2 s for 150k tokens
        self._vocab: Vocabulary | None = None
        self._grammars: dict[GrammarKey, Grammar] = {}
        self._masks = MaskCache()  # shared: json_object's stacks are the same in every request

    def matcher(
        self, kind: str, spec: Any, reasoning: str | None = None
    ) -> GrammarMatcher | ReasoningGate:
        """A new request's matcher; `reasoning` (a reasoning parser's name): the grammar starts
        after the thoughts, where the vocabulary has `</think>` as one token (else at once)."""
        key = GrammarKey(kind, json.dumps(spec, sort_keys=True))
        grammar = self._grammars.get(key)
        if grammar is None:
            if self._vocab is None:
                self._vocab = self._vocab_factory()
            if len(self._grammars) >= self.MAX_GRAMMARS:
                self._grammars.pop(next(iter(self._grammars)))
            grammar = Grammar(compile_spec(kind, spec), self._vocab, self._masks)
            self._grammars[key] = grammar
        matcher = GrammarMatcher(grammar)
        end = self._vocab.added.get(THINK_END)
        if reasoning is None or end is None:
            return matcher
        return ReasoningGate(matcher, reasoning, self._vocab.added.get(THINK_START), end)


def unpack_masks(packed: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed masks (..., ceil(V / 8)) -> bools (..., V), on the host (the runner unpacks on the
    device instead; this is for reading a mask)."""
    return np.unpackbits(packed, axis=-1, count=vocab_size, bitorder="little").astype(bool)
