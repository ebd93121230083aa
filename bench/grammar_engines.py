"""Structured output's grammar engines, xgrammar and llguidance, on jaxserve's tokenizers (issue 32).

    python bench/grammar_engines.py                        # all engines x tokenizers, ~10 s
    python bench/grammar_engines.py --tokenizers bpe --bpe-vocab 32768   # a bigger BPE (~15 s)
    python bench/grammar_engines.py --engines llguidance --tokenizers stories --json out.json

Needs `pip install xgrammar llguidance jsonschema` (xgrammar pulls in torch and transformers: it
imports both). An engine that is not installed is skipped.

Tokenizers (all built here, none downloaded):
  demo     the built-in demo model's ByteTokenizer (258 ids: 256 bytes, BOS, EOS)
  stories  stories260K's tokenizer.json: Llama-style SentencePiece BPE with byte fallback, 512 ids
  bpe      a Hugging Face byte-level BPE (as tests/bpe_tokenizer.py builds one) trained here on
           the Python standard library's sources, `--bpe-vocab` ids (4,096 by default)

For each engine x tokenizer it measures the tokenizer info's build time, then for each grammar
(json_object, 5 JSON schemas of growing size, an e-mail regex, a choice of 3 strings, a GBNF
arithmetic grammar):
  compile   grammar source -> a matcher's ready state. xgrammar: GrammarCompiler.compile_*
            with the cache cleared (median of --reps), and `hit`: the same call answered by the
            cache; `matcher`: GrammarMatcher(compiled). llguidance has no compile step or cache:
            grammar_from_* + LLMatcher(tokenizer, grammar), which builds the parser (its lexer
            is built lazily, during the masks: see `first`).
  walk      a seeded random walk: at each step fill the int32 bitmask (ceil(V/32) words, in
            place), pick a random allowed token, accept it; after --soft-steps it steers to an
            end (EOS when allowed, else a closing token) and stops at --max-steps. `first` is the
            first mask's time, `mask` the mean and p99 of the others, `accept` the mean time to
            advance by one token; all in microseconds.
  check     the walk's text (the tokens' bytes as jaxserve's `token_bytes` gives them) must
            parse as JSON and validate against the schema (jsonschema), fully match the regex,
            be one of the choices, or parse as the arithmetic grammar; "replay": the matcher
            accepts a known valid text's tokens (greedy longest-match tokenization) with each
            token allowed by the mask before it, and then EOS; "rollback": rolling back 5
            tokens and accepting them again works.

Prints a table and, last, the whole result as one JSON line (or to --json).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' trainer, llguidance: one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxserve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer  # noqa: E402

STORIES_DIR = Path("/work/shared/models/stories260K")

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


# ---------------------------------------------------------------------------------------------
# Engines: one adapter each, the calls jaxserve would make


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, threads: int):
        import xgrammar as xgr
        self.xgr, self.threads = xgr, threads

    @staticmethod
    def version() -> str:
        return importlib.metadata.version("xgrammar")

    def build_info(self, tok) -> None:
        """TokenizerInfo from the vocabulary (no transformers wrapper). Workaround: xgrammar
        takes a special token's text ("<unk>", "<s>") as text and would allow it inside a JSON
        string; an empty string makes it special (never allowed). EOS ids are its stop tokens."""
        xgr = self.xgr
        specials = special_ids(tok)
        if isinstance(tok, ByteTokenizer):
            vocab = [bytes([i]) for i in range(tok.NUM_BYTES)] + [b""] * (
                tok.vocab_size - tok.NUM_BYTES)
            vocab_type, prefix_space = xgr.VocabType.RAW, False
        else:
            hf = tok._tk
            vocab = [""] * tok.vocab_size
            for piece, i in hf.get_vocab(with_added_tokens=True).items():
                if i < tok.vocab_size and i not in specials:
                    vocab[i] = piece
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
            vocab_type, prefix_space = meta["vocab_type"], meta["add_prefix_space"]
        self.info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=tok.vocab_size,
                                      stop_token_ids=sorted(tok.eos_token_ids),
                                      add_prefix_space=prefix_space)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads,
                                            cache_enabled=True)
        self.vocab_type = vocab_type.name

    def compile(self, kind: str, source, cached: bool = False):
        if not cached:
            self.compiler.clear_cache()
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(source), any_whitespace=True)
        if kind == "regex":
            return c.compile_regex(source)
        if kind == "choice":  # as vLLM's xgrammar backend writes a choice
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in source))
        return c.compile_grammar(source)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def fill(m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask, 0)  # DLPack: a numpy int32 (1, ceil(V/32)) array

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.accept_token(token)

    @staticmethod
    def finished(m) -> bool:
        return m.is_terminated()

    @staticmethod
    def rollback(m, n: int) -> None:
        m.rollback(n)

    @staticmethod
    def error(m) -> str:
        return ""


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, threads: int):
        import llguidance
        import llguidance.numpy
        self.llg = llguidance
        self.fill_np = llguidance.numpy.fill_next_token_bitmask

    @staticmethod
    def version() -> str:
        return importlib.metadata.version("llguidance")

    def build_info(self, tok) -> None:
        """LLTokenizer from tokenizer.json's text (no transformers), or, for the byte tokenizer,
        from its token bytes through TokenizerWrapper (specials as b"\\xff" + name)."""
        llg = self.llg
        eos = sorted(tok.eos_token_ids)
        if isinstance(tok, ByteTokenizer):
            self.tok = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tok)),
                                       n_vocab=tok.vocab_size, eos_token=eos)
            self.vocab_type = "token bytes"
        else:
            self.tok = llg.LLTokenizer(tok._tk.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
            self.vocab_type = "tokenizer.json"

    def compile(self, kind: str, source, cached: bool = False):
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(source))
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(source)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(source))
        else:
            grammar = llg.grammar_from("gbnf", source)
        m = llg.LLMatcher(self.tok, grammar, log_level=0)  # errors are read with get_error
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask) -> None:
        self.fill_np(m, bitmask, 0)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.consume_token(token)

    @staticmethod
    def finished(m) -> bool:
        return m.is_stopped()

    @staticmethod
    def rollback(m, n: int) -> None:
        if not m.rollback(n):
            raise RuntimeError(m.get_error())

    @staticmethod
    def error(m) -> str:
        return m.get_error()


class _ByteVocab:
    """What llguidance.TokenizerWrapper needs from a tokenizer, for jaxserve's ByteTokenizer."""

    def __init__(self, tok: ByteTokenizer):
        self.eos_token_id, self.bos_token_id = tok.EOS_ID, tok.BOS_ID
        self.tokens = [bytes([i]) for i in range(tok.NUM_BYTES)] + [
            b"\xff" + tok.SPECIAL_TEXT[i].encode() for i in range(tok.NUM_BYTES, tok.vocab_size)]
        self.special_token_ids = sorted(tok.SPECIAL_TEXT)

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


ENGINES = {"xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine}


# ---------------------------------------------------------------------------------------------
# Measurements


def _ms(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e6


def allowed_ids(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])


# steering to an end: a quote closes a string (or opens a short one that closes next), then
# brackets close what is open, then a digit ends a number
CLOSERS = [b'"', b"}", b"]", b")", b"0", b"1", b"5"]


def walk(engine, compiled, tok, name: str, rng: random.Random, soft: int, hard: int) -> dict:
    """A seeded random walk through the grammar; masks and accepts timed."""
    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    eos_set = set(eos)
    closer_ids = {}
    for i in range(vocab):
        b = tok.token_bytes(i)
        if b in CLOSERS and i not in special_ids(tok):
            closer_ids.setdefault(b, i)
    blank = np.array([i not in eos_set and not tok.token_bytes(i).strip()
                      for i in range(vocab)])
    bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    m = engine.matcher(compiled)
    masks, accepts, tokens, sizes = [], [], [], []
    status = "max steps"
    for step in range(hard):
        t0 = time.perf_counter_ns()
        engine.fill(m, bitmask)
        masks.append(time.perf_counter_ns() - t0)
        allowed = allowed_ids(bitmask, vocab)
        sizes.append(len(allowed))
        if len(allowed) == 0:
            status = "empty mask"
            break
        allowed_set = set(allowed.tolist())
        choice = None
        if step >= soft:  # steer to an end
            if eos_set & allowed_set:
                choice = min(eos_set & allowed_set)
            else:
                for b in CLOSERS:
                    if closer_ids.get(b) in allowed_set:
                        choice = closer_ids[b]
                        break
        if choice is None:
            # as a model would: whitespace-only tokens rarely (JSON's whitespace is unbounded)
            pool = allowed[~blank[allowed]]
            if len(pool) == 0 or rng.random() < 0.05:
                pool = allowed
            choice = int(pool[rng.randrange(len(pool))])
        t0 = time.perf_counter_ns()
        ok = engine.accept(m, choice)
        accepts.append(time.perf_counter_ns() - t0)
        if not ok:
            status = f"rejected an allowed token {choice}: {engine.error(m)[:200]}"
            break
        tokens.append(choice)
        if choice in eos_set:
            status = "eos"
            break
    finished = status == "eos" and engine.finished(m)
    text = b"".join(tok.token_bytes(t) for t in tokens if t not in eos_set)
    check = check_text(name, text) if finished else status
    rollback = rollback_eos = "n/a"
    if finished and len(tokens) > 5:
        rollback = rollback_check(engine, compiled, tokens[:-1], 5, 5, tokens[-1])
        # undo 5 tokens, the final EOS among them, and accept them again
        rollback_eos = rollback_check(engine, compiled, tokens, 5, 5)
        if rollback_eos != "ok" and rollback_check(engine, compiled, tokens, 4, 5) == "ok":
            rollback_eos = "EOS not counted"  # rollback(n) after EOS undoes EOS and n tokens
    us = [x / 1000 for x in masks]
    rest = us[1:] or us
    return {
        "steps": len(tokens), "finished": finished, "check": check, "rollback": rollback,
        "rollback_eos": rollback_eos,
        "text": text.decode("utf-8", "replace")[:300],
        "first_mask_us": round(us[0], 1),
        "mask_mean_us": round(statistics.fmean(rest), 1),
        "mask_p50_us": round(statistics.median(rest), 1),
        "mask_p99_us": round(float(np.percentile(rest, 99)), 1),
        "mask_max_us": round(max(rest), 1),
        "accept_mean_us": round(statistics.fmean(accepts) / 1000, 1) if accepts else None,
        "allowed_mean": round(statistics.fmean(sizes), 1),
    }


def rollback_check(engine, compiled, tokens: list[int], undo: int, redo: int,
                   eos: int | None = None) -> str:
    """On a fresh matcher: accept `tokens`, roll back `undo`, accept the last `redo` of them
    again (then `eos`, when given); the matcher must end finished."""
    m = engine.matcher(compiled)
    try:
        ok = all(engine.accept(m, t) for t in tokens)
        engine.rollback(m, undo)
        ok = ok and all(engine.accept(m, t) for t in tokens[-redo:])
        if eos is not None:
            ok = ok and engine.accept(m, eos)
        return "ok" if ok and engine.finished(m) else f"failed: {engine.error(m)[:100]}"
    except Exception as e:
        return f"failed: {e}"[:120]


def replay(engine, compiled, tok, name: str, canonical: bool = True) -> dict:
    """The tokens of a known valid text, each checked against the mask before it, then EOS.
    `canonical`: the tokenizer's own tokenization, else a longest-match one."""
    vocab, eos = tok.vocab_size, min(tok.eos_token_ids)
    data = example_text(name).encode()
    ids = canonical_tokenize(tok, data) if canonical else greedy_tokenize(tok, data)
    if ids is None:
        return {"check": "no canonical tokenization found"}
    ids = [*ids, eos]
    bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    m = engine.matcher(compiled)
    masks = []
    for n, t in enumerate(ids):
        t0 = time.perf_counter_ns()
        engine.fill(m, bitmask)
        masks.append(time.perf_counter_ns() - t0)
        if not (bitmask[0, t // 32] >> (t % 32)) & 1:
            return {"check": f"token {n} ({tok.token_bytes(t)!r}) masked out", "tokens": len(ids)}
        if not engine.accept(m, t):
            return {"check": f"token {n} rejected: {engine.error(m)[:200]}", "tokens": len(ids)}
    ok = engine.finished(m)
    return {"check": "ok" if ok else "not finished after EOS", "tokens": len(ids),
            "mask_mean_us": round(statistics.fmean(masks[1:]) / 1000, 1)}


def median_ms(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        out = fn()
        times.append(_ms(t0))
    return statistics.median(times), out


def bench_engine(engine, tok_name: str, tok, args) -> dict:
    t_info, _ = median_ms(lambda: engine.build_info(tok), args.reps)
    engine.compile("json", {"type": "string"})  # warm up the engine's first-call costs
    result = {"engine": engine.name, "tokenizer": tok_name, "vocab": tok.vocab_size,
              "vocab_type": engine.vocab_type, "info_ms": round(t_info, 2), "grammars": {}}
    for gi, name in enumerate(GRAMMARS):
        kind, source = grammar_spec(name)
        row: dict = {}
        try:
            t_compile, compiled = median_ms(lambda k=kind, s=source: engine.compile(k, s), args.reps)
        except Exception as e:
            result["grammars"][name] = {"error": f"compile: {e}"[:300]}
            continue
        row["compile_ms"] = round(t_compile, 3)
        if engine.name == "xgrammar":
            t_hit, compiled = median_ms(lambda k=kind, s=source: engine.compile(k, s, cached=True),
                                        args.reps)
            row["cache_hit_ms"] = round(t_hit, 4)
        t_matcher, _ = median_ms(lambda c=compiled: engine.matcher(c), args.reps)
        row["matcher_ms"] = round(t_matcher, 4)
        rng = random.Random(args.seed * 1000 + gi)
        row["walk"] = walk(engine, compiled, tok, name, rng, args.soft_steps, args.max_steps)
        row["replay"] = replay(engine, compiled, tok, name)
        row["replay_noncanonical"] = replay(engine, compiled, tok, name, canonical=False)
        result["grammars"][name] = row
    return result


# ---------------------------------------------------------------------------------------------


def print_table(results: list[dict]) -> None:
    head = (f"{'engine':10} {'tokenizer':9} {'V':>5} {'grammar':11} {'compile':>8} {'hit':>6} "
            f"{'first':>7} {'mask':>7} {'p99':>7} {'max':>7} {'accept':>6} {'steps':>5}  walk / replay / non-canonical")
    print(head)
    print(f"{'':10} {'':9} {'':>5} {'':11} {'ms':>8} {'ms':>6} {'us':>7} {'us':>7} {'us':>7} "
          f"{'us':>7} {'us':>6}")
    print("-" * len(head))
    for r in results:
        print(f"{r['engine']:10} {r['tokenizer']:9} {r['vocab']:>5} {'(info)':11} "
              f"{r['info_ms']:>8.2f}   tokenizer info ({r['vocab_type']})")
        for name, g in r["grammars"].items():
            if "error" in g:
                print(f"{'':10} {'':9} {'':>5} {name:11} {g['error']}")
                continue
            w = g["walk"]
            hit = f"{g['cache_hit_ms']:.3f}" if "cache_hit_ms" in g else "-"
            notes = w["check"] if w["check"] == "ok" else f"[{w['check'][:40]}]"
            notes += " / " + ("ok" if g["replay"]["check"] == "ok"
                              else f"[{g['replay']['check'][:40]}]")
            notes += " / " + ("ok" if g["replay_noncanonical"]["check"] == "ok" else "masked")
            for key in ("rollback", "rollback_eos"):
                if w[key] not in ("ok", "n/a"):
                    notes += f"; {key}: {w[key][:40]}"
            print(f"{'':10} {'':9} {'':>5} {name:11} {g['compile_ms']:>8.2f} {hit:>6} "
                  f"{w['first_mask_us']:>7.1f} {w['mask_mean_us']:>7.1f} {w['mask_p99_us']:>7.1f} {w['mask_max_us']:>7.1f} "
                  f"{w['accept_mean_us']:>6.1f} {w['steps']:>5}  {notes}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="xgrammar,llguidance")
    ap.add_argument("--tokenizers", default="demo,stories,bpe")
    ap.add_argument("--bpe-vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3, help="compile timings: median of this many")
    ap.add_argument("--soft-steps", type=int, default=150, help="walk: steer to an end after")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="xgrammar's compiler threads (the machine has 2 cores)")
    ap.add_argument("--json", help="write the results here instead of printing the JSON line")
    args = ap.parse_args(argv)

    engines = []
    for name in args.engines.split(","):
        t0 = time.perf_counter_ns()
        try:
            engine = ENGINES[name](args.threads)
        except ImportError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        engines.append((engine, _ms(t0)))
    toks = load_tokenizers(args.tokenizers.split(","), args.bpe_vocab)

    results = [bench_engine(engine, tname, tok, args)
               for engine, _ in engines for tname, tok in toks.items()]
    meta = {"versions": {e.name: e.version() for e, _ in engines},
            "import_ms": {e.name: round(t, 1) for e, t in engines},
            "python": sys.version.split()[0], "xgrammar_threads": args.threads,
            "seed": args.seed}
    print(f"versions {meta['versions']}; import ms {meta['import_ms']}")
    print_table(results)
    out = {"meta": meta, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    else:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
