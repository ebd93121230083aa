"""Which tokens a request may sample next: the host half of the sampler controls (numpy only).

A request that asks for `allowed_token_ids`, `bad_words`, `min_tokens` or structured output
gets a `TokenMask` when it is added. Each step that samples it, the runner asks the mask for the
row's bitmask (bit t % 32 of word t // 32 set: token t allowed; the device applies exactly this
layout, `model.sampler.allowed_mask`), once the output processor has given the request every
token sampled before (`accept`). The definitions are vLLM's:

- allowed_token_ids: only those;
- bad_words: each word is encoded alone and after a space (vLLM's two forms); a one-token word
  is never sampled, a longer one's last token is masked while the output ends with the rest;
- min_tokens: EOS and the stop ids are masked until the output holds min_tokens tokens;
- structured output: the grammar matcher's next tokens (grammar.py); with a reasoning parser
  (`StructuredOutputsParams.reasoning_parser`), those of the answer after the thinking: a
  thinking model thinks freely, and the grammar starts after `</think>`. For qwen3 the answer
  may open with `<think>` (a token that begins the tag commits to it: its other tokens are
  forced) or go straight to the grammar; for deepseek_r1 the template opened the thinking.
"""

from typing import TYPE_CHECKING

import numpy as np

from jaxserve.request import SamplingParams
from jaxserve.structured.bitmask import bitmask_width, pack_bits
from jaxserve.text.tokenizer import BaseTokenizer

if TYPE_CHECKING:
    from jaxserve.structured.grammar import GrammarCompiler, GrammarMatcher


def bad_word_ids(words: tuple[str, ...], tokenizer: BaseTokenizer | None,
                 vocab_size: int) -> list[list[int]]:
    """vLLM's encoding of bad_words: each word as written (leading spaces stripped) and, where
    the tokenizer gives a different first token for it, after a space."""
    if words and tokenizer is None:
        raise ValueError("bad_words: this model has no tokenizer to encode them")
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        forms = [plain] + ([spaced] if spaced and plain and spaced[0] != plain[0]
                           and len(spaced) == len(plain) else [])
        for ids in forms:
            if not ids:
                continue
            if max(ids) >= vocab_size:
                raise ValueError(f"bad_words: {word!r} encodes to token {max(ids)}, outside "
                                 f"the model's vocabulary of {vocab_size}")
            out.append(ids)
    return out


class TokenMask:
    """One request's allowed next tokens (see the module docstring)."""

    def __init__(self, params: SamplingParams, vocab_size: int, stop_ids: frozenset[int],
                 tokenizer: BaseTokenizer | None, compiler: "GrammarCompiler | None"):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        allowed = np.ones((vocab_size,), bool)
        if params.allowed_token_ids is not None:
            allowed[:] = False
            allowed[list(params.allowed_token_ids)] = True
        self.bad: list[list[int]] = bad_word_ids(params.bad_words, tokenizer, vocab_size)
        for ids in self.bad:
            if len(ids) == 1:
                allowed[ids[0]] = False
        self.bad = [ids for ids in self.bad if len(ids) > 1]
        self.static = pack_bits(allowed)
        self.min_tokens = params.min_tokens
        self.stop_ids = sorted(t for t in stop_ids if t < vocab_size)
        self.matcher: GrammarMatcher | None = None
        if params.structured_outputs is not None:
            if compiler is None:
                raise ValueError("structured_outputs: this model has no tokenizer to match a "
                                 "grammar against")
            self.matcher = compiler.matcher(compiler.compile(params.structured_outputs))
        self.output: list[int] = []  # what accept has given it (bad words look at its end)
        self.rejected = False  # the grammar refused a token (the engine ends the request)
        # the thinking before the grammar's answer: "open" (qwen3: the tag may come),
        # "tag" (its tokens under way), "thinking", or "answer" (the grammar's)
        self.phase = "answer"
        parser = params.structured_outputs and params.structured_outputs.reasoning_parser
        if self.matcher is not None and parser is not None:
            from jaxserve.text.reasoning import END, START, check_parser

            try:
                check_parser(parser)
            except ValueError as error:
                raise ValueError(f"structured_outputs.{error}") from None

            self._start = tokenizer.encode(START, add_special_tokens=False)
            self._end = tokenizer.encode(END, add_special_tokens=False)
            self.phase = "open" if parser == "qwen3" else "thinking"
            self._tag = 0  # tokens of the start tag sampled

    def accept(self, tokens: list[int]) -> bool:
        """The tokens the request kept, in order; False once the grammar refuses one."""
        self.output.extend(tokens)
        if self.phase != "answer":
            tokens = self._think(tokens)
        if self.matcher is not None and not self.rejected and tokens and not (
                self.matcher.accept(tokens)):
            self.rejected = True
        return not self.rejected

    def _think(self, tokens: list[int]) -> list[int]:
        """Follow the thinking through `tokens`; those of the answer after it (the grammar's)."""
        for i, token in enumerate(tokens):
            if self.phase in ("open", "tag"):
                if self.phase == "open" and token != self._start[0]:
                    self.phase = "answer"
                    return tokens[i:]
                self._tag += 1
                self.phase = "thinking" if self._tag == len(self._start) else "tag"
            elif self.output[:len(self.output) - len(tokens) + i + 1][-len(self._end):] == (
                    self._end):
                self.phase = "answer"
                return tokens[i + 1:]
        return []

    @property
    def grammar(self) -> "GrammarMatcher | None":
        """The matcher whose mask `restrict` expects in the row (None: no grammar to ask)."""
        return None if self.rejected or self.phase in ("tag", "thinking") else self.matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's bitmask into `row` ([width] int32)."""
        if self.grammar is not None:
            self.grammar.fill(row)
        self.restrict(row)

    def restrict(self, row: np.ndarray) -> None:
        """The rest of `fill`, once the grammar's mask is in `row` (when it has a grammar)."""
        if self.phase == "open":  # the grammar's first tokens, or the thinking's tag
            row[self._start[0] // 32] |= _bit(self._start[0])
        if self.phase == "tag":  # the tag goes on to its end
            row[:] = 0
            row[self._start[self._tag] // 32] = _bit(self._start[self._tag])
            row &= self.static
        elif self.grammar is not None:
            row &= self.static
        else:
            row[:] = self.static
        out = self.output
        for ids in self.bad:
            n = len(ids) - 1
            if len(out) >= n and out[len(out) - n:] == ids[:-1]:
                _clear(row, ids[-1])
        if len(out) < self.min_tokens:
            for token in self.stop_ids:
                _clear(row, token)


def _bit(token: int) -> np.int32:
    return np.int32(1 << (token % 32)) if token % 32 != 31 else np.int32(-(1 << 31))


def _clear(row: np.ndarray, token: int) -> None:
    row[token // 32] &= np.int32(~(1 << (token % 32)) if token % 32 != 31 else 0x7FFFFFFF)


def chunk_bitmask(chunks, vocab_size: int, rows: int | None = None) -> np.ndarray:
    """[rows, vocab / 32] int32: the tokens each chunk's request may sample now (its
    grammar's and its own limits'; -1 words: every token), a row per chunk (rows past them:
    padding, every token)."""
    rows = len(chunks) if rows is None else rows
    bitmask = np.full((rows, bitmask_width(vocab_size)), -1, np.int32)
    masks = []
    for i, chunk in enumerate(chunks):
        request = chunk.request
        mask = request.token_mask
        if mask is not None and chunk.num_samples and not request.status.finished:
            masks.append((i, mask))
    # the grammars' masks (structured_output.fill_rows), then each row's own limits
    grammars = [(m.grammar, i) for i, m in masks if m.grammar is not None]
    if grammars:
        from jaxserve.structured.grammar import fill_rows  # llguidance: only when one is used
        fill_rows(grammars, bitmask)
    for i, mask in masks:
        mask.restrict(bitmask[i])
    return bitmask
