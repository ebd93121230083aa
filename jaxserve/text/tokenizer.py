"""Tokenizers: a Hugging Face `tokenizers` wrapper and a byte-level tokenizer for the demo model
(chat templates render in `chat_template.py`, output text in `detokenizer.py`).

The one entry point is `load_tokenizer(path)`: a directory with `tokenizer.json` gives a
`Tokenizer`, one with `byte_tokenizer.json` gives a `ByteTokenizer`. Both implement
`BaseTokenizer`, the interface the engine and the detokenizers rely on.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import Tokenizer as HFTokenizer

from jaxserve.config.checks import read_json_object
from jaxserve.config.gguf import gguf_file, metadata, read_gguf
from jaxserve.text.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    TEMPLATE_TOKENS,
    check_messages,
    compile_template,
    pick_template,
    template_messages,
)
from jaxserve.text.gguf_tokenizer import gguf_tokenizer_parts

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class BaseTokenizer:
    """What the engine needs from a tokenizer; `Tokenizer` and `ByteTokenizer` implement it.

    `all_special_ids` are the ids `decode(..., skip_special_tokens=True)` drops.
    `byte_fallback_ids` are ids the decoder turns into bytes *as one run*: a run of them decodes
    all-or-nothing, so a later id of the run can change the text of earlier ones.
    """

    bos_token_id: int | None
    eos_token_ids: frozenset[int]  # every id that ends generation (generation_config's too)
    eos_token_id: int | None  # the tokenizer's own EOS, when it names one
    bos_token: str | None  # the BOS token's text
    eos_token: str | None
    template_tokens: dict[str, str]  # special tokens' texts given to chat templates, by name
    add_bos_token: bool
    vocab_size: int
    chat_template: str | None
    all_special_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]
    # the text of ids is their pieces' texts joined (the first may lose its leading space), so
    # a plain piece after other text adds exactly its own text (`piece_texts`)
    joins_pieces: bool = False
    _pieces: dict[int, tuple[str, str] | None]  # piece_texts' answers so far

    def piece_texts(self, token_id: int) -> tuple[str, str] | None:
        """With joins_pieces, for a plain piece (no special or added token, no byte of a run,
        whole characters, no U+FFFD): the text it adds after other text, and its decode alone.
        None otherwise: its text depends on its neighbours."""
        try:
            return self._pieces[token_id]
        except KeyError:
            texts = self._piece_texts(token_id) if self.joins_pieces else None
            self._pieces[token_id] = texts
            return texts

    def _piece_texts(self, token_id: int) -> tuple[str, str] | None:
        return None

    def joins_after(self, token_id: int) -> bool:
        """With joins_pieces: whether a plain piece after `token_id` (and the text before it
        returned) adds its own text: after a plain piece or a byte piece, whose text is never
        empty, so a decoder that strips the text's first space never reaches the new piece."""
        return token_id in self.byte_fallback_ids or self.piece_texts(token_id) is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS first when `add_special_tokens` and `add_bos_token`."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete or invalid UTF-8 becomes U+FFFD."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for inside a text (its leading space included; a byte
        piece as its one byte; a special token as its text): what logprobs report per token."""
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render `messages` ([{"role": str, "content": str}, ...]) with the model's chat template
        (or `DEFAULT_CHAT_TEMPLATE`), given the special tokens' texts (`bos_token`, `eos_token`,
        `unk_token`, `pad_token`, ... as tokenizer_config.json names them) as transformers does.
        `continue_final_message`: the text ends with the final message's content, left open
        (no end-of-turn marker after it), for the model to continue it ("prefill"), as
        transformers cuts it; it excludes `add_generation_prompt`. `chat_prompt_ids` encodes
        the result. `tools`: OpenAI's tool objects, the template's `tools` (as transformers'
        `apply_chat_template(tools=...)`); `template_kwargs`: more of the template's variables
        (Qwen3's `enable_thinking`), as vLLM's chat_template_kwargs."""
        check_messages(messages)
        reserved = set(template_kwargs or ()) & {"messages", "tools", "add_generation_prompt",
                                                 *TEMPLATE_TOKENS}
        if reserved:
            raise ValueError(f"chat_template_kwargs: {sorted(reserved)[0]!r} is set by the "
                             "request itself")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true: the first continues the final message, the second starts "
                             "a new one")
        template = compile_template(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        text = template.render(
            **(template_kwargs or {}),
            messages=template_messages(list(messages)),
            add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}),
            **{"bos_token": "", "eos_token": "", **self.template_tokens},
        )
        if continue_final_message:
            return _open_final_message(text, messages[-1]["content"])
        return text

    def chat_prompt_ids(self, text: str) -> list[int]:
        """The ids of a rendered chat. A model's own template writes every special token it
        wants, so the text is encoded without adding any (as transformers' and vLLM's chat
        paths do: no BOS the template left out); jaxserve's fallback template writes none, and
        its text is encoded as a prompt is (BOS per `add_bos_token`)."""
        return self.encode(text, add_special_tokens=self.chat_template is None)


class Tokenizer(BaseTokenizer):
    """A Hugging Face `tokenizers` tokenizer with the settings of its model directory."""

    def __init__(
        self,
        hf_tokenizer: HFTokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
    ) -> None:
        """`config` is tokenizer_config.json (over special_tokens_map.json); `generation_config`
        is generation_config.json, whose `eos_token_id` (int or list) adds stop ids."""
        config, generation_config = config or {}, generation_config or {}
        self._tk = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)

        self.bos_token_id = self._token_id(config.get("bos_token"))
        if self.bos_token_id is None:
            self.bos_token_id = _as_id(generation_config.get("bos_token_id"), "bos_token_id")
        gen_eos = generation_config.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_token_id = self._token_id(config.get("eos_token"))
        eos_ids = {self.eos_token_id}
        eos_ids.update(_as_id(value, "eos_token_id") for value in gen_eos)
        self.eos_token_ids = frozenset(i for i in eos_ids if i is not None)
        bos = self.bos_token_id
        self.bos_token = None if bos is None else hf_tokenizer.id_to_token(bos)
        self.eos_token = _token_text(config.get("eos_token"))
        # as transformers gives them to templates: those tokenizer_config.json names (a BOS id
        # from generation_config.json alone is no `bos_token`: Qwen's templates render "")
        self.template_tokens = {
            name: text for name in TEMPLATE_TOKENS
            if (text := _token_text(config.get(name))) is not None}

        self._post_processor_adds_bos = (
            bos is not None
            and hf_tokenizer.encode("a").ids[:1] == [bos]
            and hf_tokenizer.encode("a", add_special_tokens=False).ids[:1] != [bos]
        )
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"add_bos_token must be true or false, got {add_bos!r}")
        self.add_bos_token = self._post_processor_adds_bos if add_bos is None else add_bos
        self.chat_template = pick_template(config.get("chat_template"))

        added = hf_tokenizer.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_ids = frozenset(added)
        decoders = _decoder_types(hf_tokenizer)
        self._pieces = {}
        self.joins_pieces = _joins_pieces(hf_tokenizer)
        self._byte_level = "ByteLevel" in decoders
        # the text is the UTF-8 of the tokens' bytes, whatever came before: DecodeStream's case
        self.byte_level_only = self._byte_level and decoders <= {"ByteLevel", "Sequence"}
        self._metaspace = bool(decoders & {"Metaspace", "Replace"})
        self.byte_fallback_ids = frozenset()
        if "ByteFallback" in decoders:
            vocab = hf_tokenizer.get_vocab(with_added_tokens=False)
            self.byte_fallback_ids = frozenset(
                i for tok, i in vocab.items() if _BYTE_TOKEN.fullmatch(tok)
            )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, special_tokens_map.json,
        generation_config.json and chat_template.jinja (the last four when present)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a Hugging Face tokenizer needs it")
        config = {**read_json_object(path / "special_tokens_map.json")}
        config.update(read_json_object(path / "tokenizer_config.json"))
        if (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        generation_config = read_json_object(path / "generation_config.json")
        return cls(HFTokenizer.from_file(str(file)), config, generation_config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. BOS follows `add_bos_token` and is never doubled: a text that
        already starts with the BOS token (a rendered chat template) gets no second one."""
        ids = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self._post_processor_adds_bos:
            if not self.add_bos_token or ids[1:2] == [bos]:
                return ids[1:]
        elif self.add_bos_token and ids[:1] != [bos]:
            return [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` through the tokenizer's decoder."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """From the vocabulary piece, not a decode of the token alone (which drops a
        SentencePiece token's leading space and turns a byte piece into U+FFFD): byte-level
        BPE pieces map back through GPT-2's byte alphabet ("Ġit" -> b" it"), byte-fallback
        pieces are their byte ("<0xE4>" -> b"\\xe4"), "▁" is a space."""
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if token_id in self.byte_fallback_ids:
            return bytes([int(piece[3:5], 16)])
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
        if self._metaspace:
            return piece.replace("\u2581", " ").encode("utf-8")
        return super().token_bytes(token_id)

    def _token_id(self, token: Any) -> int | None:
        text = _token_text(token)
        return None if text is None else self._tk.token_to_id(text)

    def _piece_texts(self, token_id: int) -> tuple[str, str] | None:
        if token_id in self._added_ids or token_id in self.byte_fallback_ids:
            return None
        try:
            text = self.token_bytes(token_id).decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not text or "\ufffd" in text:
            return None
        return text, self.decode([token_id])


class ByteTokenizer(BaseTokenizer):
    """Byte-level tokenizer of the built-in demo model.

    Layout: ids 0..255 are the UTF-8 bytes, `BOS_ID` = 256, `EOS_ID` = 257, `VOCAB_SIZE` = 258.
    `encode` never produces a special id from text, so a prompt cannot forge BOS or EOS.
    """

    NUM_BYTES: ClassVar[int] = 256
    BOS_ID: ClassVar[int] = 256
    EOS_ID: ClassVar[int] = 257
    VOCAB_SIZE: ClassVar[int] = 258
    SPECIAL_TEXT: ClassVar[dict[int, str]] = {256: "<s>", 257: "</s>"}  # decode without skipping
    # The layout, as recorded in byte_tokenizer.json and checked on loading.
    LAYOUT: ClassVar[dict[str, Any]] = {
        "type": "byte",
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }

    def __init__(self, add_bos_token: bool = True, chat_template: str | None = None) -> None:
        """A byte tokenizer; BOS is prepended by `encode` when `add_bos_token`."""
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token_id = self.BOS_ID
        self.eos_token_ids = frozenset({self.EOS_ID})
        self.eos_token_id = self.EOS_ID
        self.bos_token = self.eos_token = None  # no text encodes to them
        self.template_tokens = {}
        self.vocab_size = self.VOCAB_SIZE
        self.all_special_ids = frozenset(self.SPECIAL_TEXT)
        self.byte_fallback_ids = frozenset()  # bytes decode like bytes.decode("utf-8", "replace")
        # an ASCII byte after other text is itself: a byte past a complete (or invalid) run
        # cannot change how the run decodes, and a run still open holds the text back
        self.joins_pieces = True
        self._pieces = {}

    def _piece_texts(self, token_id: int) -> tuple[str, str] | None:
        return (chr(token_id), chr(token_id)) if 0 <= token_id < 0x80 else None

    def joins_after(self, token_id: int) -> bool:
        return 0 <= token_id < self.NUM_BYTES  # any byte: its run is decided by then

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of `text`, after BOS when `add_special_tokens` and `add_bos_token`."""
        bos = [self.BOS_ID] if add_special_tokens and self.add_bos_token else []
        return bos + list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.NUM_BYTES:
            return bytes([token_id])
        return self.SPECIAL_TEXT.get(token_id, "").encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special ids are dropped or shown as `SPECIAL_TEXT`."""
        pieces, run = [], bytearray()
        for i in ids:
            if 0 <= i < self.NUM_BYTES:
                run.append(i)
            elif i in self.SPECIAL_TEXT:
                if not skip_special_tokens:
                    pieces += [run.decode("utf-8", "replace"), self.SPECIAL_TEXT[i]]
                    run.clear()
            else:
                raise ValueError(
                    f"token id {i} is outside the byte vocabulary [0, {self.VOCAB_SIZE})"
                )
        pieces.append(run.decode("utf-8", "replace"))
        return "".join(pieces)

    def to_json(self) -> dict[str, Any]:
        """A small JSON-able description, saved as byte_tokenizer.json next to a checkpoint."""
        return {
            **self.LAYOUT,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ByteTokenizer:
        """Inverse of `to_json`; rejects a description of another tokenizer or layout."""
        for key, expected in cls.LAYOUT.items():
            if data.get(key) != expected:
                raise ValueError(
                    f"byte tokenizer: {key} is {data.get(key)!r}, expected {expected!r}"
                )
        return cls(bool(data.get("add_bos_token", True)), data.get("chat_template"))

    def save(self, directory: str | Path) -> Path:
        """Write `to_json()` to directory/byte_tokenizer.json and return that path."""
        file = Path(directory) / BYTE_TOKENIZER_FILE
        file.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return file


def same_vocabulary(a: BaseTokenizer, b: BaseTokenizer, vocab_size: int) -> bool:
    """Whether two tokenizers give every id below vocab_size the same bytes (a draft model's
    proposals mean the same text to the model that verifies them)."""
    return type(a) is type(b) and all(a.token_bytes(t) == b.token_bytes(t)
                                      for t in range(vocab_size))


def gguf_tokenizer(metadata: dict[str, Any], source: str = "GGUF file") -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (gguf_tokenizer.py builds it)."""
    return Tokenizer(*gguf_tokenizer_parts(metadata, source))


def load_tokenizer(path: str | Path) -> Tokenizer | ByteTokenizer:
    """The tokenizer of a model directory: tokenizer.json (Hugging Face) or byte_tokenizer.json;
    or of a GGUF file (or a directory holding one), from its metadata (gguf_tokenizer.py)."""
    path = Path(path)
    if (gguf := gguf_file(path)) is not None:
        return gguf_tokenizer(metadata(read_gguf(gguf)), str(gguf))
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_dir(path)
    if (path / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer.from_json(read_json_object(path / BYTE_TOKENIZER_FILE))
    raise FileNotFoundError(
        f"no tokenizer in {path}: expected tokenizer.json or {BYTE_TOKENIZER_FILE}"
    )


def _open_final_message(text: str, final: str) -> str:
    """A rendered chat cut after its final message's content, as transformers'
    continue_final_message cuts it: after the content's last occurrence, its trailing spaces
    kept only where the text holds the content exactly (a template may trim them)."""
    stripped = final.strip()
    if stripped not in text:
        raise ValueError("continue_final_message: the final message's content is not in the "
                         "text the chat template renders (the template changes it)")
    at = text.rindex(stripped)
    whole = len(final.lstrip())
    return text[:at + (whole if text[at:at + whole] == final else len(stripped))]


def _token_text(token: Any) -> str | None:
    # Special tokens are written as "<s>" or as {"content": "<s>", ...}.
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_id(value: Any, name: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"generation_config.json: {name} must be an int, got {value!r}")
    return value


def token_text(tokenizer: BaseTokenizer, token_id: int) -> str:
    """A token as logprobs name it: its bytes as text, or, when they are not whole UTF-8 (a
    piece of a character), "bytes:" and their escapes ("bytes:\\xe4\\xbd"), as OpenAI's API
    writes them."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _joins_pieces(hf_tokenizer: HFTokenizer) -> bool:
    """Whether the decoder is one whose text of ids is their pieces' texts ("▁" a space, byte
    pieces their bytes) joined, but for the start of the whole text: SentencePiece's (Llama 2,
    Mistral, Gemma: Replace "▁" by " ", ByteFallback, Fuse, then at most one leading space
    stripped; or Metaspace, which strips the first piece's). Any other (ByteLevel's, WordPiece's
    "##", CTC's repeats, no decoder at all: pieces joined by spaces) is not taken for one."""
    if hf_tokenizer.decoder is None:
        return False
    state = json.loads(hf_tokenizer.decoder.__getstate__())
    fused = False
    for d in state.get("decoders", []) if state.get("type") == "Sequence" else [state]:
        kind = d.get("type")
        if kind == "Replace" and d.get("pattern") == {"String": "\u2581"} and (
                d.get("content") == " "):
            continue
        if kind == "Metaspace" and d.get("replacement") == "\u2581":
            continue
        if kind in ("ByteFallback", "Fuse"):
            fused |= kind == "Fuse"
            continue
        if (kind == "Strip" and fused and d.get("content") == " " and d.get("start", 0) <= 1
                and d.get("stop", 0) == 0):  # (after Fuse: the whole text's start)
            continue
        return False
    return True


def _decoder_types(hf_tokenizer: HFTokenizer) -> set[str]:
    if hf_tokenizer.decoder is None:
        return set()
    state = json.loads(hf_tokenizer.decoder.__getstate__())
    return {d.get("type") for d in [state, *state.get("decoders", [])]}


