"""The detokenizers: ours (IncrementalDetokenizer) on stories260K and the byte tokenizer, its
plain-piece path, and DecodeStream (StreamDetokenizer) on a byte-level BPE tokenizer."""

import copy
import json
import random
from pathlib import Path

import pytest
from bpe_tokenizer import MIXED_TEXT, byte_level_bpe
from hypothesis import assume, given
from hypothesis import strategies as st
from tokenizer_checks import FAST, stream
from tokenizers import Tokenizer as HFTokenizer

from jaxserve.text.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from jaxserve.text.tokenizer import ByteTokenizer, Tokenizer


@pytest.fixture(scope="session")
def stories(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


@pytest.fixture(scope="session")
def cases(stories_dir: Path) -> list[dict]:
    return json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    return byte_level_bpe()


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
