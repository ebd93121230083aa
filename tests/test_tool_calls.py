"""Tools and reasoning in /v1/chat/completions (issue 55), with the official openai client
against the demo server (tests/demo_server.py, started with --enable-auto-tool-choice
--tool-call-parser hermes; the reasoning tests on a second one that also has
--reasoning-parser qwen3). Ported from vLLM's
tests/entrypoints/openai/test_completion_with_function_calling.py (tool use with "auto" and
"required", streamed and not; a named function; tool_choice and tools that disagree) and its
reasoning tests (thinking apart from the answer, streamed; calls read after the thinking),
with our checks: a forced call's arguments validate against its tool's schema on a model that
never learned to call (the demo), the stream gives what the response gives, and the follow-up
turn renders. Where the demo must write a call or a thought, a regex makes it."""

import json
import random
import re

import jsonschema
import openai
import pytest
from demo_server import MODEL, bad_request, demo_server, num_prompt_tokens
from served import KEY
from test_reasoning_parsers import _out
from test_tool_parsers import streamed

from jaxserve.text.tokenizer import ByteTokenizer
from jaxserve.text.tool_specs import ForcedCallStream, forced_calls, forced_schema


@pytest.fixture(scope="module")
def server(demo):
    return demo


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The demo served with --reasoning-parser qwen3 as well."""
    with demo_server(tmp_path_factory.mktemp("thinking") / "serve.log", "--reasoning-parser",
                     "qwen3") as served:
        yield openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The weather in a city over the next days.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TOOLS = [WEATHER, FORECAST]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _valid(calls) -> list[tuple[str, dict]]:
    """Each call's (name, arguments), the arguments checked against its tool's schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _gathered(chunks) -> tuple[str, list[dict], str]:
    """A stream's content, its calls as OpenAI's clients gather them (by index: the first
    delta of a call names it, the rest add to its arguments) and its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.index not in calls:
                    assert call.id and call.function.name, "a call's first delta names it"
                    calls[call.index] = {"id": call.id, "name": call.function.name,
                                         "arguments": ""}
                else:
                    assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls_streamed_or_not(client, parallel):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_completion_tokens=300, temperature=0, parallel_tool_calls=parallel)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = _valid(choice.message.tool_calls)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    content, streamed, finish = _gathered(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
    assert [c["arguments"] for c in streamed] == [
        c.function.arguments for c in choice.message.tool_calls]


def test_a_named_function_is_called_and_its_arguments_stream(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                  max_completion_tokens=300, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named function
    [(name, arguments)] = _valid(choice.message.tool_calls)
    assert name == "get_weather" and set(arguments) == {"city", "unit"}
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content, streamed, finish = _gathered(chunks)
    assert finish == "stop" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        ("get_weather", choice.message.tool_calls[0].function.arguments)]
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 2  # the name, then the arguments as they come


def test_the_follow_up_turn_with_the_tools_result_renders_and_answers(client, http):
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_completion_tokens=300,
        temperature=0).choices[0]
    call = choice.message.tool_calls[0]
    sent = {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [sent]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS,
                                            tool_choice="none", max_completion_tokens=8,
                                            temperature=0)
    message = answer.choices[0].message
    assert message.content and not message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    # the demo's template: the tools, each message as "role: content", a call as its JSON
    arguments = json.loads(call.function.arguments)
    text = (f"tools: {json.dumps(TOOLS, ensure_ascii=False)}\n"
            f"user: {ASK[0]['content']}\n"
            f"assistant: {json.dumps([{'name': call.function.name, 'arguments': arguments}])}\n"
            'tool: {"temperature": 21}\nassistant: ')
    assert answer.usage.prompt_tokens == num_prompt_tokens(text)


def test_auto_reads_the_models_calls_with_the_servers_parser(client):
    """The demo writes no calls of its own: a regex makes it write a Hermes block after some
    text, which the server's parser gives as a call (content before it stays content)."""
    block = ('I will look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>')
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_completion_tokens=200,
                  temperature=0, extra_body=_forced(block))
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look. "
    assert _valid(choice.message.tool_calls) == [("get_weather",
                                                  {"city": "Paris", "unit": "celsius"})]
    content, streamed, finish = _gathered(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("I will look. ", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    # text that is no call stays content, and the answer ends as any other
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_completion_tokens=10, temperature=0).choices[0]
    assert plain.message.content and not plain.message.tool_calls
    assert plain.finish_reason == "length"


def test_none_renders_the_tools_and_calls_nothing(client):
    without = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=4,
                                             temperature=0)
    offered = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice="none", max_completion_tokens=4,
                                             temperature=0)
    assert not offered.choices[0].message.tool_calls and offered.choices[0].message.content
    assert offered.usage.prompt_tokens == without.usage.prompt_tokens + num_prompt_tokens(
        f"tools: {json.dumps(TOOLS, ensure_ascii=False)}\n") - 1  # one BOS in both


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools",
     "tools[0].function.parameters['properties']['a']['type'] is not a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools",
     "must be a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", 'type is "function"'),
    ({"tools": [WEATHER, WEATHER]}, "tools", "names two tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "get_time"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED}, "tool_choice", "no tool"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "constrains"),
    ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": "yes"},
     "parallel_tool_calls", "boolean"),
    ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "arguments must be a JSON object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
])
def test_bad_tools_are_400s_naming_the_field(client, body, param, words):
    request = {"model": MODEL, "messages": ASK, "max_tokens": 4} | body
    extra = {"chat_template_kwargs": request.pop("chat_template_kwargs")} if (
        "chat_template_kwargs" in request) else None  # vLLM's field: not the client's
    for stream in (False, True):
        message = bad_request(lambda stream=stream: client.chat.completions.create(
            **request, stream=stream, extra_body=extra), param)
        assert words in message, message
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices


def test_templates_get_the_tools_the_calls_and_their_kwargs():
    """As transformers' apply_chat_template(tools=...) and vLLM's chat_template_kwargs: the
    template reads `tools`, an assistant's calls with their arguments as objects, a tool's
    result with its call's id, and any variable the request adds (Qwen3's enable_thinking)."""
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    tokenizer = ByteTokenizer(chat_template=template)
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS,
                                         template_kwargs={"enable_thinking": False})
    assert text == ("[get_weather][get_forecast]user:What is the weather in Paris?|"
                    "assistant:<get_weather Paris>|tool:21#c1|<think></think>")
    assert "<think>" not in tokenizer.apply_chat_template(messages, tools=TOOLS)
    with pytest.raises(ValueError, match="tool_call_id"):
        tokenizer.apply_chat_template([*ASK, {"role": "tool", "content": "21"}])
    with pytest.raises(ValueError, match="only an assistant"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x", "tool_calls": []}])



@pytest.mark.parametrize(("choice", "text"), [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris]}", "unit": '
                 '"celsius"}}, {"name":"get_forecast","parameters":{"city":"[x]","days":2}}]'),
    ("required", '[ {"name" : "get_weather" , "parameters" : { "city" : "{", "unit" : '
                 '"fahrenheit" } } ]'),
    ("get_weather", '{"city": "Nice", "unit": "celsius"}'),
])
def test_a_forced_answer_streams_the_calls_it_holds_in_any_pieces(choice, text):
    """Names as soon as they are read, then the arguments piece by piece: gathered, the calls
    of the whole answer, whatever the pieces (brackets and quotes inside strings included),
    and each matching the schema that forced it."""
    import llguidance

    whole = [(c.name, c.arguments) for c in forced_calls(text, choice)]
    assert whole and all(json.loads(arguments) for _, arguments in whole)
    rng = random.Random(3)
    for _ in range(30):
        events = streamed(ForcedCallStream(choice), text, rng, longest=4)
        names = [(e[1], e[2].name) for e in events if e[0] == "name"]
        assert names == [(i, name) for i, (name, _) in enumerate(whole)]
        arguments = ["" for _ in whole]
        for event in events:
            if event[0] == "arguments":
                arguments[event[1]] += event[2]
        assert list(zip([n for _, n in names], arguments, strict=True)) == whole
    schema = forced_schema(TOOLS, choice)
    jsonschema.validate(json.loads(text), schema)
    llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))  # llguidance reads it
    for end in (-3, -12):  # cut short: the calls it completed (all but the last, at worst)
        cut = forced_calls(text[:end], choice)
        if choice != "required":
            assert cut is None
            continue
        got = [(c.name, c.arguments) for c in cut or ()]
        assert got == whole[:len(got)] and len(got) >= len(whole) - 1


def _forced(text: str) -> dict:
    """extra_body making the demo write exactly `text` (a regex of it)."""
    return {"structured_outputs": {"regex": re.sub(r"([.{}])", r"\\\1", text)}}


def _gathered_reasoning(chunks) -> str:
    return "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                   for c in chunks if c.choices)


def test_a_forced_call_waits_for_the_thinking_to_end(thinking):
    """On a server with --reasoning-parser qwen3 a forced call (structured output) constrains
    the answer after the thinking, not the thinking: an answer may open with <think> and then
    think freely (here the demo, pushed to "<", writes "<" on and on: no JSON, all thinking,
    streamed alike), or go straight to the call (pushed away from "<")."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                  max_completion_tokens=24, temperature=0)
    thought = thinking.chat.completions.create(**kwargs, logit_bias={"60": 100}).choices[0]
    assert thought.message.reasoning_content == "<" * 17  # 24 tokens less "<think>"
    assert thought.message.content is None and not thought.message.tool_calls
    assert thought.finish_reason == "length"
    chunks = list(thinking.chat.completions.create(**kwargs, logit_bias={"60": 100},
                                                   stream=True))
    assert _gathered_reasoning(chunks) == "<" * 17
    called = thinking.chat.completions.create(
        **kwargs | {"max_completion_tokens": 300}, logit_bias={"60": -100}).choices[0]
    assert called.message.reasoning_content is None
    assert [name for name, _ in _valid(called.message.tool_calls)] == ["get_weather"]


def test_calls_are_read_from_the_answer_after_the_thinking():
    """The reasoning parser first, then the tool-call parser on the answer (the server's
    response and its stream, fed in pieces)."""
    from jaxserve.server import protocol
    from jaxserve.server.responses import Formatter

    text = ('<think>I need the <tool_call> tool.</think><tool_call>\n{"name": "get_forecast", '
            '"arguments": {"city": "Lyon", "days": 3}}\n</tool_call>')
    req = protocol.parse_chat({"messages": ASK, "tools": TOOLS})

    def formatter():
        return Formatter("chat", "id", 0, MODEL, None, req, [""], reasoning_parser="qwen3",
                         tool_call_parser="hermes")

    choice = formatter().response([_out(text, True)])["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "I need the <tool_call> tool."
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_forecast", {"city": "Lyon", "days": 3})
    fmt = formatter()
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    bodies = [b for i, p in enumerate(pieces) for b in fmt.chunks(0, _out(p, i == len(pieces) - 1))]
    deltas = [b["choices"][0]["delta"] for b in bodies]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (
        "I need the <tool_call> tool.")
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert calls[0]["function"] == {"name": "get_forecast", "arguments": ""}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {
        "city": "Lyon", "days": 3}
    assert bodies[-1]["choices"][0]["finish_reason"] == "tool_calls"
