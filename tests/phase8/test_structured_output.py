"""Structured outputs: the grammar's masks, the engine's sampling under them, the server's fields.

Oracles: brute force (every token of Qwen3's 151k vocabulary fed to the grammar on its own, the
mask must agree), `json.loads` and the schema itself, `re.fullmatch` for regexes, Lark for
context-free grammars, and a random model: without the grammar its replies are never JSON
(checked), so a reply that parses is the grammar's doing. Seeded requests
sample the same tokens with overlap scheduling on (the grammar then reads the previous step's
token while this step's forward runs) and off.
"""

import json
import random
import re
import shutil

import httpx
import numpy as np
import pytest
import torch

from phase8_serving import LLM, SamplingParams, StructuredOutputsParams
from phase8_serving import structured_output as so
from phase8_serving.tokenizer import Tokenizer
from tests import assets

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
        "ok": {"type": ["boolean", "null"]},
    },
    "required": ["name", "ok"],
}
# Every value of this one is bounded: a random model finishes it in a few dozen tokens.
SHORT = {
    "type": "object",
    "properties": {
        "pick": {"enum": ["x", "yz"]},
        "flag": {"type": "boolean"},
        "rest": {"type": "array", "items": {"type": "null"}, "maxItems": 2},
        "maybe": {"const": 7},
    },
    "required": ["pick", "flag", "rest"],
}


def conforms(value, schema) -> bool:
    """Whether `value` matches the small schemas these tests use."""
    if "enum" in schema:
        return value in schema["enum"]
    if "const" in schema:
        return value == schema["const"]
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    python = {"string": str, "integer": int, "number": int | float, "boolean": bool,
              "null": type(None), "object": dict, "array": list}  # fmt: skip
    if not any(isinstance(value, python[k]) and not (k in ("integer", "number")
               and isinstance(value, bool)) for k in kinds):  # fmt: skip
        return False
    if isinstance(value, dict):
        props = schema["properties"]
        keys = list(value)
        return (set(schema.get("required", ())) <= set(keys)
                and keys == [k for k in props if k in value]  # schema order, no others
                and all(conforms(value[k], props[k]) for k in keys))  # fmt: skip
    if isinstance(value, list):
        return len(value) <= schema.get("maxItems", 10**9) and all(
            conforms(v, schema["items"]) for v in value
        )
    return True


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return Tokenizer.from_dir(assets.qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def qwen3_vocab(qwen3_tokenizer):
    return so.Vocabulary.from_tokenizer(qwen3_tokenizer, 151936)


# -- the grammar -------------------------------------------------------------------------------


def feed(grammar: so.Grammar, data: bytes) -> frozenset:
    state = grammar.start
    for byte in data:
        state = grammar.advance(state, byte)
    return state


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"name":"Al","ok":true}', True),
        ('{"name": "\\u00e9\\n", "age": -0, "score": 1.5e-3, "ok": null}', True),
        ('{"name":"x","tags":["a",3,null],"ok":false}', True),
        ('{"name":"日本","ok":true}', True),
        ('{"ok":true,"name":"x"}', False),  # out of the schema's order
        ('{"name":"x"}', False),  # a required property missing
        ('{"name":"x","ok":true,"extra":1}', False),  # a property the schema does not name
        ('{"name":"x","age":1.5,"ok":true}', False),  # not an integer
        ('{"name":"x","age":01,"ok":true}', False),  # a leading zero
        ('{"name":"x","tags":["a","a","a","a"],"ok":true}', False),  # maxItems
        ('{"name":"x","tags":["c"],"ok":true}', False),  # not in the enum
        ('{"name":"a\tb","ok":true}', False),  # a raw control character
        ('{"name":"\\x","ok":true}', False),  # not an escape
        ('{ "name":"x","ok":true}', False),  # a space where none may go
        ('{"name":"x",  "ok":true}', False),  # two spaces
    ],
)
def test_the_grammar_takes_exactly_the_schemas_documents(text, ok):
    grammar = so.Grammar(so.compile_json_schema(PERSON), so.Vocabulary({}, 8))
    state = feed(grammar, text.encode())
    assert (() in state) is ok, state
    if ok:
        json.loads(text)


REGEXES = {
    r"\d{3}-\d{4}": ["555-1234", "55-1234", "555-12345"],
    r"(cat|dog)s?": ["cat", "dogs", "cow", ""],
    r"[A-Z][a-z]*( [A-Z][a-z]*)*": ["Hello World", "hello", "Hello  World"],
    r".{2,3}": ["ab", "é日", "a", "abcd", "a\nb"],
    r"[^0-9\n]+x": ["abx", "a1x", "日x"],
    r"a\.b|\w+@\w+\.com": ["a.b", "axb", "me@x.com"],
    r"^(?:ab)+$": ["abab", "aba", ""],
    r"[\w.-]+": ["a.b-c_d", "a b"],
    r"[\t-\r]{2}x?": ["\t\n", "\n\rx", "ab"],
    r"(?P<year>\d{4})-(0[1-9]|1[0-2])": ["2024-07", "2024-13"],
}


@pytest.mark.parametrize("pattern", list(REGEXES))
def test_a_regex_takes_what_python_fullmatches(pattern):
    grammar = so.Grammar(so.compile_spec("regex", pattern), so.Vocabulary({}, 8))
    for text in REGEXES[pattern]:
        matched = () in feed(grammar, text.encode())
        assert matched == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize(
    "pattern, words",
    [("(?=a)b", "lookarounds"), (r"(a)\1", "escape \\1"), ("a{3,1}", "n < m"),
     ("[z-a]", "backwards"), ("*a", "repeats nothing"), ("(ab", "not closed"),
     ("a{1000}{1000}", "too large"), ("", "non-empty")],
)  # fmt: skip
def test_regexes_it_cannot_enforce_are_refused(pattern, words):
    with pytest.raises(so.SchemaError) as raised:
        so.compile_spec("regex", pattern)
    assert words in str(raised.value)


SQL = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""  # vLLM's test grammar (Lark's notation, no %ignore: no spaces)
ARITHMETIC = r"""
# GBNF (llama.cpp, xgrammar): expressions with nested parentheses
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")" | "-" term
num  ::= [0-9]{1,3} ("." [0-9]+)?
"""
LARK_GRAMMARS = {
    "sql": SQL,
    "list": 'start: "[" [item ("," item)*] "]"\nitem: /[a-c]+/ | start  // nested',
    "words": 'start: word (" " word)* "." -> sentence\nword: WORD\nWORD: /[A-Za-z]+/\n'
    '?unused.2: "x"',
}


@pytest.mark.parametrize("name", list(LARK_GRAMMARS))
def test_a_grammar_takes_what_lark_parses(name):
    """Lark itself (Earley, the whole grammar at once) is the oracle: random strings over the
    grammar's alphabet, and sentences written by walking the grammar, accepted exactly when
    Lark parses them."""
    lark = pytest.importorskip("lark")
    text = LARK_GRAMMARS[name]
    parser = lark.Lark(text, parser="earley")
    grammar = so.Grammar(so.compile_grammar(text), so.Vocabulary({}, 8))
    alphabet = sorted(set("".join(re.findall(r'"([^"]*)"', text))) | set("abcXy ."))
    rng = random.Random(0)
    samples = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
               for _ in range(300)]  # fmt: skip
    for _ in range(100):  # sentences: walk the automaton, each byte one it allows
        state, written = grammar.start, b""
        while () not in state or rng.random() < 0.8:
            options = [
                b for b in b"".join(a.encode() for a in alphabet) if grammar.advance(state, b)
            ]
            if not options or len(written) > 40:
                break
            byte = rng.choice(options)
            state, written = grammar.advance(state, byte), written + bytes([byte])
        samples.append(written.decode())
    parsed = 0
    for sample in samples:
        try:
            parser.parse(sample)
            ok = True
        except lark.exceptions.LarkError:
            ok = False
        parsed += ok
        assert (() in feed(grammar, sample.encode())) == ok, (name, sample)
    assert parsed >= 20  # the walks wrote sentences, not only prefixes


def test_a_gbnf_grammar_takes_its_sentences_and_nothing_else():
    grammar = so.Grammar(so.compile_grammar(ARITHMETIC), so.Vocabulary({}, 8))
    cases = [
        ("1+2", True),
        ("(1.5-(22+333))", True),
        ("--7", True),
        ("1234", False),
        ("(1", False),
        ("1+", False),
        ("", False),
        ("1.", False),
        ("((2))", True),
    ]
    for text, ok in cases:
        assert (() in feed(grammar, text.encode())) == ok, text


@pytest.mark.parametrize(
    "text, words",
    [('root ::= root "a" | "b"', "'root' is left-recursive"),
     ('start: a\na: b "x"\nb: a | "y"', "'a' is left-recursive"),
     ('root ::= c root "x" | "y"\nc ::= d\nd ::= c | ""', "'root' is left-recursive"),
     ('root ::= x', "'x' is not defined"), ('%import common.WS\nstart: "a"', "%import"),
     ('start: "a"i', "flags"), ("just words", "must be rules"), ('start: "a"', None),
     ('root ::= "a"{200}', "at most 100"), ('start: ("a"', "not closed"),
     (r'root ::= "\ud800"', "not valid Unicode"),
     ('root ::= ("a"?){0,50} "b"', "can match nothing"), ("start: " + "(" * 65 + '"a"' + ")" * 65,
     "nest more than 64"),
     ('root ::= "a"\nroot ::= "b"', "defined twice"), ('root: "a"', "no 'start' rule"),
     ("", "non-empty")],
)  # fmt: skip
def test_grammars_it_cannot_run_are_refused(text, words):
    if words is None:  # the control: a grammar that compiles
        so.compile_grammar(text)
        return
    with pytest.raises(so.SchemaError) as raised:
        so.compile_grammar(text)
    assert words in str(raised.value)


def test_utf8_is_checked_byte_by_byte():
    grammar = so.Grammar(so.compile_json_schema({"type": "string"}), so.Vocabulary({}, 8))
    for good in ("é", "日", "😀"):
        assert () in feed(grammar, f'"{good}"'.encode())
    for bad in (b'"\xc3"', b'"\x80"', b'"\xed\xa0\x80"', b'"\xf5\x80\x80\x80"', b'"\xe0\x80\x80"'):
        assert () not in feed(grammar, bad), bad  # cut, stray, surrogate, too large, overlong


def test_refs_recursion_any_of_and_choices():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"}  # fmt: skip
    grammar = so.Grammar(so.compile_json_schema(tree), so.Vocabulary({}, 8))
    assert () in feed(grammar, b'{"v":1,"kids":[{"v":2,"kids":[{"v":3}]},{"v":4}]}')
    assert () not in feed(grammar, b'{"v":1,"kids":[{"kids":[]}]}')
    choice = so.Grammar(so.compile_choice(["yes", "yes please", "no"]), so.Vocabulary({}, 8))
    for text in ("yes", "yes please", "no"):
        assert () in feed(choice, text.encode())
    assert feed(choice, b"yes p") and () not in feed(choice, b"yes p")
    assert not feed(choice, b"nope")
    loose = so.Grammar(so.ANY_OBJ, so.Vocabulary({}, 8))
    assert () in feed(loose, b'{"a":[1,{"b":null},"c"],"d":{}}')
    assert not feed(loose, b"[1]")  # json_object: an object at the top


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "string", "pattern": "a+"}, "'pattern'"),
        ({"type": "integer", "minimum": 0}, "'minimum'"),
        ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, "maxLength"),
        ({"type": "date"}, "unknown type 'date'"),
        ({"$ref": "#/$defs/missing"}, "points at nothing"),
        ({"$ref": "http://example.com/s.json"}, "only references inside"),
        ({"type": "object", "required": ["a"]}, "does not define: ['a']"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "below minItems"),
        ({"enum": [float("nan")]}, "not a JSON value"),
        ("{not json", "not valid JSON"),
        (7, "must be an object"),
        ({"$ref": "#"}, "refers to itself"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            "refers to itself",
        ),
        ({"anyOf": [{"$ref": "#"}]}, "refers to itself"),
        ({"enum": list(range(1001))}, "at most 1000"),
        (json.loads('{"items": ' * 100 + "{}" + "}" * 100), "deeper than 64"),
    ],
)
def test_schemas_it_cannot_enforce_are_refused_by_name(schema, words):
    with pytest.raises(so.SchemaError) as raised:
        so.compile_spec("json", schema)
    assert words in str(raised.value)


def test_a_dead_end_may_only_end_the_reply():
    """An array whose items can never begin (they are only references to themselves, through an
    anyOf): no token can start it, so the reply may only end (stop tokens), never sample from
    logits that are all -inf."""
    loop = {"anyOf": [{"$ref": "#/$defs/x"}, {"$ref": "#/$defs/x"}]}
    looped = {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1, "$defs": {"x": loop}}
    vocab = so.Vocabulary({1: b"[", 2: b"]", 3: b"[]"}, 8)
    matcher = so.GrammarMatcher(so.Grammar(so.compile_spec("json", looped), vocab))
    assert so.unpack_masks(matcher.mask([7]), 8).tolist() == [False] * 7 + [True]
    matcher.read([7], frozenset({7}))  # the stop token is taken


def brute_force_mask(grammar: so.Grammar, state: frozenset) -> np.ndarray:
    allowed = np.zeros(grammar.vocab.vocab_size, dtype=bool)
    for token in grammar.vocab.token_bytes:
        if grammar.advance_token(state, token):
            allowed[token] = True
    return allowed


@pytest.mark.parametrize("kind", ["schema", "json_object", "regex", "grammar"])
def test_masks_equal_brute_force_over_qwen3s_vocabulary(kind, qwen3_vocab):
    """Random walks through the grammar (each step a token its mask allows), the mask checked
    against feeding every one of the 151,643 tokens on its own every few steps: the trie walk,
    the plain-string shortcut and the caches change nothing."""
    node = {
        "schema": so.compile_json_schema(PERSON),
        "json_object": so.ANY_OBJ,
        "regex": so.compile_regex(r"[A-Z][a-zé]{0,9}( [0-9]+| [a-z]+){1,5}\."),
        "grammar": so.compile_grammar(ARITHMETIC),
    }[kind]
    grammar = so.Grammar(node, qwen3_vocab)
    rng = random.Random(0)
    checked = 0
    for walk in range(2):
        matcher = so.GrammarMatcher(grammar)
        tokens = []
        for step in range(45):
            allowed = so.unpack_masks(matcher.mask(()), qwen3_vocab.vocab_size)
            if step % 15 == walk:
                assert (allowed == brute_force_mask(grammar, matcher.state)).all()
                checked += 1
            if not allowed.any():
                break
            tokens.append(int(rng.choice(np.flatnonzero(allowed))))
            matcher.read(tokens, frozenset())
    assert checked >= 3  # a walk ends early where its document is complete


def test_a_walk_too_long_falls_back_to_short_tokens(qwen3_vocab):
    """`.*x` takes nearly every token at every position: a whole-vocabulary walk per new state
    would stall every request's step. Past its budget the walk keeps to tokens of one or two
    bytes: fewer tokens than are valid, none that is not, every byte still reachable."""
    grammar = so.Grammar(so.compile_regex(r".*x"), qwen3_vocab)
    allowed = so.unpack_masks(grammar.mask(grammar.start), qwen3_vocab.vocab_size)
    valid = brute_force_mask(grammar, grammar.start)
    assert not (allowed & ~valid).any() and allowed.sum() < valid.sum() / 10
    assert all(len(qwen3_vocab.token_bytes[t]) <= 2 for t in np.flatnonzero(allowed))
    singles = [t for t, data in qwen3_vocab.token_bytes.items() if len(data) == 1]
    assert (allowed[singles] == valid[singles]).all() and valid[singles].sum() > 100


def test_a_complete_value_allows_only_stop_tokens(qwen3_vocab):
    grammar = so.Grammar(so.compile_choice(["yes"]), qwen3_vocab)
    matcher = so.GrammarMatcher(grammar)
    yes = next(t for t, b in qwen3_vocab.token_bytes.items() if b == b"yes")
    matcher.read([yes], frozenset({151645}))
    allowed = np.flatnonzero(so.unpack_masks(matcher.mask([151645, 7]), 151936))
    assert allowed.tolist() == [7, 151645]


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_vocab_dir(tmp_path_factory):
    """A random 1-layer Qwen3 with Qwen3's tokenizer: real BPE tokens, random choices."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path_factory.mktemp("qwen3-vocab-structured")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.qwen3_tokenizer_dir() / name, directory / name)
    return directory


def structured(seed: int, max_tokens: int = 48, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))  # fmt: skip


@pytest.fixture(scope="module")
def llms(qwen3_vocab_dir, qwen3_vocab) -> dict[bool, LLM]:
    """The engine with overlap scheduling off and on; both take the vocabulary's bytes built
    once for this module (each engine would build its own at its first grammar: ~1 s)."""
    llms = {overlap: LLM(qwen3_vocab_dir, device="cpu", async_scheduling=overlap, max_num_seqs=8)
            for overlap in (False, True)}  # fmt: skip
    for llm in llms.values():
        llm.engine.runner.grammars = so.GrammarCache(lambda: qwen3_vocab)
    return llms


def test_random_model_writes_the_schema_only_under_the_grammar(llms):
    """One batch mixing grammars (a schema, any object, choices) with a request that has none;
    the same seeded batch with overlap scheduling on and off samples the same tokens."""
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    params = [structured(i, json=SHORT) for i in range(4)] + [
        structured(10, max_tokens=24, json_object=True),
        structured(11, choice=["yes", "no", "yes, with a comma"]),
        structured(12, regex=r"[A-Z][a-z]{1,6}-\d{2,3}( [a-z]+)?"),
        SamplingParams(temperature=1.0, seed=1, max_tokens=24),  # the same model, no grammar
        plain,
    ]
    texts = {}
    for overlap, llm in llms.items():
        outs = [o.outputs[0] for o in llm.generate(["Answer:"] * len(params), params,
                                                   use_tqdm=False)]  # fmt: skip
        texts[overlap] = [o.text for o in outs]
        for out in outs[:4]:
            assert out.finish_reason == "stop", out.text
            assert conforms(json.loads(out.text), SHORT), out.text
        assert outs[4].finish_reason == "length" or isinstance(json.loads(outs[4].text), dict)
        assert outs[5].text in ("yes", "no", "yes, with a comma")
        assert re.fullmatch(r"[A-Z][a-z]{1,6}-\d{2,3}( [a-z]+)?", outs[6].text), outs[6].text
        with pytest.raises(json.JSONDecodeError):
            json.loads(outs[7].text)  # without a grammar this model writes no JSON
        alone = llm.generate(["Answer:"], plain, use_tqdm=False)[0].outputs[0].text
        assert outs[8].text == alone  # its neighbours' masks never touched its row
        assert not llm.engine.runner.matchers  # released with their requests
    assert texts[False] == texts[True]
    assert len(set(texts[False][:4])) == 4  # different seeds, different documents


def test_random_model_writes_sentences_of_a_grammar(llms, qwen3_vocab):
    """Lark's notation (vLLM's SQL test grammar) and GBNF, under Qwen3's real tokens: every
    SQL reply is a sentence Lark parses, every arithmetic one a prefix of a sentence at least."""
    lark = pytest.importorskip("lark")
    params = [structured(i, max_tokens=40, grammar=SQL) for i in range(3)]
    params.append(structured(7, max_tokens=24, grammar=ARITHMETIC))
    outs = [o.outputs[0] for o in llms[True].generate(["Query:"] * 4, params, use_tqdm=False)]
    for out in outs[:3]:
        assert out.finish_reason == "stop"
        lark.Lark(SQL).parse(out.text)
    state = feed(so.Grammar(so.compile_grammar(ARITHMETIC), qwen3_vocab), outs[3].text.encode())
    assert state and (outs[3].finish_reason == "length" or () in state), outs[3].text


def test_an_aborted_request_lets_go_of_its_matcher(llms):
    engine = llms[False].engine
    engine.add_request("Answer:", structured(1, json=PERSON), request_id="leaves")
    for _ in range(3):
        engine.step()
    assert len(engine.runner.matchers) == 1
    engine.abort_request("leaves")
    assert not engine.runner.matchers


def test_long_strings_and_numbers_stay_valid_until_cut(llms, qwen3_vocab):
    """A random model rarely closes a string: the reply may end at max_tokens, but every prefix
    it writes is a prefix of a document of the schema."""
    grammar = so.Grammar(so.compile_json_schema(PERSON), qwen3_vocab)
    params = [structured(i, json=PERSON) for i in range(4)]
    outs = llms[False].generate(["x"] * 4, params, use_tqdm=False)
    for out in outs:
        state = feed(grammar, out.outputs[0].text.encode())
        assert state, out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert () in state and conforms(json.loads(out.outputs[0].text), PERSON)


def test_offline_chat_renders_tools_and_generates_a_named_call(llms):
    """`LLM.chat(..., tools=...)` (vLLM's): the template lists them; a call generated under its
    arguments' schema is what a named tool_choice makes the server do."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": SHORT}}
    params = structured(3, json=SHORT)
    (out,) = llms[False].chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False,
                              tools=[tool])  # fmt: skip
    prompt = llms[False].get_tokenizer().decode(out.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "pick"' in prompt
    assert conforms(json.loads(out.outputs[0].text), SHORT)
    with pytest.raises(TypeError, match="tools"):
        llms[False].chat([{"role": "user", "content": "Hi"}], params, tools="pick")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_mask_kernel_keeps_what_the_bits_allow(dtype):
    """kernels/grammar_mask.py (the runner's pass on a GPU; here under Triton's interpreter)
    against unpacking in numpy: rows without a grammar only upcast, a vocabulary that is no
    multiple of 8 (or of the kernel's block) cut where it ends."""
    from phase8_serving.kernels.grammar_mask import apply_grammar_masks

    vocab_size, rng = 4100, np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(3, -(-vocab_size // 8)), dtype=np.uint8)
    mask_of_row = np.array([-1, 0, 2, -1, 1, 2], dtype=np.int32)
    logits = torch.randn(len(mask_of_row), vocab_size).to(dtype)
    out = apply_grammar_masks(logits, torch.from_numpy(packed), torch.from_numpy(mask_of_row))
    allowed = so.unpack_masks(packed, vocab_size)
    expected = logits.float()
    for row, mask in enumerate(mask_of_row):
        if mask >= 0:
            expected[row, torch.from_numpy(~allowed[mask])] = float("-inf")
    assert out.dtype == torch.float32 and torch.equal(out, expected)


THINK, END_THINK, HELLO = 151667, 151668, 23811  # Qwen3's <think>, </think> and " hello"


def test_a_reasoning_gate_frees_the_thoughts_and_holds_the_answer(qwen3_vocab):
    grammars = so.GrammarCache(lambda: qwen3_vocab)
    assert isinstance(grammars.matcher("json", SHORT), so.GrammarMatcher)
    stops = frozenset({151645})
    qwen3 = grammars.matcher("json", SHORT, reasoning="qwen3")
    opening = so.unpack_masks(qwen3.mask(stops), 151936)
    bare = so.unpack_masks(grammars.matcher("json", SHORT).mask(stops), 151936)
    assert opening[THINK] and not bare[THINK]  # the reply may open its thoughts, or answer
    assert (opening ^ bare).sum() == 1 and not opening[HELLO]
    qwen3.read_new([THINK, HELLO, HELLO], stops)
    assert qwen3.mask(stops) is None  # thinking: nothing masked
    qwen3.read_new([END_THINK], stops)
    assert (so.unpack_masks(qwen3.mask(stops), 151936) == bare).all()  # the answer's grammar
    assert qwen3.num_read == 4 and qwen3.matcher.num_read == 0
    answered = grammars.matcher("json", SHORT, reasoning="qwen3")
    answered.read_new([90], stops)  # "{": no thoughts, the answer began
    assert answered.phase == "answer" and answered.matcher.num_read == 1
    deepseek = grammars.matcher("json", SHORT, reasoning="deepseek_r1")
    assert deepseek.mask(stops) is None  # its reply starts inside the thoughts
    deepseek.read_new([HELLO, END_THINK], stops)
    assert (so.unpack_masks(deepseek.mask(stops), 151936) == bare).all()


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_thinking_reply_thinks_freely_then_answers_in_the_grammar(llms, qwen3_vocab, parser):
    """Biased towards <think>, </think> and " hello": the thoughts take " hello" (which no JSON
    starts with), then the answer after </think> is a document of the schema."""
    grammar = so.Grammar(so.compile_json_schema(SHORT), qwen3_vocab)
    bias = {THINK: 100.0, END_THINK: 100.0, HELLO: 100.0}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(json=SHORT,
                                                                        reasoning=parser))
              for i in range(3)]  # fmt: skip
    tokenizer = llms[False].get_tokenizer()
    thoughts = []
    for llm in llms.values():
        for out in llm.generate(["Answer:"] * len(params), params, use_tqdm=False):
            ids = out.outputs[0].token_ids
            if parser == "qwen3":
                assert ids[0] == THINK  # the only biased token the opening allows
            end = ids.index(END_THINK)
            thoughts += ids[:end]
            answer = tokenizer.decode([t for t in ids[end + 1 :] if t not in (151643, 151645)])
            assert feed(grammar, answer.encode()), answer
            if out.outputs[0].finish_reason == "stop":
                assert conforms(json.loads(answer), SHORT), answer
    assert HELLO in thoughts


def test_structured_outputs_params_are_checked_where_they_are_made():
    with pytest.raises(ValueError, match="exactly one of json, choice, json_object"):
        StructuredOutputsParams(json={"type": "string"}, choice=["a"])
    with pytest.raises(ValueError, match="'pattern' not supported"):
        StructuredOutputsParams(json={"type": "string", "pattern": "x"})
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(TypeError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    with pytest.raises(ValueError, match="reasoning must be qwen3 or deepseek_r1"):
        StructuredOutputsParams(json_object=True, reasoning="o1")


# -- the server (the tiny byte-level checkpoint: 256 byte tokens) --------------------------------


def post(http, endpoint: str, **body) -> httpx.Response:
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
        return http.post("/v1/chat/completions", json=body)
    return http.post("/v1/completions", json={"prompt": "Hi", **body})


def texts(response: httpx.Response, endpoint: str) -> list[str]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    return [c["message"]["content"] if endpoint == "chat" else c["text"] for c in choices]


# at most 23 bytes: the tiny server's context is 48 byte tokens, a chat prompt takes 21
TINY = {"type": "object", "properties": {"p": {"enum": ["x", "yz"]}, "f": {"type": "boolean"}},
        "required": ["p", "f"]}  # fmt: skip
TINY_FORMAT = {"type": "json_schema", "json_schema": {"name": "tiny", "schema": TINY}}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    "field",
    [
        {"response_format": TINY_FORMAT},
        {"structured_outputs": {"json": TINY}},
        {"guided_json": json.dumps(TINY)},
    ],
)
def test_the_server_answers_in_the_schema(http, endpoint, field):
    for text in texts(post(http, endpoint, n=3, seed=5, temperature=1.0, max_tokens=24, **field),
                      endpoint):  # fmt: skip
        assert conforms(json.loads(text), TINY), text


def test_the_server_takes_json_object_and_choices(http):
    for text in texts(post(http, "chat", n=4, seed=1, temperature=1.0,
                           response_format={"type": "json_object"}), "chat"):  # fmt: skip
        assert text.startswith("{")  # a random model may be cut mid-object by max_tokens
    options = ["red", "green", "light blue"]
    for text in texts(post(http, "completions", n=3, seed=3, temperature=1.0, max_tokens=20,
                           guided_regex=r"[a-c]{2}\d"), "completions"):  # fmt: skip
        assert re.fullmatch(r"[a-c]{2}\d", text)
    for field in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        for text in texts(post(http, "completions", n=4, seed=2, temperature=1.0, max_tokens=20,
                               **field), "completions"):  # fmt: skip
            assert text in options
    streamed = http.post(
        "/v1/completions",
        json={
            "prompt": "Hi",
            "stream": True,
            "max_tokens": 20,
            "structured_outputs": {"choice": options},
        },
    )
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
              if line.startswith("data: {") and '"choices":[{' in line]  # fmt: skip
    assert "".join(pieces) in options


def test_the_server_takes_grammars(http):
    """vLLM's `guided_grammar` test: its SQL grammar in Lark's notation, each reply one Lark
    parses; a chat under a GBNF grammar in `structured_outputs`."""
    lark = pytest.importorskip("lark")
    for text in texts(post(http, "completions", n=3, seed=4, temperature=1.0, max_tokens=40,
                           guided_grammar=SQL), "completions"):  # fmt: skip
        lark.Lark(SQL).parse(text)
    short = {"grammar": 'root ::= [a-c]{1,3} "!"'}
    for text in texts(post(http, "chat", n=3, seed=5, temperature=1.0, max_tokens=8,
                           structured_outputs=short), "chat"):  # fmt: skip
        assert re.fullmatch(r"[a-c]{1,3}!", text), text


BAD = {
    "unsupported keyword": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "[a-z]+"}}}}, "'pattern'"),
    "no schema": ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    "unknown type": ({"response_format": {"type": "xml"}}, "response_format"),
    "two ways": ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
                 "one way"),
    "left recursion": ({"guided_grammar": 'root ::= root "a" | "b"'}, "left-recursive"),
    "a structural tag": ({"structured_outputs": {"structural_tag": {"type": "x"}}},
                         "structural_tag"),
    "a lookahead": ({"structured_outputs": {"regex": "(?=a)a"}}, "lookarounds"),
    "none given": ({"structured_outputs": {}}, "exactly one"),
    "empty choice": ({"structured_outputs": {"choice": []}}, "non-empty"),
    "with min_tokens": ({"response_format": {"type": "json_object"}, "min_tokens": 2},
                        "min_tokens cannot be combined"),
    "bad JSON text": ({"guided_json": "{oops"}, "not valid JSON"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_structured_output_requests_are_400s(http, case):
    from .conftest import assert_openai_error  # here: the GPU test runs without the server's deps

    body, words = BAD[case]
    error = assert_openai_error(post(http, "chat", max_tokens=4, **body), 400)
    assert words in error["message"], error["message"]
    assert texts(post(http, "completions", max_tokens=3), "completions")  # still serving


@pytest.mark.gpu
def test_gpu_grammars_under_cuda_graphs_and_overlap(qwen3_vocab_dir):
    """On CUDA (bf16, decode steps replayed from CUDA graphs), overlap on and off sample the same
    documents, each valid; the mask reaches the graph's logits and the placeholder's token is
    read from the previous step's copy. ignore_eos: a complete document is followed by EOS
    tokens up to max_tokens, so both engines run the same batches step for step (bf16 sums
    depend on the batch) and equality is exact."""
    spec = [{"json": SHORT}] * 6 + [{"json_object": True}]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(**s))
              for i, s in enumerate(spec)]  # fmt: skip
    texts = {}
    for overlap in (False, True):
        llm = LLM(qwen3_vocab_dir, dtype="bfloat16", device="cuda", max_num_seqs=8,
                  num_kv_blocks=512, async_scheduling=overlap)  # fmt: skip
        assert llm.engine.runner.graphs is not None
        outs = [o.outputs[0] for o in llm.generate(["Answer:"] * len(params), params,
                                                   use_tqdm=False)]  # fmt: skip
        for out in outs[:6]:  # the EOS tokens after the document have no text
            assert conforms(json.loads(out.text), SHORT), out.text
        texts[overlap] = [o.text for o in outs]
        del llm
    assert texts[False] == texts[True]
