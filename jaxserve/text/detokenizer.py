"""A request's output text, a few ids at a time: `make_detokenizer` picks `StreamDetokenizer`
(`tokenizers.decoders.DecodeStream`) for byte-level BPE tokenizers and our
`IncrementalDetokenizer` for the rest (SentencePiece, byte fallback, the demo's byte tokenizer).
"""

from collections.abc import Iterable, Sequence

from tokenizers.decoders import DecodeStream

from jaxserve.text.tokenizer import BaseTokenizer, Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one (as vLLM)


class _Detokenizer:
    """What the output processor reads a request's text with: `push(ids)` returns the text
    they complete, `peek()` what held ids would add if none followed, `finish()` the rest;
    `text` is everything returned."""

    def __init__(self) -> None:
        self._finished = False
        self._returned: list[str] = []  # in pieces: no copy of the whole text per token

    @property
    def text(self) -> str:
        return "".join(self._returned)

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("push() after finish()")


class IncrementalDetokenizer(_Detokenizer):
    """Turns generated token ids, fed a few at a time, into new text.

    Each call decodes a window that starts a few tokens back, so context-dependent pieces (the
    SentencePiece "▁" that is a space except at the start of a text) come out right, and returns
    what the window adds past the text already returned:

        ids  [ prompt ... | returned ... | last returned chunk | pending ]
                                         ^ prefix              ^ read    ^ end
        delta = decode(ids[prefix:end])[len(decode(ids[prefix:read])):]

    Text is held back while it ends in U+FFFD (a character still incomplete) and, for decoders
    with byte fallback, while ids end in a run of byte tokens (one later invalid byte would turn
    the whole run into U+FFFD). So the deltas never need taking back, and together they equal the
    decode of prompt + generated ids past the decode of the prompt, with two exceptions that
    follow vLLM: a prompt that ends inside a character leaves its last ids pending, so the
    character they begin is output text once generated ids complete it; and `finish()` returns
    a run cut inside a character as its whole characters and one U+FFFD (the decoder would make
    every byte of the run U+FFFD, the complete characters too).
    """

    def __init__(
        self,
        tokenizer: BaseTokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """`prompt_ids` are context only: their text is never returned."""
        super().__init__()
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._special = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._ids = self._kept(prompt_ids)
        self._joins = self._joins_after()
        self._read = len(self._ids) - _unfinished_tail(tokenizer, self._ids[-4:])
        self._prefix = max(self._read - _CONTEXT_TOKENS, 0)
        # Never start the window inside a run of byte tokens.
        in_run = tokenizer.byte_fallback_ids
        while (
            0 < self._prefix < self._read
            and {*self._ids[self._prefix - 1 : self._prefix + 1]} <= in_run
        ):
            self._prefix -= 1
        self._prefix_text = self._decode(self._prefix, self._read)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete ("" while it is incomplete)."""
        if self._finished:  # (_check_open inline: per token)
            self._check_open()
        kept = self._kept(token_ids)
        if len(kept) == 1 and self._joins and self._read == len(self._ids) > self._prefix:
            # one plain piece after returned text whose last id a piece joins, with a decoder
            # that joins pieces (most tokens of most outputs): the window's decode would be
            # the text so far and this piece's, so skip both decodes
            texts = self._tokenizer.piece_texts(kept[0])
            if texts is not None:
                self._ids.append(kept[0])
                self._prefix, self._read = self._read, len(self._ids)
                self._prefix_text = texts[1]  # the decode of ids[prefix:read], this id alone
                self._returned.append(texts[0])
                return texts[0]
        self._ids += kept
        self._joins = self._joins_after()
        end = len(self._ids)
        while end > self._read and self._ids[end - 1] in self._tokenizer.byte_fallback_ids:
            end -= 1
        return self._advance(end, final=False)

    def _joins_after(self) -> bool:
        """Whether a plain piece after the last id adds its own text (BaseTokenizer.joins_after)."""
        return bool(self._ids) and self._tokenizer.joins_after(self._ids[-1])

    def peek(self) -> str:
        """The text the held-back ids would add if none followed them ("" while that ends in an
        incomplete character). Nothing is returned for good: a stop-string check reads it, and
        a stop found there ends the ids, which makes it final."""
        end = len(self._ids)
        if end <= self._read:
            return ""
        new_text = self._decode(self._prefix, end)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return new_text[len(self._prefix_text):]

    def finish(self) -> str:
        """Return the text still held back (an incomplete character shows as U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        tail = self._byte_run_tail()
        if not tail:
            return self._advance(len(self._ids), final=True)
        # byte tokens of an unfinished character: decoded with them, the run's complete
        # characters would turn into U+FFFD too
        delta = self._advance(len(self._ids) - tail, final=True) + "\ufffd"
        self._read = len(self._ids)
        self._returned.append("\ufffd")
        return delta

    def _byte_run_tail(self) -> int:
        """How many of the last ids are byte-fallback tokens (one byte each) that begin a
        character without finishing it; never ids already returned."""
        run = self._tokenizer.byte_fallback_ids
        start = len(self._ids)
        while start > max(self._read, len(self._ids) - 4) and self._ids[start - 1] in run:
            start -= 1
        return _unfinished_tail(self._tokenizer, self._ids[start:])

    def _advance(self, end: int, final: bool) -> str:
        if end <= self._read:
            return ""
        new_text = self._decode(self._prefix, end)
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, end
        self._prefix_text = self._decode(self._prefix, self._read)
        self._returned.append(delta)
        return delta

    def _kept(self, ids: Iterable[int]) -> list[int]:
        special = self._special
        if isinstance(ids, list) and len(ids) == 1:  # (most pushes: one token)
            i = int(ids[0])
            return [] if i in special else [i]
        return [i for i in map(int, ids) if i not in special]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)


class StreamDetokenizer(_Detokenizer):
    """`IncrementalDetokenizer`'s interface over `tokenizers.decoders.DecodeStream` (Rust: one
    call per token), for Hugging Face tokenizers whose decoder is byte-level BPE alone (GPT-2,
    Llama 3, Qwen, ...): their text is the UTF-8 of the tokens' bytes, with no context, and
    DecodeStream gives the same text as ours (tests/test_detokenizer.py checks it). It returns
    text once it does not end in U+FFFD; `peek` and `finish` decode the ids it still holds.
    The prompt's last ids are stepped only where they begin a character they do not finish
    (as ours: the generated ids that complete it make it output text)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        super().__init__()
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids stepped since the stream last returned text
        special = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        tail = [int(i) for i in prompt_ids[-4:] if int(i) not in special]
        for i in tail[len(tail) - _unfinished_tail(tokenizer, tail):]:
            self._step(i)
        self._num_prompt_held = len(self._held)  # held ids of the prompt: no output text alone

    def push(self, token_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete ("" while it is incomplete)."""
        self._check_open()
        delta = "".join([self._step(int(i)) for i in token_ids])
        self._returned.append(delta)
        return delta

    def peek(self) -> str:
        """The text the held ids would add if none followed them ("" while that ends in an
        incomplete character)."""
        text = self._held_text()
        return "" if text.endswith("\ufffd") else text

    def finish(self) -> str:
        """Return the text still held back (an incomplete character shows as U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        delta = self._held_text()
        self._returned.append(delta)
        return delta

    def _step(self, token_id: int) -> str:
        self._held.append(token_id)
        delta = self._stream.step(self._tokenizer._tk, token_id)
        if delta is None:
            return ""
        self._held, self._num_prompt_held = [], 0
        return delta

    def _held_text(self) -> str:
        if len(self._held) <= self._num_prompt_held:
            return ""
        return self._tokenizer.decode(self._held, self._skip)


def make_detokenizer(tokenizer: BaseTokenizer, prompt_ids: Sequence[int] = ()):
    """The incremental detokenizer of a request's output (prompt_ids are context only):
    `StreamDetokenizer` (DecodeStream) for a byte-level BPE tokenizer, and ours otherwise.
    Ours stays for the decoders whose text depends on context (SentencePiece's "▁" is no space
    at the start of a text: a window of earlier ids must be decoded with the new ones), and
    DecodeStream fails the byte-fallback tokenizers (SentencePiece's <0xNN>
    pieces, stories260K's): it returns a byte run's text as soon as it decodes, so a later
    byte that turns the run into U+FFFD makes it raise (InvalidPrefix), and it has no way to
    hold a run back; the demo's ByteTokenizer is not a `tokenizers` tokenizer at all."""
    if isinstance(tokenizer, Tokenizer) and tokenizer.byte_level_only:
        return StreamDetokenizer(tokenizer, prompt_ids)
    return IncrementalDetokenizer(tokenizer, prompt_ids)


def _unfinished_tail(tokenizer: BaseTokenizer, ids: Sequence[int]) -> int:
    """How many of `ids`' last tokens hold the bytes of a character they begin but do not
    finish (0 when their bytes end on a character boundary)."""
    pieces = [tokenizer.token_bytes(i) for i in ids]
    missing, count = _incomplete_utf8_tail(b"".join(pieces)), 0
    while missing > 0 and count < len(pieces):
        count += 1
        missing -= len(pieces[-count])
    return count


def _incomplete_utf8_tail(data: bytes) -> int:
    """How many of `data`'s last bytes begin a UTF-8 character without finishing it (0 when it
    ends on a character boundary, or in bytes no character could continue)."""
    for back in range(1, min(4, len(data)) + 1):
        if data[-back] & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            try:
                data[-back:].decode("utf-8")
            except UnicodeDecodeError as err:
                return back if err.start == 0 and err.reason == "unexpected end of data" else 0
            return 0
    return 0
