"""Chat templates as transformers renders them: a sandboxed jinja2 environment with its helpers
(`raise_exception`, `tojson`, `strftime_now`, `{% generation %}`), the message checks, and the
fallback template for models that ship none."""

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no chat template: the tools offered (their JSON) when there are
# some, "role: content" lines (an assistant's calls as their JSON), then the assistant's turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | map(attribute='function') | list"
    " | tojson }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# the special-token names transformers passes to chat templates (its special_tokens_map)
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which templates for assistant-only training
    use to mark the assistant's text: rendered as its body (transformers tracks the marked
    spans; serving needs none of that)."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.cache
def compile_template(source: str) -> jinja2.Template:
    # As transformers: sandboxed, trim_blocks/lstrip_blocks, the same helpers.
    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, **kwargs: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def check_messages(messages: Any) -> None:
    """Messages as OpenAI's chat takes them: {"role", "content"} each; an assistant's may carry
    `tool_calls` (its content then may be None) and a tool's result names its call
    (`tool_call_id`). A ValueError naming the message and field otherwise."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        calls = message.get("tool_calls")
        for field in ("role", "content"):
            if field == "content" and calls and message.get("content") is None:
                continue  # an assistant's calls alone
            if field not in message:
                raise ValueError(f"messages[{i}] has no '{field}'")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise ValueError(f"messages[{i}].{field} must be a str, got {kind}")
        if message["role"] == "tool" and not (isinstance(message.get("tool_call_id"), str)
                                              and message["tool_call_id"]):
            raise ValueError(f"messages[{i}].tool_call_id: a tool message names the call it "
                             "answers")
        if calls is not None:
            _check_calls(calls, f"messages[{i}].tool_calls", message["role"])


def _check_calls(calls: Any, where: str, role: str) -> None:
    if role != "assistant":
        raise ValueError(f"{where}: only an assistant's message carries tool calls")
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise ValueError(f"{where}[{j}] must be {{'id', 'type': 'function', 'function': "
                             "{'name': str, 'arguments': str}}")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{j}].function.arguments must be a JSON object's text, "
                             f"got {function['arguments'][:200]!r}")


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates read them (transformers' and vLLM's convention): a
    call's arguments as an object, not its JSON text; an assistant's calls without content
    have content "" (templates test it, and concatenate it)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "content": message.get("content") or "", "tool_calls": [
                {**call, "function": {**call["function"],
                                      "arguments": json.loads(call["function"]["arguments"])}}
                for call in calls]}
        out.append(message)
    return out


def pick_template(value: Any) -> str | None:
    # tokenizer_config.json holds one template, or a list of {"name", "template"}.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None
