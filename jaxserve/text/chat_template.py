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

# Used when a model ships no chat template: "role: content" lines, then the assistant's turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
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
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{i}] has no '{field}'")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise ValueError(f"messages[{i}].{field} must be a str, got {kind}")


def pick_template(value: Any) -> str | None:
    # tokenizer_config.json holds one template, or a list of {"name", "template"}.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None
