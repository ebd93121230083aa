"""Helpers for test_tokenizer.py and test_detokenizer.py: hypothesis' settings, and `stream`,
which feeds a detokenizer ids and checks its text against the tokenizer's decode."""

from hypothesis import HealthCheck, settings

from jaxserve.text.detokenizer import IncrementalDetokenizer

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
