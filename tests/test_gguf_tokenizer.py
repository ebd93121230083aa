"""The GGUF tokenizer (jaxserve/text/gguf_tokenizer.py) against the tokenizers a GGUF file's
metadata stands for: byte-level BPE vocabularies assembled as the models' own tokenizer.json
files assemble them (GPT-2's, Llama 3's, Qwen2's, SmolLM2's pre-tokenizers over one trained
vocabulary), and stories260K's SentencePiece vocabulary, written to GGUF files and compared with
its tokenizer.json; then the errors."""

import json
from pathlib import Path

import gguf
import pytest
from bpe_tokenizer import MIXED_TEXT
from tokenizers import AddedToken, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders as hf_decoders
from tokenizers import models as hf_models

from jaxserve.text.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNKNOWN,
    USER_DEFINED,
    spm_merges,
)
from jaxserve.text.tokenizer import Tokenizer, gguf_tokenizer

TEXTS = [
    MIXED_TEXT,
    "Once upon a time there was a little girl named Lily.",
    "  two  spaces,\n\nnewlines\r\n and a\ttab  ",
    "In 2024 she counted 1234567 stars, 3.14159 and 42!",
    "don't we'll THEY'RE you've I'M it's he'd",
    "<s>a BOS in the text</s> and after",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a <tool>call</tool> inside",
    "",
    " ",
    "\n",
    "x",
    "日本語のテキスト 12 ﬁ",
]
DECOMPOSED = "cafe\u0301 n\u0303"  # not NFC: Qwen2's normaliser composes it

# Each pre-tokenizer as the model's tokenizer.json writes it; the regexes are spelt as
# llama.cpp spells them (no (?i:...)), not as the module does
_SPLIT_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_QWEN2 = _SPLIT_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": False}
REFERENCE = {  # name: (normalizer, pre_tokenizer, ignore_merges, BOS added by default)
    "gpt-2": (None, {**_BYTE_LEVEL, "use_regex": True}, False, False),
    "llama-bpe": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _SPLIT_LLAMA3}, "behavior": "Isolated",
         "invert": False}, _BYTE_LEVEL]}, True, True),
    "qwen2": ({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _SPLIT_QWEN2}, "behavior": "Isolated",
         "invert": False}, _BYTE_LEVEL]}, False, False),
    "smollm": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, {**_BYTE_LEVEL, "use_regex": True}]},
        False, False),
}


@pytest.fixture(scope="module")
def bpe_hf() -> HFTokenizer:
    """A byte-level BPE trained on text with digit runs, contractions and newlines (so the
    pre-tokenizers part it differently), with two control tokens and a user-defined one."""
    hf = HFTokenizer(hf_models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = hf_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [*TEXTS[:5], "12 123 1234 12345 2024 3141592653 1000000", "\n\n\n  \n"]
    hf.train_from_iterator(corpus * 20, trainer)
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t in ("<|im_start|>", "<|im_end|>")])
    hf.add_tokens([AddedToken("<tool>", normalized=False, special=False)])
    return hf


def bpe_metadata(hf: HFTokenizer, pre: str) -> dict:
    """The keys llama.cpp's converter writes for a byte-level BPE tokenizer."""
    data = json.loads(hf.to_str())
    vocab = hf.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = {t["content"]: t["special"] for t in data["added_tokens"]}
    types = [NORMAL if t not in added else CONTROL if added[t] else USER_DEFINED for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": vocab["<s>"],
            "tokenizer.ggml.eos_token_id": vocab["</s>"]}


def reference_bpe(hf: HFTokenizer, pre: str) -> Tokenizer:
    normalizer, pre_tokenizer, ignore_merges, add_bos = REFERENCE[pre]
    data = json.loads(hf.to_str())
    data.update(normalizer=normalizer, pre_tokenizer=pre_tokenizer)
    data["model"]["ignore_merges"] = ignore_merges
    return Tokenizer(HFTokenizer.from_str(json.dumps(data)),
                     {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos})


def stories_metadata(stories_dir: Path) -> dict:
    """stories260K's vocabulary as llama.cpp's converter writes a SentencePiece one: the
    pieces by id, their types, and scores. tokenizer.json keeps no scores, but SentencePiece
    BPE scores a piece by its merge's rank (-id here: the merged pieces follow the 3 special and
    256 byte pieces in merge order, the lone characters come last)."""
    vocab = json.loads((stories_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(259, len(tokens))],
            "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
            + [NORMAL] * (len(tokens) - 259),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False}


def write_gguf(path: Path, metadata: dict) -> dict:
    """`metadata` through a GGUF file: written with gguf.GGUFWriter, read back as the loader
    reads it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()
            if k.startswith("tokenizer.")}


def assert_same(ours: Tokenizer, ref: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, special), (text, special)
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip), (text, skip)
    for name in ("bos_token_id", "eos_token_id", "add_bos_token", "all_special_ids",
                 "byte_fallback_ids", "joins_pieces", "vocab_size", "bos_token", "eos_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert all(ours.token_bytes(i) == ref.token_bytes(i) for i in range(ref.vocab_size))


# --- byte-level BPE ------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", sorted(REFERENCE))
def test_byte_level_bpe_matches_its_tokenizer_json(bpe_hf: HFTokenizer, pre: str) -> None:
    ours = gguf_tokenizer(bpe_metadata(bpe_hf, pre))
    assert_same(ours, reference_bpe(bpe_hf, pre), [*TEXTS, DECOMPOSED])
    assert ours.byte_level_only
    assert ours.encode("<|im_start|>")[-1:] == [bpe_hf.token_to_id("<|im_start|>")]
    assert ours.decode([bpe_hf.token_to_id("<tool>")]) == "<tool>"  # not special


def test_pre_tokenizers_split_differently(bpe_hf: HFTokenizer) -> None:
    """The comparison above is not vacuous: the trained merges make the pre-tokenizers' words
    show in the ids."""
    text = "In 2024 she counted 1234567 stars"
    ids = {pre: tuple(reference_bpe(bpe_hf, pre).encode(text)) for pre in REFERENCE}
    assert ids["gpt-2"] != ids["llama-bpe"] != ids["qwen2"]
    assert ids["gpt-2"] != ids["smollm"]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_round_trips(bpe_hf: HFTokenizer, pre: str) -> None:
    ours = gguf_tokenizer(bpe_metadata(bpe_hf, pre))
    for text in TEXTS:
        assert ours.decode(ours.encode(text, False), skip_special_tokens=False) == text


def test_byte_level_bpe_through_a_gguf_file(bpe_hf: HFTokenizer, tmp_path: Path) -> None:
    metadata = {**bpe_metadata(bpe_hf, "smollm"), "tokenizer.ggml.add_bos_token": False,
                "tokenizer.ggml.eot_token_id": bpe_hf.token_to_id("<|im_end|>"),
                "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                                           "{{ m.content }}<|im_end|>\n{% endfor %}"}
    ours = gguf_tokenizer(write_gguf(tmp_path / "bpe.gguf", metadata), "bpe.gguf")
    assert_same(ours, reference_bpe(bpe_hf, "smollm"), TEXTS)
    im_end = bpe_hf.token_to_id("<|im_end|>")
    assert ours.eos_token_ids == {bpe_hf.token_to_id("</s>"), im_end}
    text = ours.apply_chat_template([{"role": "user", "content": "Hi 12"}],
                                    add_generation_prompt=False)
    assert text == "<|im_start|>user\nHi 12<|im_end|>\n"
    assert ours.chat_prompt_ids(text)[-2:] == [im_end, bpe_hf.token_to_id("Ċ")]


def test_add_eos_token_and_stop_ids(bpe_hf: HFTokenizer) -> None:
    metadata = bpe_metadata(bpe_hf, "gpt-2")
    eos, im_end = metadata["tokenizer.ggml.eos_token_id"], bpe_hf.token_to_id("<|im_end|>")
    metadata.update({"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eom_token_id": im_end,
                     "tokenizer.ggml.padding_token_id": im_end})
    ours = gguf_tokenizer(metadata)
    assert ours.encode("hi")[-1] == eos and ours.encode("hi", False)[-1] != eos
    assert ours.eos_token_ids == {eos, im_end}
    assert ours.template_tokens["pad_token"] == "<|im_end|>"


# --- SentencePiece (llama) -----------------------------------------------------------------------


def test_spm_merges_rebuilt_from_scores(stories_dir: Path) -> None:
    """The merges rebuilt from stories260K's scores are its tokenizer.json's, in order."""
    metadata = stories_metadata(stories_dir)
    merges = json.loads((stories_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert spm_merges(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"],
                      metadata["tokenizer.ggml.token_type"]) == [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def test_sentencepiece_through_a_gguf_file(stories_dir: Path, tmp_path: Path) -> None:
    metadata = write_gguf(tmp_path / "stories.gguf", stories_metadata(stories_dir))
    ours = gguf_tokenizer(metadata, "stories.gguf")
    ref = Tokenizer.from_dir(stories_dir)
    texts = [*TEXTS, *(case["prompt"] for case in json.loads(
        (stories_dir / "reference_outputs.json").read_text())["cases"])]
    assert_same(ours, ref, texts)
    assert ours.encode("Hello")[0] == 1 and ours.decode(ours.encode(" a  b")) == " a  b"
    assert ours.eos_token_ids == {2}  # stories' generation_config.json adds 1; the file does not


def test_sentencepiece_without_space_prefix(stories_dir: Path) -> None:
    """Gemma's vocabularies: no "▁" before the text, none stripped from the decode."""
    ours = gguf_tokenizer({**stories_metadata(stories_dir),
                           "tokenizer.ggml.add_space_prefix": False})
    ref = Tokenizer.from_dir(stories_dir)
    assert ours.encode(" the cat", False) == ref.encode("the cat", False)
    assert ours.decode(ours.encode(" the cat")) == " the cat"
    for text in TEXTS:
        assert ours.decode(ours.encode(text, False), skip_special_tokens=False) == text


# --- errors --------------------------------------------------------------------------------------


def _drop(key: str):
    return lambda m: {k: v for k, v in m.items() if k != key}


@pytest.mark.parametrize("kind, change, named", [
    ("gpt2", _drop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    ("gpt2", _drop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    ("llama", _drop("tokenizer.ggml.scores"), "tokenizer.ggml.scores"),
    ("gpt2", lambda m: {**m, "tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type"),
    ("llama", lambda m: {**m, "tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores"),
    ("gpt2", lambda m: {**m, "tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
    ("gpt2", _drop("tokenizer.ggml.model"), "tokenizer.ggml.model"),
    ("gpt2", lambda m: {**m, "tokenizer.ggml.merges": ["a b c"]}, "tokenizer.ggml.merges"),
    ("gpt2", lambda m: {**m, "tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id"),
    ("gpt2", lambda m: {**m, "tokenizer.ggml.bos_token_id": "1"}, "bos_token_id"),
    ("llama", lambda m: {**_drop("tokenizer.ggml.bos_token_id")(m),
                         "tokenizer.ggml.add_bos_token": True}, "bos_token_id"),
    ("llama", lambda m: {**m, "tokenizer.ggml.add_space_prefix": 1}, "add_space_prefix"),
])
def test_malformed_metadata_is_named(bpe_hf, stories_dir, kind, change, named) -> None:
    metadata = bpe_metadata(bpe_hf, "gpt-2") if kind == "gpt2" else stories_metadata(stories_dir)
    with pytest.raises(ValueError, match=named) as error:
        gguf_tokenizer(change(metadata), "model.gguf")
    assert "model.gguf" in str(error.value)


def test_unknown_pre_tokenizer_names_the_known_ones(bpe_hf: HFTokenizer) -> None:
    with pytest.raises(ValueError) as error:
        gguf_tokenizer(bpe_metadata(bpe_hf, "gpt-5"), "model.gguf")
    message = str(error.value)
    assert all(name in message for name in ("model.gguf", "'gpt-5'", "llama-bpe", "smollm"))
