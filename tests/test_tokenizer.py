"""Tokenizer, ByteTokenizer and chat templates (the detokenizers: test_detokenizer.py)."""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from tokenizer_checks import FAST, stream
from tokenizers import Tokenizer as HFTokenizer

from jaxserve.text.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    token_text,
)


@pytest.fixture(scope="session")
def stories(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


@pytest.fixture(scope="session")
def cases(stories_dir: Path) -> list[dict]:
    return json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]


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
        tok.apply_chat_template([{"role": "tool", "content": "x", "tool_call_id": "call-1"}])


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
