"""The tokenizer of a GGUF file, built from its metadata with Hugging Face `tokenizers`.

A GGUF file carries its vocabulary as keys (`tokenizer.ggml.tokens`, `.merges`, `.scores`,
`.token_type`, the special ids, `tokenizer.chat_template`), not as a tokenizer.json. Two kinds
of vocabulary (`tokenizer.ggml.model`) cover the families jaxserve serves:

- "gpt2": byte-level BPE (Llama 3, Qwen2/3, SmolLM2, Mistral's tekken). The merges are given;
  how text is split into words before merging is not: `tokenizer.ggml.pre` names it, and
  `PRE_TOKENIZERS` maps the names llama.cpp writes to the split regexes of the tokenizers they
  stand for (llama.cpp's src/llama-vocab.cpp holds the same table).
- "llama": SentencePiece BPE (Llama 2, Mistral v0.x, Phi-3, Gemma). There are no merges, only
  each piece's score: the merges are rebuilt from vocabulary and scores, as transformers' GGUF
  converter does, into a BPE with byte fallback behind SentencePiece's normalizer ("▁" for a
  space, one before the text when `tokenizer.ggml.add_space_prefix`).

The text layer imports `tokenizers` only: the caller reads the file (the `gguf` package) and
hands over its keys as plain values.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary splits text into words before merging.

    `regexes` apply in turn, each splitting the pieces the one before left (its matches and
    the text between them become pieces: `tokenizers`' "isolated" split, llama.cpp's
    unicode_regex_split). `ignore_merges`: a word that is itself a token is that token,
    whatever the merges would make of it (Llama 3's tokenizer.json says so too). `add_bos`:
    llama.cpp's default where the file has no `tokenizer.ggml.add_bos_token`. `nfc`: the text
    is NFC-normalised first, as the model's own tokenizer.json does (Qwen2's), though
    llama.cpp does not.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    nfc: bool = False


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,), nfc=True)
_GPT2_PRE = PreTokenizer((_GPT2,))

# tokenizer.ggml.pre, as llama.cpp's convert_hf_to_gguf.py names the tokenizers it recognises
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback for files that name none: punctuation runs, GPT-2's words, digit
    # runs, then three digits at a time
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt-2": _GPT2_PRE,
    "phi-2": _GPT2_PRE,
    "llama-bpe": _LLAMA3_PRE,  # Llama 3.x, and DeepSeek-R1's Llama distills
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "falcon3": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE,  # Qwen2, Qwen2.5, Qwen3
    "deepseek-r1-qwen": _QWEN2_PRE,
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),  # SmolLM/SmolLM2: each digit alone, then GPT-2's
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),  # Mistral Nemo, Small 3
    "deepseek-v3": PreTokenizer(_DEEPSEEK3),
}


def gguf_tokenizer_parts(metadata: Mapping[str, Any], source: str = "GGUF file"
                         ) -> tuple[HFTokenizer, dict[str, Any], dict[str, Any]]:
    """What `Tokenizer(...)` takes (tokenizer.py's gguf_tokenizer makes it): the tokenizer,
    its tokenizer_config and generation_config, as a GGUF file's tokenizer keys describe (`metadata`: its keys to plain
    values, as `gguf.GGUFReader(path).fields[k].contents()` gives them). Control and unknown
    tokens become special tokens, user-defined ones added tokens, both found whole in text;
    `tokenizer.ggml.eot_token_id` and `eom_token_id` end generation beside EOS. A ValueError
    names `source` and the key of anything missing or malformed."""
    keys = _Keys(metadata, source)
    tokens = keys.strings("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source}: no tokenizer.ggml.tokens (the vocabulary)")
    types = keys.ints("tokenizer.ggml.token_type", len(tokens))
    if types is None:
        types = [NORMAL] * len(tokens)
    ids = {name: keys.token_id(f"tokenizer.ggml.{name}_token_id", len(tokens))
           for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}

    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        hf, add_bos = _byte_level_bpe(keys, tokens)
    elif kind == "llama":
        hf, add_bos = _sentencepiece_bpe(keys, tokens, types, ids["unknown"])
    else:
        raise ValueError(f"{source}: tokenizer.ggml.model is {kind!r}; known: 'gpt2' "
                         "(byte-level BPE), 'llama' (SentencePiece)")

    special = {i for i, t in enumerate(types) if t in (UNKNOWN, CONTROL)}
    special.update(ids[name] for name in ("bos", "eos", "unknown", "eot", "eom"))
    special.discard(None)
    hf.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                           for i in sorted(special)])
    hf.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                   for i, t in enumerate(types) if t == USER_DEFINED])

    add_bos = keys.flag("tokenizer.ggml.add_bos_token", add_bos)
    add_eos = keys.flag("tokenizer.ggml.add_eos_token", False)
    for name, adds in (("bos", add_bos), ("eos", add_eos)):
        if adds and ids[name] is None and f"tokenizer.ggml.add_{name}_token" in metadata:
            raise ValueError(f"{source}: tokenizer.ggml.add_{name}_token is true, but "
                             f"tokenizer.ggml.{name}_token_id is not set")
    if add_eos:  # (set in the file, so EOS is too)
        eos = tokens[ids["eos"]]
        hf.post_processor = processors.TemplateProcessing(
            single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, ids["eos"])])

    def text(name: str) -> str | None:
        return None if ids[name] is None else tokens[ids[name]]

    config = {"bos_token": text("bos"), "eos_token": text("eos"), "unk_token": text("unknown"),
              "pad_token": text("padding"), "add_bos_token": add_bos,
              "chat_template": metadata.get("tokenizer.chat_template")}
    stops = [ids[name] for name in ("eos", "eot", "eom") if ids[name] is not None]
    return hf, config, {"eos_token_id": stops}


def _byte_level_bpe(keys: _Keys, tokens: list[str]) -> tuple[HFTokenizer, bool]:
    """GPT-2's byte-level BPE over the given merges, split into words as `tokenizer.ggml.pre`
    says; and llama.cpp's default for adding BOS."""
    merges = keys.strings("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{keys.source}: no tokenizer.ggml.merges (a 'gpt2' vocabulary needs "
                         "them)")
    pairs = []
    for merge in merges:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{keys.source}: tokenizer.ggml.merges holds {merge!r}, not two "
                             "tokens apart by one space")
        pairs.append(tuple(pair))
    name = keys.metadata.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise ValueError(f"{keys.source}: tokenizer.ggml.pre {name!r} is not a pre-tokenizer "
                         f"jaxserve knows; known: {', '.join(sorted(PRE_TOKENIZERS))}")
    vocab = {token: i for i, token in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf, pre.add_bos


def _sentencepiece_bpe(keys: _Keys, tokens: list[str], types: list[int],
                       unknown: int | None) -> tuple[HFTokenizer, bool]:
    """A SentencePiece BPE vocabulary as `tokenizers` runs it (transformers' GGUF converter's
    construction): BPE with byte fallback over merges rebuilt from the scores, spaces as "▁"
    and, with `tokenizer.ggml.add_space_prefix` (default true), one "▁" before each text, which
    the decoder strips again; SentencePiece vocabularies add BOS unless told not to."""
    scores = keys.floats("tokenizer.ggml.scores", len(tokens))
    if scores is None:
        raise ValueError(f"{keys.source}: no tokenizer.ggml.scores (a 'llama' vocabulary's "
                         "merges are rebuilt from them)")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = None if unknown is None else tokens[unknown]
    hf = HFTokenizer(models.BPE(vocab, spm_merges(tokens, scores, types), unk_token=unk,
                                fuse_unk=True, byte_fallback=True))
    prefix = keys.flag("tokenizer.ggml.add_space_prefix", True)
    hf.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend("\u2581")] if prefix else []),
         normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return hf, True


def spm_merges(tokens: Sequence[str], scores: Sequence[float],
               types: Sequence[int]) -> list[tuple[str, str]]:
    """The BPE merges that reproduce SentencePiece's: it joins the adjacent pair whose joined
    piece scores highest, so each split of a normal piece into two normal pieces is a merge,
    ranked by the joined piece's score (its splits among themselves by their halves' scores),
    as transformers' GGUF converter ranks them. Only normal pieces merge: SentencePiece never
    makes a control, byte, unused or user-defined piece by merging."""
    score = {}
    for token, s, t in zip(tokens, scores, types, strict=True):
        if t == NORMAL:
            score[token] = s
    ranked = []
    for piece, s in score.items():
        halves = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in score and piece[k:] in score]
        halves.sort(key=lambda pair: (score[pair[0]], score[pair[1]]), reverse=True)
        ranked.extend((s, pair) for pair in halves)
    ranked.sort(key=lambda item: item[0], reverse=True)  # stable: ties keep vocabulary order
    return [pair for _, pair in ranked]


class _Keys:
    """The metadata's values, checked as read: a wrong type or length is a ValueError naming
    the file and the key."""

    def __init__(self, metadata: Mapping[str, Any], source: str) -> None:
        self.metadata, self.source = metadata, source

    def _list(self, key: str, kind: type, what: str, length: int | None) -> list | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{self.source}: {key} must be a list of {what}")
        if length is not None and len(value) != length:
            raise ValueError(f"{self.source}: {key} has {len(value)} entries, but "
                             f"tokenizer.ggml.tokens has {length}")
        return list(value)

    def strings(self, key: str) -> list[str] | None:
        return self._list(key, str, "strings", None)

    def ints(self, key: str, length: int) -> list[int] | None:
        return self._list(key, numbers.Integral, "integers", length)

    def floats(self, key: str, length: int) -> list[float] | None:
        return self._list(key, numbers.Real, "numbers", length)

    def token_id(self, key: str, vocab_size: int) -> int | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{self.source}: {key} must be a token id, got {value!r}")
        if not 0 <= value < vocab_size:
            raise ValueError(f"{self.source}: {key} is {value}, outside the vocabulary of "
                             f"{vocab_size} tokens")
        return int(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.metadata.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value
