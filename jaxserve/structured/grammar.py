"""Structured output on the host: a request's grammar (JSON schema, any JSON object, regex,
choice, Lark or GBNF grammar) compiled once per distinct value, and per request a matcher that
fills the allowed-next-token bitmask and follows the tokens the model samples (issue 32).

The engine is llguidance (chosen by bench/grammar_engines.py: ~1 ms to compile a schema at any
vocabulary, ~10 us a mask, no invalid output, no torch). Numpy only: the device applies the
bitmask, one int32 row per slot:

    row = [word 0                  ][word 1                  ] ... [word ceil(V/32) - 1]
           bit b of word w set <=> token 32 * w + b may be sampled next

Ids past the tokenizer's vocabulary (a model's padded embedding) are never allowed; once the
grammar is complete only EOS is.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import llguidance as llg
import numpy as np

from jaxserve.request import StructuredOutputsParams
from jaxserve.structured.bitmask import bitmask_width
from jaxserve.text.tokenizer import BaseTokenizer, ByteTokenizer

CACHE_SIZE = 1024  # compiled grammars kept (least recently used dropped first)
# llguidance's defaults bound a compile (lexer fuel, grammar size) to tens of ms at worst;
# verbose errors would put the parser's state and the whole grammar in a user's error message
_LIMITS = llg.LLParserLimits(verbose_errors=False)
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w-]*\s*::=")  # "root ::= ..." (llama.cpp's GBNF)
# JSON's whitespace between two tokens: none, one space, or a newline and up to 8 spaces or
# tabs of indentation. vLLM lets any run of whitespace through, and a small model that
# favours it pads the output until max_tokens (the demo model did, in 37 of 100 schemas);
# disable_any_whitespace allows none
JSON_WHITESPACE = r"(\n[ \t]{0,8}|[ ])?"


def allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask row unpacked: [vocab_size] bool, True where the token may be sampled."""
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One grammar compiled against the engine's tokenizer; shared by every request that asks
    for the same value. `template` is a never-advanced llguidance matcher each request copies."""

    kind: str  # StructuredOutputsParams.kind
    compile_seconds: float  # the build's time (a cache hit returns the same object)
    template: llg.LLMatcher = field(repr=False)


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one engine (its tokenizer and its model's
    vocabulary), caching the result, and hands each request a fresh `GrammarMatcher`.

    `compile` is safe to call from any thread (the server's request threads validate with it
    before a request is queued); llguidance drops the GIL while it builds a grammar."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE) -> None:
        """`vocab_size` is the model's vocabulary (the logits' width), which may be larger
        than the tokenizer's; `eos_token_ids` end the output once the grammar is complete."""
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("structured output needs an EOS token to end the output after "
                             "the grammar completes; the tokenizer names none")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self.cache_size = cache_size
        self.compiles = 0  # grammars built (cache misses)
        self.cache_hits = 0
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        if isinstance(tokenizer, ByteTokenizer):
            self._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer)),
                                                 eos_token=eos)
        else:  # tokenizer.json's own text: llguidance reads the HF tokenizer itself
            self._ll_tokenizer = llg.LLTokenizer(tokenizer._tk.to_str(),
                                                 n_vocab=tokenizer.vocab_size, eos_token=eos)
        # the first mask for a tokenizer builds llguidance's lazy tables: pay it here, not in
        # the first structured request's step
        warm = self._build("json_object", '{"type": "object"}', {"whitespace_flexible": True})
        GrammarMatcher(warm, self.eos_token_ids, vocab_size, self._ll_tokenizer.vocab_size).fill(
            np.zeros(bitmask_width(vocab_size), np.int32))

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar `params` asks for, from the cache or built now (~1 ms). Raises
        ValueError "structured_outputs.<field>: <llguidance's reason>" for a value llguidance
        cannot compile (not a JSON schema, a bad regex, a grammar in neither syntax)."""
        kind, source, options = _source(params)
        key = (kind, source, options.get("whitespace_flexible"))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        matcher = self._build(kind, source, options)
        compiled = CompiledGrammar(kind, time.perf_counter() - t0, matcher)
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the compiled one: microseconds)."""
        return GrammarMatcher(compiled.template.deep_copy(), self.eos_token_ids, self.vocab_size,
                              self._ll_tokenizer.vocab_size)

    def _build(self, kind: str, source: str, options: dict) -> llg.LLMatcher:
        try:
            if kind in ("json", "json_object"):
                grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=options)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(source)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", source)
            elif _GBNF_RULE.search(source):
                grammar = llg.grammar_from("gbnf", source)
            else:
                grammar = llg.grammar_from("lark", source)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        matcher = llg.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: {matcher.get_error().strip()}")
        return matcher


class GrammarMatcher:
    """One request's place in its grammar: `fill` the mask for the next token, `accept` what
    was sampled. Not thread-safe (the engine thread owns it)."""

    def __init__(self, matcher: llg.LLMatcher, eos_token_ids: frozenset[int], vocab_size: int,
                 tokenizer_vocab: int) -> None:
        self._ll = matcher
        self._eos = eos_token_ids
        self.width = bitmask_width(vocab_size)
        self._ll_width = bitmask_width(tokenizer_vocab)
        # a model vocabulary smaller than the tokenizer's (rare): llguidance writes the
        # tokenizer's width, cut here to the model's ids
        self._scratch = (np.zeros(self._ll_width, np.int32) if tokenizer_vocab > vocab_size
                         else None)
        self._last_word = np.int32(-1 if vocab_size % 32 == 0 else (1 << vocab_size % 32) - 1)
        # EOS accepted once the grammar had stopped: llguidance does not count it as a token
        # (one accepted before it stopped it does), so rollback undoes these first
        self._eos_after_stop = 0

    def accept(self, tokens: Iterable[int]) -> bool:
        """Advance by `tokens`, in order. False if the grammar rejects one (the request then
        finishes; `error` says why): a token outside the mask, or anything but EOS once the
        grammar is complete."""
        for token in tokens:
            if self._ll.is_error():  # it would still take EOS
                return False
            if self._ll.is_stopped():
                if token not in self._eos:
                    return False
                self._eos_after_stop += 1
            elif not self._ll.consume_token(token):
                return False
        return True

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-next-token bitmask into `row` ([bitmask_width(V)] int32, in
        place). Once the grammar is complete (or rejected a token) only EOS is allowed."""
        if row.shape != (self.width,) or row.dtype != np.int32 or not row.flags.c_contiguous:
            raise ValueError(f"bitmask row must be a contiguous int32 array of shape "
                             f"({self.width},), got {row.dtype} {row.shape}")
        if self._scratch is None:
            self._ll.unsafe_compute_mask_ptr(row.ctypes.data, 4 * self._ll_width)
            row[self._ll_width:] = 0
        else:
            self._ll.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            row[:] = self._scratch[:self.width]
            row[-1] &= self._last_word

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow (or already has)."""
        return self._ll.is_stopped() and not self._ll.is_error()

    @property
    def error(self) -> str | None:
        """Why the grammar rejected a token, once it has."""
        return self._ll.get_error() or None

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (speculative tokens the model did not keep)."""
        undo_eos = min(n, self._eos_after_stop)
        self._eos_after_stop -= undo_eos
        if n > undo_eos and not self._ll.rollback(n - undo_eos):
            raise ValueError(f"cannot roll back {n} tokens: {self._ll.get_error()}")


_executor: llg.LLExecutor | None = None
# From this many rows a call's masks are computed by llguidance's thread pool: handing work
# to it costs about 0.4 ms on a busy 2-core host, where a warm grammar's mask takes 5-10 us
# (a new grammar's first masks 20-50 us)
PARALLEL_ROWS = 32


def fill_rows(matchers: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """`matcher.fill(bitmask[row])` for each pair: from PARALLEL_ROWS rows on in parallel by
    llguidance's threads (the GIL released) where their layout allows, else one by one."""
    global _executor
    if len(matchers) < PARALLEL_ROWS:
        for matcher, row in matchers:
            matcher.fill(bitmask[row])
        return
    width = bitmask.shape[1]
    direct = [(m._ll, row) for m, row in matchers if m._scratch is None and m._ll_width == width]
    if len(direct) == len(matchers) and bitmask.flags.c_contiguous and (
            bitmask.dtype == np.int32):
        if _executor is None:
            _executor = llg.LLExecutor()
        _executor.unsafe_compute_mask_ptr(direct, bitmask.ctypes.data, width * 4,
                                          bitmask.shape[0])
        return
    for matcher, row in matchers:
        matcher.fill(bitmask[row])


def _source(params: StructuredOutputsParams) -> tuple[str, str, dict]:
    """(kind, llguidance source text, JSON options) of a request's structured output. A
    schema's text is re-serialised as given (a dict and its text share a cache entry); its
    keys are not sorted: the output's properties come in the schema's order."""
    kind = params.kind
    json_options = ({"whitespace_flexible": False} if params.disable_any_whitespace else
                    {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE})
    if kind == "json_object":
        return kind, '{"type": "object"}', json_options
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json: not JSON: {e}") from None
        # defaults, not overrides: a schema's own "x-guidance" options win (as in vLLM)
        return kind, text, json_options
    if kind == "choice":
        return kind, json.dumps(list(params.choice)), {}
    return kind, getattr(params, kind), {}


class _ByteVocab:
    """What llguidance.TokenizerWrapper reads from a tokenizer, for the demo's ByteTokenizer:
    each id's bytes, special ids marked by llguidance's b"\\xff" prefix (never text)."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id, self.bos_token_id = tokenizer.EOS_ID, tokenizer.BOS_ID
        self.special_token_ids = sorted(tokenizer.SPECIAL_TEXT)
        self.tokens = [bytes([i]) for i in range(tokenizer.NUM_BYTES)] + [
            b"\xff" + tokenizer.SPECIAL_TEXT[i].encode() for i in self.special_token_ids]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)
