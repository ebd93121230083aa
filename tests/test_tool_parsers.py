"""Tool-call parsers (jaxserve/text/tool_parsers.py) on each format's own model text: several
calls, nested JSON arguments, content around them, text that does not parse staying content,
and a stream fed in pieces giving what the whole answer gives."""

import json
import random

import pytest

from jaxserve.text.tool_parsers import PARSERS, ToolCallStream, get_parser, parse

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"query": {"filters": [{"field": "date", "op": ">=", "value": "2026-01-01"}],
                    "limit": 5}, "note": "naïve café ✓"}


def streamed(stream, text: str, rng: random.Random, longest: int = 6) -> list[tuple]:
    """The events of `stream` fed `text` in random pieces of 1 to `longest` characters, then
    finished."""
    events, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, longest)
        events += stream.feed(text[i:j])
        i = j
    return events + stream.finish()


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "expected"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "search", '
     f'"arguments": {json.dumps(NESTED, ensure_ascii=False)}}}\n</tool_call>', "Let me look.\n",
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None,  # unclosed: a call
     [("get_time", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "celsius"}}; {"name": "search", "arguments": '
     f'{json.dumps(NESTED)}}}', None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", WEATHER), ("get_time", {})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     f'[TOOL_CALLS]search[ARGS]{json.dumps(NESTED)}', "Sure. ",
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time()]', None,
     [("get_weather", WEATHER), ("get_time", {})]),
    ("pythonic", "<|python_start|>[search(query={'filters': [{'field': 'date', 'op': '>=', "
     "'value': '2026-01-01'}], 'limit': 5}, note='naïve café ✓')]<|python_end|>", None,
     [("search", NESTED)]),
])
def test_each_format_gives_its_calls_and_content(name, text, content, expected):
    got_content, calls = parse(name, text)
    assert got_content == content
    assert calls_of(calls) == expected
    for call in calls:
        openai = call.to_openai()
        assert openai["type"] == "function" and openai["function"]["name"] == call.name
        assert isinstance(openai["function"]["arguments"], str) and openai["id"]
    if name == "mistral":  # its templates take 9 alphanumerics
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", "The weather in Paris is mild."),
    ("hermes", 'Here: <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),  # no name
    ("llama3_json", "The weather in Paris is mild."),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, not a call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
    ("mistral", "[TOOL_CALLS] no calls here"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", '[get_weather("Paris")]'),  # positional: not a call we can name
    ("pythonic", "I would call [get_weather(city='Paris')] next."),
])
def test_text_that_does_not_parse_stays_content(name, text):
    assert parse(name, text) == (text, [])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_in_any_pieces_gives_what_the_whole_answer_gives(name):
    texts = {"hermes": 'Checking <tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": '
                       '"</"}]}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
                       '</tool_call>',
             "llama3_json": ' {"name": "a", "parameters": {"x": 1}};{"name": "b", '
                            '"parameters": {}}',
             "mistral": 'ok [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]',
             "pythonic": "[a(x=1), b(y='z')]"}
    rng = random.Random(0)
    for text in (texts[name], "Plain text < with [brackets] and {braces}.", ""):
        whole_content, whole_calls = parse(name, text)
        for _ in range(20):
            events = streamed(ToolCallStream(name), text, rng)
            content = "".join(e[1] for e in events if e[0] == "content")
            calls = [e for e in events if e[0] == "call"]
            assert (content or None) == whole_content
            assert [i for _, i, _ in calls] == list(range(len(calls)))
            assert calls_of(c for _, _, c in calls) == calls_of(whole_calls)


def test_a_hermes_call_streams_as_soon_as_its_block_closes():
    stream = ToolCallStream("hermes")
    assert stream.feed("Let me check.") == [("content", "Let me check.")]
    assert stream.feed(" <tool") == [("content", " ")]  # "<tool" may begin a call: held
    assert stream.feed('_call>{"name": "a", "arguments": {}}') == []
    (event,) = stream.feed("</tool_call>")
    assert event[0] == "call" and event[1] == 0 and event[2].name == "a"
    assert stream.finish() == []


def test_an_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"hermes.*llama3_json.*mistral.*pythonic"):
        get_parser("nope")
