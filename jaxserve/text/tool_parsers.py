"""Tool calls in a model's text, as vLLM's `--tool-call-parser` reads them: a parser per format
of the families we serve. Text that does not parse as calls stays content.

    hermes       Hermes / Qwen 2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
                 blocks, any number, after optional content (an unclosed last block counts)
    llama3_json  Llama 3.1-3.3: the whole answer a JSON object {"name", "parameters" or
                 "arguments"}, several separated by ";", optionally after <|python_tag|>
    mistral      `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (or, in later
                 templates, name[ARGS]{...} per call), after optional content
    pythonic     Llama 3.2 / 4 style: the whole answer a Python list of calls with keyword
                 arguments, `[get_weather(city="Paris"), get_time()]`

`parse(name, text)` gives the content and the calls of a finished answer; `ToolCallStream` the
same as OpenAI's streaming deltas (content as it comes, then each call's name and its
arguments once the call is complete). Host only: json, ast and re.
"""

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

from jaxserve.text.reasoning import tag_tail


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _mistral_id() -> str:
    """Mistral's templates take 9 alphanumerics as a call's id."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _call(obj, args_keys=("arguments", "parameters"), make_id=None) -> ToolCall:
    """A call from a decoded JSON object; ValueError where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a call: no name")
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text already
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("a call's arguments must be an object")
    text = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text) if make_id is None else ToolCall(obj["name"], text,
                                                                       make_id())


def _json_values(text: str, separators: str = "") -> list:
    """Every JSON value in `text`, one after another (whitespace and `separators` between);
    ValueError if anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


class Hermes:
    name = "hermes"
    marker = "<tool_call>"  # where calls begin (content before it)
    leading = ()  # or: the whole answer is calls when it starts with one of these
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)

    def calls(self, text: str, final: bool = True) -> tuple[list[ToolCall], int]:
        """The calls of `text` from its marker on, and how far they reach; `final` False
        reads only closed blocks (a stream's so far)."""
        calls, end = [], 0
        for match in self._BLOCK.finditer(text):
            if match.group(2) is not None and not final:
                break
            body = match.group(1) if match.group(1) is not None else match.group(2)
            calls += [_call(v) for v in _json_values(body)]
            end = match.end()
        return calls, end


class Llama3Json:
    name = "llama3_json"
    marker = None
    leading = ("<|python_tag|>", "{")

    def calls(self, text: str, final: bool = True) -> tuple[list[ToolCall], int]:
        if not final:
            return [], 0
        body = text.strip().removeprefix("<|python_tag|>")
        return [_call(v) for v in _json_values(body, ";")], len(text)


class Mistral:
    name = "mistral"
    marker = "[TOOL_CALLS]"
    leading = ()
    _ARGS = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*\[ARGS\]")

    def calls(self, text: str, final: bool = True) -> tuple[list[ToolCall], int]:
        if not final:
            return [], 0
        calls = []
        for part in text.split(self.marker)[1:]:
            if part.lstrip().startswith("["):  # a JSON list of calls
                for value in _json_values(part):
                    for obj in value if isinstance(value, list) else [value]:
                        calls.append(_call(obj, make_id=_mistral_id))
                continue
            while part.strip():  # name[ARGS]{...}, one after another
                match = self._ARGS.match(part)
                if match is None:
                    raise ValueError("not a call")
                args, end = json.JSONDecoder().raw_decode(part, match.end())
                calls.append(_call({"name": match.group(1), "arguments": args},
                                   make_id=_mistral_id))
                part = part[end:]
        return calls, len(text)


class Pythonic:
    name = "pythonic"
    marker = None
    leading = ("<|python_start|>", "[")

    def calls(self, text: str, final: bool = True) -> tuple[list[ToolCall], int]:
        if not final:
            return [], 0
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except SyntaxError as error:
            raise ValueError(str(error)) from None
        if not isinstance(tree, ast.List):
            raise ValueError("not a list of calls")
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                    or node.args):
                raise ValueError("a call by name with keyword arguments only")
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            if None in args:  # (**kwargs)
                raise ValueError("a call by name with keyword arguments only")
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls, len(text)


PARSERS = {p.name: p for p in (Hermes(), Llama3Json(), Mistral(), Pythonic())}


def get_parser(name: str):
    """A parser by its vLLM name; ValueError naming the choices."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser {name!r}: one of {sorted(PARSERS)}")
    return PARSERS[name]


def _start(parser, text: str) -> int | None:
    """Where the calls of `text` begin under `parser`; None: no call there."""
    if parser.marker is not None:
        i = text.find(parser.marker)
        return None if i < 0 else i
    stripped = text.lstrip()
    return len(text) - len(stripped) if stripped.startswith(parser.leading) else None


def parse(name: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished answer's content (None when empty) and its calls, as its stream gives them
    (`ToolCallStream`): text that does not parse as calls is content."""
    stream = ToolCallStream(name)
    events = stream.feed(text) + stream.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return content or None, stream.calls


class ToolCallStream:
    """A streamed answer's deltas: `feed(text)` and `finish()` return events, each
    ("content", text) or ("call", index, ToolCall). Content streams until a call may begin
    (text that may be a marker's start is held back); from there the text is held, and each
    call is given whole once it is complete (a closed block) or at the end; held text that
    does not parse is given as content at the end."""

    def __init__(self, name: str):
        self.parser = get_parser(name)
        self._text = ""  # the answer so far
        self._sent = 0  # content given out of _text
        self._calls_from: int | None = None  # where the calls begin
        self._done = 0  # how far past _calls_from the calls given reach
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[tuple]:
        self._text += delta
        if self._calls_from is None:
            start = _start(self.parser, self._text)
            if start is None:
                return self._content(self._safe_end())
            self._calls_from = start
            if self.parser.marker is None:  # (only white space before the calls)
                self._sent = start
            events = self._content(start)
        else:
            events = []
        if self.parser.marker is not None:  # closed blocks as they complete
            try:
                calls, end = self.parser.calls(self._text[self._calls_from:], final=False)
            except (ValueError, SyntaxError):
                return events
            for call in calls[len(self.calls):]:
                events.append(("call", len(self.calls), call))
                self.calls.append(call)
            self._done = max(self._done, end)
        return events

    def finish(self) -> list[tuple]:
        if self._calls_from is None:
            return self._content(len(self._text))
        try:
            calls, _ = self.parser.calls(self._text[self._calls_from:])
        except (ValueError, SyntaxError):  # json's errors are ValueErrors
            if self.calls:  # what follows the calls given does not parse: content
                self._sent = self._calls_from + self._done
            return self._content(len(self._text))
        if not calls:
            return self._content(len(self._text))
        events = []
        for call in calls[len(self.calls):]:
            events.append(("call", len(self.calls), call))
            self.calls.append(call)
        return events

    def _content(self, end: int) -> list[tuple]:
        if end <= self._sent:
            return []
        text, self._sent = self._text[self._sent:end], end
        return [("content", text)]

    def _safe_end(self) -> int:
        """How much of the text may go out as content: all but a tail that may begin a
        marker (or, for formats whose calls are the whole answer, nothing until the first
        character that is not white space says)."""
        text = self._text
        if self.parser.marker is None:
            stripped = text.lstrip()
            if not stripped or any(p.startswith(stripped) for p in self.parser.leading):
                return self._sent
            return len(text)
        return len(text) - tag_tail(text, self.parser.marker)
