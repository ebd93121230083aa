"""Tokenizer, ByteTokenizer, chat templates and the detokenizers (ours and DecodeStream)."""

import copy
import json
import random
import shutil
from pathlib import Path

import pytest
from bpe_tokenizer import MIXED_TEXT, byte_level_bpe
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer as HFTokenizer

from jaxserve.text.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from jaxserve.text.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    token_text,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def stories(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


@pytest.fixture(scope="session")
def cases(stories_dir: Path) -> list[dict]:
    return json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]


def cut_run(tokenizer, ids) -> int:
    """How many of `ids`' last byte-fallback tokens begin a character they do not finish: the
    shortest run tail that some continuation bytes would complete into one valid character."""
    run = b""
    for i in reversed(ids):
        if i not in tokenizer.byte_fallback_ids:
            break
        run = tokenizer.token_bytes(i) + run
    for k in range(1, min(3, len(run)) + 1):
        for extra in range(1, 5 - k):
            for c in range(0x80, 0xC0):
                try:
                    if len((run[-k:] + bytes([c]) + b"\x80" * (extra - 1)).decode("utf-8")) == 1:
                        return k
                except UnicodeDecodeError:
                    pass
    return 0


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    return byte_level_bpe()


def stream(tokenizer, prompt_ids, ids, chunk=1, skip_special_tokens=True,
           detokenizer=IncrementalDetokenizer) -> tuple[str, str]:
    """Feed `ids` `chunk` at a time, checking the text so far is always a prefix of the final
    text; return (streamed text, decode of prompt + ids past the decode of the prompt, where
    ids that end inside a character end in one U+FFFD instead)."""
    detok = detokenizer(tokenizer, prompt_ids, skip_special_tokens)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens)
    kept = [i for i in ids if not (skip_special_tokens and i in tokenizer.all_special_ids)]
    cut = cut_run(tokenizer, kept)  # a run of byte tokens spans the skipped ones
    full = tokenizer.decode([*prompt_ids, *kept[:len(kept) - cut]], skip_special_tokens)
    assert full.startswith(prompt_text)
    expected = full[len(prompt_text) :] + "\ufffd" * (cut > 0)
    out = ""
    for start in range(0, len(ids), chunk):
        out += detok.push(ids[start : start + chunk])
        assert expected.startswith(out), (out, expected)
    out += detok.finish()
    assert out == detok.text
    assert detok.finish() == ""
    return out, expected


# --- Tokenizer on the real stories260K tokenizer -------------------------------------------------


def test_stories_settings(stories: Tokenizer) -> None:
    assert stories.vocab_size == 512
    assert stories.bos_token_id == 1
    assert stories.eos_token_ids == frozenset({1, 2})  # </s>, plus BOS from generation_config
    assert (stories.bos_token, stories.eos_token) == ("<s>", "</s>")
    assert stories.add_bos_token
    assert stories.all_special_ids == frozenset({0, 1, 2})
    assert len(stories.byte_fallback_ids) == 256


def test_encode_matches_reference_prompt_ids(stories: Tokenizer, cases: list[dict]) -> None:
    assert len(cases) == 5
    for case in cases:
        assert stories.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
        assert stories.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids"][1:]


def test_decode_matches_reference_text(stories: Tokenizer, cases: list[dict]) -> None:
    for case in cases:
        # The reference text is the prompt followed by the generation, BOS skipped.
        ids = case["prompt_ids"] + case["generated_ids"]
        assert stories.decode(ids) == case["text"]
        assert stories.decode(case["prompt_ids"]) == case["prompt"]
        assert stories.decode(ids, skip_special_tokens=False) == "<s> " + case["text"]


def test_bos_is_added_once(stories_dir: Path) -> None:
    hf = HFTokenizer.from_file(str(stories_dir / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    assert Tokenizer(hf, config).encode("Once")[0] == 1
    assert Tokenizer(hf, {**config, "add_bos_token": False}).encode("Once") == [403]
    assert Tokenizer(hf, config).encode("<s>Once") == [1, 403]  # already there: no second
    hf.post_processor = None  # a tokenizer.json that adds no BOS, a config that asks for it
    assert Tokenizer(hf, config).encode("Once") == [403]
    with_bos = Tokenizer(hf, {**config, "add_bos_token": True})
    assert with_bos.encode("Once") == [1, 403]
    assert with_bos.encode("<s>Once") == [1, 403]
    assert with_bos.encode("Once", add_special_tokens=False) == [403]


def test_eos_ids_from_generation_config(stories_dir: Path) -> None:
    hf = HFTokenizer.from_file(str(stories_dir / "tokenizer.json"))
    assert Tokenizer(hf, {"eos_token": "</s>"}, {"eos_token_id": 0}).eos_token_ids == {0, 2}
    no_bos = Tokenizer(hf, {}, {"bos_token_id": 1, "eos_token_id": [2]})
    assert (no_bos.bos_token_id, no_bos.eos_token_ids) == (1, {2})
    with pytest.raises(ValueError, match="eos_token_id must be an int"):
        Tokenizer(hf, {}, {"eos_token_id": ["2"]})
    with pytest.raises(ValueError, match="add_bos_token must be true or false"):
        Tokenizer(hf, {"add_bos_token": "yes"})


def test_missing_or_broken_files(tmp_path: Path, stories_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)
    shutil.copy(stories_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: invalid JSON"):
        Tokenizer.from_dir(tmp_path)


def test_load_tokenizer_picks_the_kind(tmp_path: Path, stories_dir: Path) -> None:
    assert isinstance(load_tokenizer(stories_dir), Tokenizer)
    ByteTokenizer(add_bos_token=False).save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteTokenizer)
    assert not loaded.add_bos_token


# --- Incremental detokenizer on stories260K ------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_reference_cases(stories: Tokenizer, cases: list[dict], chunk: int) -> None:
    for case in cases:
        out, _ = stream(stories, case["prompt_ids"], case["generated_ids"], chunk)
        assert case["prompt"] + out == case["text"]


def test_detokenizer_without_prompt_has_no_leading_space(stories: Tokenizer) -> None:
    ids = stories.encode("Once upon a time", add_special_tokens=False)
    out, expected = stream(stories, [], ids)
    assert out == expected == "Once upon a time"


def test_detokenizer_holds_back_partial_characters(stories: Tokenizer) -> None:
    ids = stories.encode(MIXED_TEXT, add_special_tokens=False)
    assert len(set(ids) & stories.byte_fallback_ids) > 20  # the text really falls back to bytes
    detok = IncrementalDetokenizer(stories, [1])
    deltas = [detok.push([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == MIXED_TEXT
    assert not any("\ufffd" in d for d in deltas)
    # The normalizer prepends "▁", so this is " 😀": "▁" then four byte tokens.
    emoji = stories.encode("😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(stories, stories.encode("Hi"))
    assert [detok.push([i]) for i in emoji] == [" ", "", "", "", ""]
    assert detok.push(stories.encode("!", add_special_tokens=False)) == "😀 !"
    # peek: what the held run spells once its character is complete, without returning it
    detok = IncrementalDetokenizer(stories, stories.encode("Hi"))
    peeks = []
    for i in emoji:
        detok.push([i])
        peeks.append(detok.peek())
    assert peeks == ["", "", "", "", "😀"] and detok.text == " "


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_detokenizer_mixed_text_in_context(stories: Tokenizer, chunk: int) -> None:
    prompt = stories.encode("Lily said:")
    ids = stories.encode(MIXED_TEXT + " The end.", add_special_tokens=False)
    out, expected = stream(stories, prompt, ids, chunk)
    assert out == expected == " " + MIXED_TEXT + " The end."


@FAST
@given(
    prompt=st.text(max_size=12),
    ids=st.lists(st.integers(0, 511) | st.integers(3, 258), max_size=40),
    chunk=st.integers(1, 4),
    skip=st.booleans(),
)
def test_detokenizer_random_ids(stories: Tokenizer, prompt, ids, chunk, skip) -> None:
    # Random ids are full of stray bytes: decode() turns such runs into U+FFFD.
    prompt_ids = stories.encode(prompt)
    full = stories.decode(prompt_ids + ids, skip)
    assume(full.startswith(stories.decode(prompt_ids, skip)))  # ids may rewrite a prompt's byte run
    out, expected = stream(stories, prompt_ids, ids, chunk, skip)
    assert out == expected


def test_detokenizer_seeded_byte_runs(stories: Tokenizer) -> None:
    rng = random.Random(0)
    pieces = [stories.encode(c, add_special_tokens=False) for c in "aé😀日 ,\n"] + [[1], [2]]
    for _ in range(200):
        ids = [i for _ in range(rng.randint(0, 12)) for i in rng.choice(pieces)]
        out, expected = stream(stories, [1], ids, rng.randint(1, 3))
        assert out == expected and "\ufffd" not in out


def test_detokenizer_cut_inside_a_character_keeps_the_whole_ones(stories: Tokenizer) -> None:
    """max_tokens ending a run of byte tokens one byte short: the run's whole characters and
    one U+FFFD (the decoder alone makes every byte of the run U+FFFD)."""
    ids = stories.encode("日本語です", add_special_tokens=False)
    assert set(ids[1:]) <= stories.byte_fallback_ids  # "▁" then 15 byte tokens
    detok = IncrementalDetokenizer(stories, stories.encode("Hi"))
    text = "".join(detok.push([i]) for i in ids[:-1]) + detok.finish()
    assert text == " 日本語で\ufffd" == detok.text
    assert stories.decode(ids[:-1]).count("\ufffd") == 14


def test_detokenizer_prompt_ending_inside_a_character(stories: Tokenizer) -> None:
    """A prompt of ids that ends inside a character (a client continuing a cut generation):
    the character is output text once the generated bytes complete it, as vLLM's."""
    ni = stories.encode("日本", add_special_tokens=False)  # "▁", then 3 + 3 byte tokens
    prompt = stories.encode("Hi") + ni[:3]  # ends two bytes into 日
    detok = IncrementalDetokenizer(stories, prompt)
    gen = ni[3:] + stories.encode("ok", add_special_tokens=False)  # "▁ok"
    assert "".join(detok.push([i]) for i in gen) + detok.finish() == "日本 ok"
    byte = ByteTokenizer()
    ids = byte.encode("Hi 日本 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte, ids[:4])  # "Hi " and 日's first byte
    assert "".join(detok.push([i]) for i in ids[4:]) + detok.finish() == "日本 ok"


# --- the plain-piece path: a piece after text adds its own text, without a decode ------------


def window_only(tokenizer):
    """The same tokenizer, its detokenizers decoding a window for every push."""
    other = copy.copy(tokenizer)
    other.joins_pieces, other._pieces = False, {}
    return other


def pushes(tokenizer, prompt_ids, ids, chunk, skip=True):
    """Every push's text and peek, then finish's, and how many decodes they made."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
    decode, calls = tokenizer.decode, []
    tokenizer.decode = lambda *args, **kwargs: calls.append(1) or decode(*args, **kwargs)
    try:
        out = [(detok.push(ids[i:i + chunk]), detok.peek()) for i in range(0, len(ids), chunk)]
        return [*out, (detok.finish(), detok.text)], len(calls)
    finally:
        del tokenizer.decode


@pytest.fixture(scope="module")
def stories_window(stories) -> Tokenizer:
    return window_only(stories)


@FAST
@given(prompt=st.text(max_size=12), text=st.text(max_size=30),
       ids=st.lists(st.integers(0, 511) | st.integers(3, 258), max_size=30),
       chunk=st.integers(1, 3), skip=st.booleans())
def test_plain_pieces_give_the_windows_text_push_by_push(stories, stories_window, prompt,
                                                         text, ids, chunk, skip) -> None:
    """Whatever the ids (a text's, then random ones: byte runs, specials, stray bytes), each
    push returns and peeks what decoding a window returns, and finish the same."""
    prompt_ids = stories.encode(prompt)
    ids = stories.encode(text, add_special_tokens=False) + ids
    assert (pushes(stories, prompt_ids, ids, chunk, skip)[0]
            == pushes(stories_window, prompt_ids, ids, chunk, skip)[0])


@FAST
@given(prompt=st.lists(st.integers(0, ByteTokenizer.VOCAB_SIZE - 1), max_size=6),
       text=st.text(max_size=30),
       ids=st.lists(st.integers(0, ByteTokenizer.VOCAB_SIZE - 1), max_size=30),
       chunk=st.integers(1, 3), skip=st.booleans())
def test_plain_bytes_give_the_windows_text_push_by_push(prompt, text, ids, chunk, skip) -> None:
    byte = ByteTokenizer()
    ids = byte.encode(text, add_special_tokens=False) + ids
    assert (pushes(byte, prompt, ids, chunk, skip)[0]
            == pushes(window_only(byte), prompt, ids, chunk, skip)[0])


def test_plain_pieces_skip_the_decodes(stories, stories_window) -> None:
    """A story's tokens one at a time: nearly every push takes no decode at all (once each
    piece's text is known: the tokenizer keeps it)."""
    ids = stories.encode("Once upon a time, there was a little girl named Lily. She loved "
                         "to play outside in the park.", add_special_tokens=False)
    pushes(stories, [1], ids, 1)
    fast, fast_calls = pushes(stories, [1], ids, 1)
    window, window_calls = pushes(stories_window, [1], ids, 1)
    assert fast == window
    assert window_calls >= 2 * len(ids) and fast_calls <= 4
    byte = ByteTokenizer()
    ids = byte.encode("plain ASCII text, then é and 日本 (bytes of a run)", False)
    pushes(byte, [256], ids, 1)
    fast, fast_calls = pushes(byte, [256], ids, 1)
    assert fast == pushes(window_only(byte), [256], ids, 1)[0] and fast_calls <= 30


def test_which_decoders_join_pieces(stories, bpe) -> None:
    """SentencePiece's decoders (Replace, ByteFallback, Fuse, Strip; Metaspace) join pieces;
    byte-level BPE (DecodeStream's), WordPiece, a Strip before Fuse (each piece's space) and
    no decoder (pieces joined by spaces) do not."""
    from tokenizers import decoders, models

    assert stories.joins_pieces and ByteTokenizer().joins_pieces and not bpe.joins_pieces
    cases = [
        (decoders.Metaspace(), True),
        (decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                            decoders.Fuse()]), True),  # Gemma's
        (decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0),
                            decoders.Fuse()]), False),
        (decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                            decoders.Strip(" ", 2, 0)]), False),
        (decoders.WordPiece(), False),
        (decoders.CTC(), False),
        (None, False),
    ]
    for decoder, joins in cases:
        hf = HFTokenizer(models.BPE())
        hf.decoder = decoder
        assert Tokenizer(hf).joins_pieces is joins, decoder


def test_detokenizer_push_after_finish(stories: Tokenizer) -> None:
    detok = IncrementalDetokenizer(stories, [1])
    detok.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        detok.push([403])


# --- DecodeStream (StreamDetokenizer) on a byte-level BPE tokenizer -----------------------------


def test_make_detokenizer_takes_decode_stream_where_it_gives_our_text(stories, bpe) -> None:
    assert bpe.byte_level_only and not stories.byte_level_only
    assert isinstance(make_detokenizer(bpe, [1]), StreamDetokenizer)
    # byte fallback (DecodeStream raises when a later byte spoils a run) and SentencePiece's
    # context-dependent "▁", and the demo's own byte tokenizer: ours
    assert isinstance(make_detokenizer(stories, [1]), IncrementalDetokenizer)
    assert isinstance(make_detokenizer(ByteTokenizer(), [256]), IncrementalDetokenizer)


@FAST
@given(
    prompt=st.text(max_size=12),
    ids=st.lists(st.integers(0, 399), max_size=40),
    chunk=st.integers(1, 4),
    skip=st.booleans(),
)
def test_decode_stream_gives_our_text_on_random_ids(bpe: Tokenizer, prompt, ids, chunk,
                                                    skip) -> None:
    ids = [i % bpe.vocab_size for i in ids]
    prompt_ids = bpe.encode(prompt)
    assume(bpe.decode(prompt_ids + ids, skip).startswith(bpe.decode(prompt_ids, skip)))
    theirs = stream(bpe, prompt_ids, ids, chunk, skip, detokenizer=StreamDetokenizer)
    ours = stream(bpe, prompt_ids, ids, chunk, skip)
    assert theirs[0] == theirs[1] == ours[0] == ours[1]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_decode_stream_mixed_text_in_context(bpe: Tokenizer, chunk: int) -> None:
    prompt = bpe.encode("Lily said:")
    ids = bpe.encode(" " + MIXED_TEXT + " The end.", add_special_tokens=False)
    out, expected = stream(bpe, prompt, ids, chunk, detokenizer=StreamDetokenizer)
    assert out == expected == " " + MIXED_TEXT + " The end."


def test_decode_stream_holds_back_partial_characters(bpe: Tokenizer) -> None:
    ids = bpe.encode("🧠!", add_special_tokens=False)  # 🧠 is rare: its bytes stay apart
    assert len(ids) > 2
    detok, ours = StreamDetokenizer(bpe, [0]), IncrementalDetokenizer(bpe, [0])
    peeks, deltas = [], []
    for i in ids:
        deltas.append(detok.push([i]))
        assert deltas[-1] == ours.push([i])
        peeks.append(detok.peek())
    assert "".join(deltas) == "🧠!" and "" in deltas[:-1] and peeks[-1] == ""
    cut = StreamDetokenizer(bpe, [0])  # the generation ends inside the character
    assert cut.push(ids[:-2]) == "" and cut.finish() == "\ufffd" == cut.text
    with pytest.raises(RuntimeError, match="after finish"):
        cut.push([5])


def test_decode_stream_prompt_ending_inside_a_character(bpe: Tokenizer) -> None:
    """As ours: the character a prompt of ids leaves unfinished is output text once the
    generated ids complete it."""
    ni = bpe.encode("🧠 ok", add_special_tokens=False)
    assert [len(bpe.token_bytes(i)) for i in ni[:2]] == [2, 2]  # 🧠's four bytes
    for k, want in [(1, "🧠 ok"), (2, " ok")]:
        for detokenizer in (StreamDetokenizer, IncrementalDetokenizer):
            detok = detokenizer(bpe, bpe.encode("Hi") + ni[:k])
            assert "".join(detok.push([i]) for i in ni[k:]) + detok.finish() == want
    assert StreamDetokenizer(bpe, bpe.encode("Hi") + ni[:1]).finish() == ""


# --- ByteTokenizer -------------------------------------------------------------------------------


@FAST
@given(text=st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == ByteTokenizer.BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    out, expected = stream(tok, tok.encode("x"), [*ids[1:], ByteTokenizer.EOS_ID])
    assert out == expected == text


@FAST
@given(ids=st.lists(st.integers(0, ByteTokenizer.VOCAB_SIZE - 1)), chunk=st.integers(1, 3))
def test_byte_tokenizer_random_ids(ids: list[int], chunk: int) -> None:
    tok = ByteTokenizer()
    for skip in (True, False):
        out, expected = stream(tok, [ByteTokenizer.BOS_ID], ids, chunk, skip)
        assert out == expected


def test_byte_tokenizer_layout_and_json() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (258, 256, {257})
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<s>hi</s>"
    assert tok.decode([256, 104, 105, 257]) == "hi"
    assert ByteTokenizer.from_json(json.loads(json.dumps(tok.to_json()))).to_json() == tok.to_json()
    with pytest.raises(ValueError, match="token id 258 is outside the byte vocabulary"):
        tok.decode([258])
    with pytest.raises(ValueError, match="vocab_size is 300, expected 258"):
        ByteTokenizer.from_json({**tok.to_json(), "vocab_size": 300})
    with pytest.raises(ValueError, match="type is 'bpe'"):
        ByteTokenizer.from_json({**tok.to_json(), "type": "bpe"})


# --- Chat templates ------------------------------------------------------------------------------

TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m.role) }}
    {% endif %}
<|{{ m.role }}|>{{ m.content }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chat_template_from_config(stories_dir: Path, tmp_path: Path) -> None:
    shutil.copy(stories_dir / "tokenizer.json", tmp_path)
    config = json.loads((stories_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template(MESSAGES)
    # lstrip_blocks drops the indentation before {% %}, trim_blocks the newline after it.
    assert text == "<s>\n<|system|>Be brief.</s>\n<|user|>Hi</s>\n<|assistant|>\n"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("Hi</s>\n")
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[1] != 1  # the template's BOS is not doubled
    with pytest.raises(ValueError, match="chat template: unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_default_chat_template(stories: Tokenizer) -> None:
    assert stories.chat_template is None
    expected = "system: Be brief.\nuser: Hi\nassistant: "
    assert stories.apply_chat_template(MESSAGES) == expected
    assert ByteTokenizer().apply_chat_template(MESSAGES) == expected
    assert ByteTokenizer(chat_template=DEFAULT_CHAT_TEMPLATE).apply_chat_template(
        MESSAGES, add_generation_prompt=False
    ) == expected.removesuffix("assistant: ")


def test_chat_prompt_ids_add_no_bos_the_template_left_out(stories_dir: Path,
                                                         tmp_path: Path) -> None:
    """A model's template writes the special tokens it wants (transformers and vLLM encode its
    text adding none); jaxserve's fallback template writes none, so its text gets the usual BOS.
    Templates see every special token tokenizer_config.json names, and no `bos_token` that
    only generation_config.json has (Qwen's directories)."""
    shutil.copy(stories_dir / "tokenizer.json", tmp_path)
    config = json.loads((stories_dir / "tokenizer_config.json").read_text())
    config |= {"bos_token": None, "unk_token": "<unk>", "chat_template": (
        "[{{ bos_token }}|{{ unk_token }}]{% for m in messages %}<|{{ m.role }}|>"
        "{{ m.content }}{{ eos_token }}{% endfor %}")}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template(MESSAGES)
    assert text.startswith("[|<unk>]<|system|>Be brief.</s>")
    ids = tok.chat_prompt_ids(text)
    assert ids == tok.encode(text, add_special_tokens=False) and ids[0] != tok.bos_token_id
    stories = Tokenizer.from_dir(stories_dir)  # no template of its own: the fallback's text
    fallback = stories.apply_chat_template(MESSAGES)
    assert stories.chat_prompt_ids(fallback) == stories.encode(fallback)
    assert stories.chat_prompt_ids(fallback)[0] == stories.bos_token_id


def test_chat_template_helpers_and_sandbox() -> None:
    dated = ByteTokenizer(chat_template="{{ strftime_now('%Y') }}{{ messages | tojson }}")
    text = dated.apply_chat_template([{"role": "user", "content": "é"}])
    assert text[:2] == "20" and text[4:] == '[{"role": "user", "content": "é"}]'
    escape = ByteTokenizer(chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(SecurityError):
        escape.apply_chat_template(MESSAGES)
    # templates for assistant-only training mark the assistant's text; it renders as its body
    marked = ByteTokenizer(chat_template=(
        "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %};{% endfor %}"))
    assert marked.apply_chat_template([{"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Yo"}]) == (
        "user: Hi;assistant: Yo;")


def test_token_bytes_spell_the_text(stories: Tokenizer) -> None:
    """Joined, the tokens' bytes are the text: SentencePiece's "▁" as a space, byte-fallback
    pieces as their bytes, byte-level BPE through GPT-2's alphabet; a piece of a character is
    named by its bytes, so two such pieces never share a name."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["Hello world, hello there"] * 4, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    text = "Hello world, 你好 é"
    for tok in (stories, Tokenizer(bpe), ByteTokenizer()):
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(tok.token_bytes(i) for i in ids).decode()
        assert joined in (text, " " + text)  # SentencePiece writes the dummy prefix space
        names = [token_text(tok, i) for i in ids]
        assert any(n.startswith("bytes:\\x") for n in names)
        assert all(n == tok.token_bytes(i).decode() for n, i in zip(names, ids, strict=True)
                   if not n.startswith("bytes:"))
    ids = stories.encode("Once upon a time", add_special_tokens=False)
    assert [token_text(stories, i) for i in ids] == [" Once", " upon", " a", " time"]
    assert token_text(ByteTokenizer(), ByteTokenizer.BOS_ID) == "<s>"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be a dict, got str"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([MESSAGES[0], {"role": 1, "content": "x"}], r"messages\[1\]\.role must be a str, got int"),
        (
            [{"role": "user", "content": None}],
            r"messages\[0\]\.content must be a str, got NoneType",
        ),
    ],
)
def test_chat_messages_are_validated(messages, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ByteTokenizer().apply_chat_template(messages)
