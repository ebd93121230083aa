"""OpenAI's `tools` and `tool_choice`, checked, and the forced calls they ask for.

    check_tools(tools)            the function tools, each a ValueError naming its field
    check_tool_choice(choice, .)  "none" | "auto" | "required" | the name of one function
    forced_schema(tools, choice)  the JSON schema that structured output constrains the
                                  answer to when a call is forced: for "required" a list of
                                  {"name", "parameters"} (one of the tools each, its
                                  parameters matching its schema), for a named function its
                                  parameters alone (as vLLM's)
    forced_calls(text, choice)    the calls a forced answer holds
    ForcedCallStream              the same as OpenAI's streaming deltas: each call's name as
                                  soon as it is known, then its arguments as they come

Host only: json and jsonschema (whose meta-schemas say what a schema is).
"""

import json
import re
from typing import Any

from jaxserve.config.checks import show
from jaxserve.text.tool_parsers import ToolCall

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def check_tools(tools: Any) -> list[dict]:
    """`tools` as OpenAI sends them, [{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}]: the list unchanged, or a ValueError naming the
    field. Each `parameters` must be a JSON schema (checked against its meta-schema)."""
    import jsonschema

    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {show(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where} must be an object whose type is "function", got '
                             f"{show(tool)}")
        extra = [key for key in tool if key not in ("type", "function")]
        if extra:
            raise ValueError(f"{where}: unknown field {show(extra[0])}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object, got {show(function)}")
        extra = [key for key in function if key not in _FUNCTION_KEYS]
        if extra:
            raise ValueError(f"{where}.function: unknown field {show(extra[0])}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                             f"'-', got {show(name)}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} names two tools")
        names.add(name)
        if function.get("description") is not None and not isinstance(
                function["description"], str):
            raise ValueError(f"{where}.function.description must be a string, got "
                             f"{show(function['description'])}")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ValueError(f"{where}.function.strict must be a boolean, got "
                             f"{show(function['strict'])}")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError(f"{where}.function.parameters must be a JSON schema (an "
                                 f"object), got {show(parameters)}")
            try:
                jsonschema.validators.validator_for(parameters).check_schema(parameters)
            except jsonschema.SchemaError as error:
                at = "".join(f"[{p!r}]" for p in error.absolute_path)
                raise ValueError(f"{where}.function.parameters{at} is not a JSON schema: "
                                 f"{error.message}") from None
    return tools


def check_tool_choice(choice: Any, tools: list[dict] | None) -> str | None:
    """"none", "auto", "required" or {"type": "function", "function": {"name"}} -> the mode,
    or the named function's name (None: no choice given). A ValueError naming tool_choice for
    any other value, a name no tool has, or a call asked for with no tools."""
    if choice is None:
        return None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ValueError(f'tool_choice "{choice}" needs tools')
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                         f'"function", "function": {{"name": ...}}}}, got {show(choice)}')
    known = [t["function"]["name"] for t in tools or ()]
    if name not in known:
        raise ValueError(f"tool_choice names the function {name!r}, which no tool is (tools: "
                         f"{', '.join(known) or 'none'})")
    return name


def _parameters(tool: dict) -> dict:
    # a function without parameters takes none: an empty object
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_schema(tools: list[dict], choice: str, parallel: bool = True) -> dict | None:
    """The schema a forced call's answer must match (None: nothing forced, for "none" and
    "auto"). `parallel` False: "required" makes exactly one call."""
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        return next(_parameters(t) for t in tools if t["function"]["name"] == choice)
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema | ({"maxItems": 1} if not parallel else {})


def forced_calls(text: str, choice: str) -> list[ToolCall] | None:
    """The calls of a forced answer, their arguments as the model wrote them (as the stream
    gives them). An answer cut short (max_tokens) gives the calls it completed, as its stream
    did; None where it completed none."""
    try:
        value = json.loads(text)
    except ValueError:
        if choice != "required":
            return None
        stream = ForcedCallStream(choice)
        stream.feed(text)
        return [call for call in stream.calls if _is_object(call.arguments)] or None
    if choice == "required" and not (isinstance(value, list) and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in value)):
        return None
    stream = ForcedCallStream(choice)
    stream.feed(text)
    return stream.calls


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ForcedCallStream:
    """A forced answer's stream as tool-call events: `feed(text)` returns ("name", index,
    ToolCall) when a call's name is complete and ("arguments", index, text) for each piece of
    its arguments. For a named function the whole answer is the arguments; for "required"
    the answer is [{"name": ..., "parameters": {...}}, ...], whose "parameters" values are
    passed on as they come (the grammar writes a call's keys in the schema's order: the name
    first)."""

    def __init__(self, choice: str):
        self.choice = choice
        self.calls: list[ToolCall] = []
        self._text = ""
        self._at = 0  # scanned up to here
        self._depth = 0  # brackets open, outside strings: 1 in the list, 2 in a call
        self._in_string = self._escaped = False
        self._string_from = 0
        self._expect_key = False  # in a call, the next string is a key
        self._key: str | None = None  # the call's key whose value comes
        self._arguments_from: int | None = None  # where the parameters' value began

    def feed(self, delta: str) -> list[tuple]:
        if self.choice != "required":  # the arguments are the answer itself
            events = []
            if not self.calls:
                self.calls.append(ToolCall(self.choice, ""))
                events.append(("name", 0, self.calls[0]))
            if delta:
                self.calls[0].arguments += delta
                events.append(("arguments", 0, delta))
            return events
        self._text += delta
        events: list[tuple] = []
        start = self._at
        while self._at < len(self._text):
            ch, i = self._text[self._at], self._at
            self._at += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 2:
                        self._string(json.loads(self._text[self._string_from:i + 1]), events)
            elif ch == '"':
                self._in_string, self._string_from = True, i
            elif ch in "[{":
                if self._depth == 2 and self._key == "parameters":
                    self._arguments_from = start = i
                self._depth += 1
                self._expect_key = self._depth == 2
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 2 and self._arguments_from is not None:
                    events += self._arguments(start, i + 1)
                    self._arguments_from = self._key = None
            elif ch == "," and self._depth == 2:
                self._expect_key = True
        if self._arguments_from is not None:
            events += self._arguments(start, self._at)
        return events

    def finish(self) -> list[tuple]:
        return []  # every piece was given as it came

    def _string(self, text: str, events: list) -> None:
        """A string in a call: a key, or the value of one."""
        if self._expect_key:
            self._key, self._expect_key = text, False
        elif self._key == "name":
            self.calls.append(ToolCall(text, ""))
            events.append(("name", len(self.calls) - 1, self.calls[-1]))

    def _arguments(self, start: int, end: int) -> list[tuple]:
        piece = self._text[start:end]
        if not piece or not self.calls:
            return []
        self.calls[-1].arguments += piece
        return [("arguments", len(self.calls) - 1, piece)]
