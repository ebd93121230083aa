"""Structured output's host half (jaxserve/structured/grammar.py) on the three kinds of tokenizer:
the demo's bytes, stories260K's SentencePiece with byte fallback, a Hugging Face byte-level BPE.

The main check is a seeded random walk through each grammar, as a model sampling under the mask
would: at every step the mask must allow something and nothing past the tokenizer's vocabulary
(the model's here is larger), the walk picks an allowed token, the matcher must accept it, and a
finished output (EOS) is checked independently: jsonschema validates the JSON, re.fullmatch the
regex, the choice is one of the choices.
"""

import ast
import json
import random
import re

import jsonschema
import numpy as np
import pytest
from bpe_tokenizer import byte_level_bpe
from schemas import json_schemas, regexes

from jaxserve.demo import demo_model_dir
from jaxserve.request import StructuredOutputsParams
from jaxserve.structured.bitmask import bitmask_width
from jaxserve.structured.grammar import GrammarCompiler, allowed
from jaxserve.text.tokenizer import load_tokenizer

PAD = 45  # the model's vocabulary past the tokenizer's (ids never allowed)
SOFT_STEPS, MAX_STEPS = 120, 400  # a walk steers to an end after SOFT_STEPS
CLOSERS = [b'"', b"}", b"]", b")", b"0", b"1", b"5"]  # close a string, then brackets; end a number

GBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= "0" | [1-9] [0-9]{0,3}
"""
LARK = r"""start: pair ("," pair)*
pair: KEY "=" VALUE
KEY: /[a-z]{1,5}/
VALUE: /[0-9]{1,3}/ | "true" | "false"
"""
LARK_TEXT = re.compile(r"[a-z]{1,5}=([0-9]{1,3}|true|false)(,[a-z]{1,5}=([0-9]{1,3}|true|false))*")


class Walker:
    """A tokenizer, its compiler, and what a walk needs to know of its ids."""

    def __init__(self, tok, vocab_size: int | None = None):
        self.tok = tok
        self.vocab = tok.vocab_size + PAD if vocab_size is None else vocab_size
        self.compiler = GrammarCompiler(tok, self.vocab, tok.eos_token_ids)
        self.eos = tok.eos_token_ids
        pieces = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.blank = np.array([not p.strip() for p in pieces] + [False] * PAD)
        self.is_eos = np.isin(np.arange(self.vocab), list(self.eos))
        self.closers = [pieces.index(c) for c in CLOSERS if c in pieces]

    def walk(self, params: StructuredOutputsParams, seed: int) -> str | None:
        """The text of a seeded walk to EOS (None if it did not end in MAX_STEPS)."""
        rng = random.Random(seed)
        m = self.compiler.matcher(self.compiler.compile(params))
        row = np.zeros(bitmask_width(self.vocab), np.int32)
        tokens = []
        for step in range(MAX_STEPS):
            m.fill(row)
            ok = np.flatnonzero(allowed(row, self.vocab))
            assert len(ok), f"empty mask after {self.text(tokens)!r}"
            assert ok.max() < self.tok.vocab_size, "an id past the tokenizer's vocabulary"
            eos = sorted(self.eos.intersection(ok.tolist()))
            if eos and (m.is_terminated or step >= SOFT_STEPS or rng.random() < 0.5):
                assert m.accept([eos[0]]) and m.is_terminated
                return self.text(tokens)
            assert not m.is_terminated
            pick = None
            if step >= SOFT_STEPS:
                pick = next((c for c in self.closers if c in ok), None)
            if pick is None:
                # as a model would: whitespace seldom (the JSON grammar allows any amount);
                # EOS only as above
                ok = ok[~self.is_eos[ok]]
                pool = ok[~self.blank[ok]]
                pool = pool if len(pool) and rng.random() > 0.05 else ok
                pick = int(pool[rng.randrange(len(pool))])
            assert m.accept([pick]), m.error
            tokens.append(pick)
        return None

    def text(self, tokens: list[int]) -> str:
        # the tokens' bytes: the text the detokenizer gives after a prompt (a SentencePiece
        # token's leading space kept); strict UTF-8
        return b"".join(self.tok.token_bytes(t) for t in tokens).decode("utf-8")


@pytest.fixture(scope="module")
def walkers(stories_dir):
    return {"demo": Walker(load_tokenizer(demo_model_dir())),
            "stories": Walker(load_tokenizer(stories_dir)),
            "bpe": Walker(byte_level_bpe())}


TOKENIZERS = ["demo", "stories", "bpe"]
SUBSET = {"demo": 100, "stories": 10, "bpe": 10}  # the demo's byte vocabulary walks fastest


def walk_all(walker, params: StructuredOutputsParams, walks: int, seed: int = 0) -> list[str]:
    texts = [walker.walk(params, seed * 1000 + i) for i in range(walks)]
    assert None not in texts, f"{texts.count(None)} of {walks} walks did not end"
    return texts


@pytest.mark.parametrize("name", TOKENIZERS)
def test_json_schemas(walkers, name):
    w = walkers[name]
    for i, schema in enumerate(json_schemas(SUBSET[name])):
        text = w.walk(StructuredOutputsParams(json=schema), seed=i)
        assert text is not None, f"schema {i} did not end: {json.dumps(schema)}"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_regexes(walkers, name):
    w = walkers[name]
    for i, rx in enumerate(regexes(SUBSET[name])):
        text = w.walk(StructuredOutputsParams(regex=rx), seed=i)
        assert text is not None, f"regex {i} did not end: {rx}"
        assert re.fullmatch(rx, text), (rx, text)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_choice(walkers, name):
    choices = ["positive", "negative", "neutral", "New York", "a", "ab", "abc", "ü ✓"]
    texts = walk_all(walkers[name], StructuredOutputsParams(choice=choices), 20)
    assert set(texts) <= set(choices) and len(set(texts)) > 2


@pytest.mark.parametrize("name", TOKENIZERS)
def test_json_object(walkers, name):
    for text in walk_all(walkers[name], StructuredOutputsParams(json_object=True), 10):
        assert isinstance(json.loads(text), dict)
    compact = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    for text in walk_all(walkers[name], compact, 10, seed=1):
        assert isinstance(json.loads(text), dict)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not set(outside_strings) & set(" \t\r\n"), text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_grammars(walkers, name):
    for text in walk_all(walkers[name], StructuredOutputsParams(grammar=GBNF), 10):
        assert not set(text) - set("0123456789+-*/()"), text
        ast.parse(text, mode="eval")  # arithmetic: Python parses the same expressions
    for text in walk_all(walkers[name], StructuredOutputsParams(grammar=LARK), 10):
        assert LARK_TEXT.fullmatch(text), text


def test_whitespace_option(walkers):
    w = walkers["demo"]
    for compact, space_allowed in ((False, True), (True, False)):
        params = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=compact)
        m = w.compiler.matcher(w.compiler.compile(params))
        row = np.zeros(bitmask_width(w.vocab), np.int32)
        assert m.accept(list(b"{"))
        m.fill(row)
        assert allowed(row, w.vocab)[ord(" ")] == space_allowed


def test_eos_rollback_and_rejection(walkers):
    w = walkers["demo"]
    eos = w.tok.EOS_ID
    row = np.zeros(bitmask_width(w.vocab), np.int32)

    def mask(m) -> list[int]:
        m.fill(row)
        return np.flatnonzero(allowed(row, w.vocab)).tolist()

    m = w.compiler.matcher(w.compiler.compile(StructuredOutputsParams(regex="ab")))
    assert mask(m) == [ord("a")] and not m.is_terminated
    assert not w.compiler.matcher(w.compiler.compile(StructuredOutputsParams(regex="ab"))).accept(
        [eos]), "EOS before the grammar completes"
    assert m.accept(list(b"ab")) and m.is_terminated
    assert mask(m) == [eos]  # only EOS once complete
    assert m.accept([eos]) and m.is_terminated and m.error is None
    m.rollback(2)  # EOS and "b"
    assert mask(m) == [ord("b")] and not m.is_terminated
    assert m.accept([*b"b", eos]) and not m.accept(list(b"c"))

    m = w.compiler.matcher(w.compiler.compile(StructuredOutputsParams(regex="a+")))
    assert m.accept(list(b"aa")) and mask(m) == [ord("a"), eos]  # accepting, not complete
    assert m.accept([eos]) and m.is_terminated
    m.rollback(1)
    assert not m.is_terminated and m.accept(list(b"a"))

    m = w.compiler.matcher(w.compiler.compile(StructuredOutputsParams(regex="ab")))
    assert not m.accept(list(b"x")) and m.error and not m.is_terminated
    assert not m.accept([eos]), "nothing more once rejected"


def test_model_vocab_smaller_than_tokenizer():
    tok = byte_level_bpe()
    w = Walker(tok, vocab_size=tok.vocab_size - 20)
    m = w.compiler.matcher(w.compiler.compile(StructuredOutputsParams(json_object=True)))
    row = np.full(bitmask_width(w.vocab), -1, np.int32)
    m.fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert bits.any() and not bits[w.vocab:].any()


def test_fill_checks_the_row(walkers):
    w = walkers["demo"]
    m = w.compiler.matcher(w.compiler.compile(StructuredOutputsParams(regex="a")))
    for row in (np.zeros(bitmask_width(w.vocab) + 1, np.int32),
                np.zeros(bitmask_width(w.vocab), np.int64)):
        with pytest.raises(ValueError, match="bitmask row must be"):
            m.fill(row)


def test_compile_cache(walkers):
    compiler = GrammarCompiler(walkers["demo"].tok, 300, [257], cache_size=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.compiles == 1 and compiler.cache_hits == 0 and first.compile_seconds > 0
    same = [StructuredOutputsParams(json=dict(schema)),
            StructuredOutputsParams(json=json.dumps(schema, indent=2))]
    assert all(compiler.compile(p) is first for p in same)
    assert compiler.compiles == 1 and compiler.cache_hits == 2
    compact = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert compact is not first and compiler.compiles == 2
    compiler.compile(StructuredOutputsParams(regex="a"))  # the LRU's third: drops `first`
    assert compiler.compile(StructuredOutputsParams(json=schema)) is not first
    assert compiler.compiles == 4


def test_properties_come_in_the_schemas_order(walkers):
    """The schema's property order is the output's (as vLLM's): the cache key keeps it."""
    compiler = GrammarCompiler(walkers["demo"].tok, 300, [257])
    props = {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}
    orders = [props, dict(reversed(props.items()))]
    for order in orders:
        schema = {"type": "object", "properties": order, "required": list(order)}
        m = compiler.matcher(compiler.compile(StructuredOutputsParams(
            json=schema, disable_any_whitespace=True)))
        first, second = list(order)
        assert m.accept(list(f'{{"{first}":1,"{second}":2}}'.encode()))
        assert m.is_terminated
    assert compiler.compiles == 2


@pytest.mark.parametrize(("fields", "message"), [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json: .*nonsense"),
    ({"json": {"type": "object", "properties": 3}}, "structured_outputs.json: properties must"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),  # request.py's check
    ({"json": "{abc"}, "structured_outputs.json: not valid JSON"),
    ({"json": {"type": "string", "minLength": 5, "maxLength": 2}},
     "structured_outputs.json: Unsatisfiable schema"),
    ({"regex": "(ab"}, "(?s)structured_outputs.regex: .*unclosed group"),
    ({"regex": "(?=a)b"}, "(?s)structured_outputs.regex: .*look-around"),
    ({"grammar": "this is not a grammar"}, "structured_outputs.grammar: "),
    ({"grammar": "root ::= foo"}, "structured_outputs.grammar: .*foo"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar: .*foo"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),  # request.py's
])
def test_errors_name_the_field(walkers, fields, message):
    compiler = walkers["demo"].compiler
    before = compiler.compiles
    with pytest.raises(ValueError, match=message) as err:
        compiler.compile(StructuredOutputsParams(**fields))
    assert str(err.value).startswith("structured_outputs.") and "<state>" not in str(err.value)
    assert compiler.compiles == before


def test_needs_eos(walkers):
    with pytest.raises(ValueError, match="needs an EOS token"):
        GrammarCompiler(walkers["demo"].tok, 300, [])


def test_workloads_are_seeded_and_varied():
    schemas, rxs = json_schemas(100), regexes(100)
    assert schemas == json_schemas(100) and rxs == regexes(100)
    assert schemas != json_schemas(100, seed=1) and len(set(rxs)) > 90
    text = "".join(json.dumps(s) for s in schemas)
    for keyword in ("minItems", "maxItems", "enum", "required", "minimum", "maximum", "pattern",
                    "maxLength", '"boolean"', '"number"', '"integer"'):
        assert keyword in text, keyword
    nested = [s for s in schemas if '"object"' in json.dumps(list(s["properties"].values()))]
    assert len(nested) >= 10
    assert all(re.compile(rx) for rx in rxs) and any("|" in rx for rx in rxs)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_with_a_reasoning_parser_the_grammar_constrains_the_answer_after_the_thinking(parser):
    """A thinking model thinks freely and its answer after </think> matches the grammar: for
    qwen3 the answer may open with <think> (its first token commits to the tag) or go straight
    to the grammar; for deepseek_r1 the template opened the thinking."""
    from jaxserve.request import SamplingParams
    from jaxserve.structured.token_masks import TokenMask

    tok = load_tokenizer(demo_model_dir())
    vocab = tok.vocab_size
    compiler = GrammarCompiler(tok, vocab, tok.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def mask_of(reasoning_parser):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(
            json=schema, reasoning_parser=reasoning_parser))
        return TokenMask(params, vocab, frozenset(tok.eos_token_ids), tok, compiler)

    def now(mask) -> set[int]:
        row = np.zeros(bitmask_width(vocab), np.int32)
        mask.fill(row)
        return set(np.flatnonzero(allowed(row, vocab)).tolist())

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    [lt], [brace], [x], [t] = ids("<"), ids("{"), ids("x"), ids("t")
    mask = mask_of(parser)
    if parser == "qwen3":
        assert {lt, brace} <= now(mask) and x not in now(mask)  # the tag or the grammar
        assert mask.accept([lt]) and now(mask) == {t}  # the tag goes on
        assert mask.accept(ids("think>"))
    assert {lt, brace, x} <= now(mask)  # thinking: anything
    assert mask.accept(ids("x < y, so {a}. </thi")) and x in now(mask)
    assert mask.accept(ids("nk>")) and brace in now(mask) and x not in now(mask)
    assert mask.accept(ids('{"a": 42}')) and set(tok.eos_token_ids) & now(mask)
    assert not mask.accept(ids("x"))  # past the grammar's end: refused
    straight = mask_of(parser)  # an answer without thinking
    if parser == "qwen3":
        assert straight.accept(ids('{"a"')) and lt not in now(straight)
    else:  # deepseek_r1 thinks first, whatever it writes
        assert straight.accept(ids('{"a"')) and x in now(straight)
    without = mask_of(None)  # no parser: the grammar from the first token
    assert lt not in now(without) and brace in now(without)
    with pytest.raises(ValueError, match=r"structured_outputs\.reasoning_parser 'granite'"):
        mask_of("granite")
