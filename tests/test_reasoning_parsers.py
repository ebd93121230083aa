"""Reasoning parsers (jaxserve/text/reasoning.py): a thinking model's <think>...</think> apart
from its answer, finished and streamed in any pieces alike."""

import random

import pytest

from jaxserve.text.reasoning import ReasoningStream, split


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "\n\nHello!"),
    ("qwen3", "Hello!", None, "Hello!"),  # enable_thinking off: no tags at all
    ("qwen3", "\n<think>Still thinking about", "Still thinking about", None),  # cut short
    ("qwen3", "<think></think>Hi", None, "Hi"),
    ("qwen3", "Use <think> tags like this.", None, "Use <think> tags like this."),
    ("deepseek_r1", "Let me add 2 and 2.\n</think>\n\n4", "Let me add 2 and 2.\n", "\n\n4"),
    ("deepseek_r1", "<think>Two and two.</think>4", "Two and two.", "4"),
    ("deepseek_r1", "Still thinking", "Still thinking", None),  # the template opened it
    ("deepseek_r1", "a < b </th and then </think>so", "a < b </th and then ", "so"),
])
def test_thinking_and_answer_split(name, text, reasoning, content):
    assert split(name, text) == (reasoning, content)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_stream_in_any_pieces_gives_the_same_split(name):
    rng = random.Random(1)
    for text in ("<think>\nstep 1 < step 2 </thinking? no\n</think>\n\nDone.",
                 "No thinking </think> here", "  <thi", ""):
        whole = split(name, text)
        for _ in range(20):
            stream, events, i = ReasoningStream(name), [], 0
            while i < len(text):
                j = i + rng.randint(1, 5)
                events += stream.feed(text[i:j])
                i = j
            events += stream.finish()
            reasoning = "".join(t for k, t in events if k == "reasoning") or None
            content = "".join(t for k, t in events if k == "content") or None
            assert (reasoning, content) == whole, (text, events)


def test_thinking_streams_while_it_comes():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi") == []
    assert stream.feed("nk>Hmm, ") == [("reasoning", "Hmm, ")]
    assert stream.feed("ok</th") == [("reasoning", "ok")]
    assert stream.feed("ink>Yes") == [("content", "Yes")]


def test_an_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"deepseek_r1.*qwen3"):
        ReasoningStream("granite")
