"""The workloads bench/grammar_engines.py runs each grammar engine on (issue 32): grammars, a
valid text of each and a check of any output, and jaxserve's tokenizers (all built here, none
downloaded):

  demo     the built-in demo model's ByteTokenizer (258 ids: 256 bytes, BOS, EOS)
  stories  stories260K's tokenizer.json: Llama-style SentencePiece BPE with byte fallback, 512 ids
  bpe      a Hugging Face byte-level BPE (as tests/bpe_tokenizer.py builds one) trained here on
           the Python standard library's sources, `vocab_size` ids

Grammars: json_object, 5 JSON schemas of growing size, an e-mail regex, a choice of 3 strings,
a GBNF arithmetic grammar.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from jaxserve.text.tokenizer import Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = Path(__file__).resolve().parents[1] / "models" / "stories260K"

# ---------------------------------------------------------------------------------------------
# Grammars

SCHEMAS = {
    "schema1": {  # two required fields
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "schema2": {  # enum, boolean, number ranges
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 10000},
            "status": {"enum": ["active", "inactive", "banned"]},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
            "verified": {"type": "boolean"},
        },
        "required": ["id", "status", "score"],
    },
    "schema3": {  # arrays, a nested object, a string pattern
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                     "minItems": 1, "maxItems": 4},
            "ratings": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5},
                        "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string", "maxLength": 25},
                               "city": {"type": "string", "maxLength": 15},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "tags", "address"],
        "additionalProperties": False,
    },
    "schema4": {  # an order: arrays of objects, patterns, enums, ranges
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "email": {"type": "string",
                              "pattern": "^[a-z0-9.]{1,12}@[a-z0-9]{1,10}\\.(com|org|net)$"},
                    "tier": {"enum": ["free", "pro", "enterprise"]},
                },
                "required": ["name", "email", "tier"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000},
                        "gift": {"type": "boolean"},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            },
            "shipping": {"enum": ["standard", "express", "pickup"]},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
            "notes": {"type": ["string", "null"], "maxLength": 40},
        },
        "required": ["order_id", "customer", "items", "shipping", "date"],
        "additionalProperties": False,
    },
    "schema5": {  # $defs, $ref, recursion, anyOf, const, nested arrays
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["dir", "file", "link"]},
                    "name": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,11}$"},
                    "size": {"type": "integer", "minimum": 0, "maximum": 1000000},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                 "maxItems": 3},
                },
                "required": ["kind", "name"],
                "additionalProperties": False,
            },
            "point": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                      "maxItems": 2},
        },
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "root": {"$ref": "#/$defs/node"},
            "owner": {"anyOf": [
                {"type": "object", "properties": {"user": {"type": "string", "maxLength": 12}},
                 "required": ["user"], "additionalProperties": False},
                {"type": "object", "properties": {"group": {"type": "integer", "minimum": 0}},
                 "required": ["group"], "additionalProperties": False},
            ]},
            "polygon": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 4},
            "meta": {"type": "object", "additionalProperties": {"type": "string",
                                                                "maxLength": 10}},
        },
        "required": ["version", "root", "owner"],
        "additionalProperties": False,
    },
}

EXAMPLES = {  # a valid instance of each, replayed through the matcher
    "json_object": {"a": [1, 2.5, "x"], "b": {"c": None, "d": True}},
    "schema1": {"name": "Lily", "age": 7},
    "schema2": {"id": 42, "status": "active", "score": 97.5, "verified": False},
    "schema3": {"title": "A day at the park", "tags": ["fun", "sun"], "ratings": [5, 4],
                "address": {"street": "1 Elm St", "city": "Springfield", "zip": "12345"}},
    "schema4": {"order_id": "ORD-123456",
                "customer": {"name": "Ann", "email": "ann.b@mail.com", "tier": "pro"},
                "items": [{"sku": "ABC-1234", "qty": 2, "price": 9.99},
                          {"sku": "XYZ-0001", "qty": 1, "price": 100, "gift": True}],
                "shipping": "express", "date": "2024-02-29", "notes": None},
    "schema5": {"version": 2,
                "root": {"kind": "dir", "name": "home", "children": [
                    {"kind": "file", "name": "a_txt", "size": 12},
                    {"kind": "dir", "name": "src", "children": []}]},
                "owner": {"group": 100}, "polygon": [[0, 0], [1.5, 2]],
                "meta": {"k": "v"}},
}

EMAIL_REGEX = r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,20}\.[a-z]{2,6}"
CHOICES = ["positive", "negative", "neutral"]
GBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= "0" | [1-9] [0-9]{0,5}
"""
ARITH_EXAMPLE = "(12+3)*4-100/(5-2)"

GRAMMARS = ["json_object", *SCHEMAS, "regex", "choice", "ebnf"]


def grammar_spec(name: str) -> tuple[str, object]:
    """(kind, source) of a grammar: kind in json, regex, choice, ebnf."""
    if name == "json_object":
        return "json", {"type": "object"}
    if name in SCHEMAS:
        return "json", SCHEMAS[name]
    if name == "regex":
        return "regex", EMAIL_REGEX
    if name == "choice":
        return "choice", CHOICES
    return "ebnf", GBNF


def example_text(name: str) -> str:
    if name in EXAMPLES:
        return json.dumps(EXAMPLES[name])
    return {"regex": "ann.b+x@mail-1.com", "choice": "neutral", "ebnf": ARITH_EXAMPLE}[name]


def check_text(name: str, raw: bytes) -> str:
    """'ok' or what is wrong with a finished walk's output."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8: {e}"
    kind, source = grammar_spec(name)
    if kind == "json":
        import jsonschema
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"not JSON: {e}"
        try:
            jsonschema.validate(value, source)
        except jsonschema.ValidationError as e:
            return f"invalid: {e.message}"
        return "ok"
    if kind == "regex":
        return "ok" if re.fullmatch(source, text) else "no full match"
    if kind == "choice":
        return "ok" if text in source else "not a choice"
    if set(text) - set("0123456789+-*/()"):
        return "stray characters"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        return f"does not parse: {e.msg}"
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    bad = [type(n).__name__ for n in ast.walk(tree) if not isinstance(n, allowed)]
    return f"not in grammar: {bad}" if bad else "ok"


# ---------------------------------------------------------------------------------------------
# Tokenizers


def stdlib_corpus(n_chars: int) -> list[str]:
    from jaxserve.demo.data import source_files, stdlib_root
    root, texts, total = stdlib_root(), [], 0
    for rel in source_files(root):
        texts.append((root / rel).read_text(errors="replace"))
        total += len(texts[-1])
        if total >= n_chars:
            break
    return texts


def byte_level_bpe(vocab_size: int) -> Tokenizer:
    """A byte-level BPE as tests/bpe_tokenizer.py makes one, with `vocab_size` ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(stdlib_corpus(max(3_000_000, 300 * vocab_size)), trainer)
    return Tokenizer(hf, {"bos_token": "<s>", "eos_token": "</s>"})


def load_tokenizers(names: list[str], bpe_vocab: int) -> dict[str, object]:
    out = {}
    for name in names:
        if name == "demo":
            out[name] = load_tokenizer(REPO / "jaxserve" / "demo" / "checkpoint")
        elif name == "stories":
            out[name] = load_tokenizer(STORIES_DIR)
        elif name == "bpe":
            out[name] = byte_level_bpe(bpe_vocab)
        else:
            raise SystemExit(f"unknown tokenizer {name}")
    return out


def special_ids(tok) -> set[int]:
    """Ids no grammar may produce as text: BOS, EOS, every special (EOS ends the output)."""
    ids = set(tok.all_special_ids) | set(tok.eos_token_ids)
    if tok.bos_token_id is not None:
        ids.add(tok.bos_token_id)
    return ids


def _bytes_of(tok, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes(i) for i in ids)


def canonical_tokenize(tok, data: bytes) -> list[int] | None:
    """The tokenizer's own tokenization of `data` as a continuation: encode(text), or, where
    the tokenizer adds a leading space (SentencePiece's "▁"), the tokens after a newline."""
    text = data.decode()
    ids = tok.encode(text, add_special_tokens=False)
    if _bytes_of(tok, ids) == data:
        return ids
    ids = tok.encode("\n" + text, add_special_tokens=False)
    for k in range(1, len(ids)):
        if _bytes_of(tok, ids[:k]).strip(b" ") == b"\n" and _bytes_of(tok, ids[k:]) == data:
            return ids[k:]
    return None


def greedy_tokenize(tok, data: bytes) -> list[int]:
    """Longest-match tokenization over the tokens' bytes (specials excluded; a byte-fallback
    piece only for a byte no other token is): a valid, usually not canonical, tokenization."""
    table, specials = {}, special_ids(tok)
    order = sorted(range(tok.vocab_size), key=lambda i: i in tok.byte_fallback_ids)
    for i in order:
        if i not in specials:
            table.setdefault(tok.token_bytes(i), i)
    longest = max(map(len, table))
    ids, at = [], 0
    while at < len(data):
        for n in range(min(longest, len(data) - at), 0, -1):
            if (i := table.get(data[at:at + n])) is not None:
                ids.append(i)
                at += n
                break
        else:
            raise ValueError(f"no token for byte {data[at]:#x}")
    return ids
