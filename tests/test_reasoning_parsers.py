"""Reasoning parsers (jaxserve/text/reasoning.py): a thinking model's <think>...</think> apart
from its answer, finished and streamed in any pieces alike."""

import random

import pytest
from test_tool_parsers import streamed

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
            events = streamed(ReasoningStream(name), text, rng, longest=5)
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


def _chat(body: dict | None = None):
    from jaxserve.server import protocol

    return protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
                               | (body or {}))


def _out(text: str, finished: bool):
    from jaxserve.request import CompletionOutput, RequestOutput

    return RequestOutput("r", None, [1], [CompletionOutput(
        0, text, [7] * len(text), "stop" if finished else None)], finished=finished)


@pytest.mark.parametrize("include", [True, False])
def test_the_server_gives_reasoning_content_apart_streamed_or_not(include):
    from jaxserve.server.responses import Formatter

    text = "Two and two.\n</think>\n\n4"
    body = {} if include else {"include_reasoning": False}
    whole = Formatter("chat", "id", 0, "m", None, _chat(body), [""],
                      reasoning_parser="deepseek_r1").response([_out(text, True)])
    message = whole["choices"][0]["message"]
    assert message["content"] == "\n\n4"
    assert message.get("reasoning_content") == ("Two and two.\n" if include else None)
    assert ("reasoning_content" in message) == include
    fmt = Formatter("chat", "id", 0, "m", None, _chat(body), [""],
                    reasoning_parser="deepseek_r1")
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    deltas = [fmt.chunks(0, _out(p, i == len(pieces) - 1))[-1]["choices"][0]["delta"]
              for i, p in enumerate(pieces)]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == "\n\n4"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (
        "Two and two.\n" if include else "")


def test_without_a_reasoning_parser_the_thinking_stays_content():
    from jaxserve.server.responses import Formatter

    body = Formatter("chat", "id", 0, "m", None, _chat(), [""]).response(
        [_out("<think>x</think>y", True)])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}


def test_a_server_with_an_unknown_reasoning_parser_is_refused():
    from jaxserve.server import ServerConfig

    with pytest.raises(ValueError, match=r"reasoning_parser 'granite'.*deepseek_r1"):
        ServerConfig(reasoning_parser="granite")
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
