"""Structured output over HTTP: the request fields that constrain the output (OpenAI's
`response_format`, vLLM's `structured_outputs` object and its older `guided_*` fields, one of them
per request) -> StructuredOutputsParams' keywords, each 400 naming the field the client sent.
StructuredOutputsParams checks the constraint itself; protocol.py builds it."""

from typing import Any

from jaxserve.config.checks import show
from jaxserve.server.fields import APIError, get_field, is_bool, is_str, is_text, same

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_CONSTRAINTS = ("response_format", "structured_outputs", *_GUIDED)
_BACKENDS = ("auto", "guidance", "llguidance")  # jaxserve's grammars run on llguidance
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object",
                    "disable_any_whitespace")
# vLLM's other structured_outputs keys, with the values that change nothing here (one backend:
# nothing to fall back to)
_STRUCTURED_OFF = {"disable_fallback": (False, True), "disable_additional_properties": (False,),
                   "whitespace_pattern": (), "structural_tag": ()}
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def parse_structured(body: dict) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """What the output must match, from whichever field the client used: StructuredOutputsParams'
    keywords (None: free text), and the names its errors go by (its own and the engine's name
    `structured_outputs.<kind>`)."""
    backend = get_field(body, "guided_decoding_backend", is_str, "a string")
    if backend is not None and backend not in _BACKENDS:
        raise APIError(400, f"guided_decoding_backend must be one of {', '.join(_BACKENDS)} "
                       f"(jaxserve's structured output runs on llguidance), got {show(backend)}",
                       param="guided_decoding_backend")
    fmt = _response_format(body.get("response_format"))  # None: none, or "text"
    used = [name for name in _CONSTRAINTS
            if (fmt if name == "response_format" else body.get(name)) is not None]
    if len(used) > 1:
        raise APIError(400, f"{used[0]} and {used[1]} both constrain the output; send one",
                       param=used[1])
    if not used:
        return None, {}
    name = used[0]
    if name == "response_format":  # a schema's errors name where it was
        return fmt, {"structured_outputs": name,
                     "structured_outputs.json": "response_format.json_schema.schema"}
    if name == "structured_outputs":
        return _structured_outputs(body[name]), {}
    return {_GUIDED[name]: body[name]}, {"structured_outputs": name,
                                         f"structured_outputs.{_GUIDED[name]}": name}


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """OpenAI's response_format: text (free), json_object (any JSON object) or json_schema
    ({"name", "schema", "strict", "description"}: the schema)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, 'response_format must be an object whose type is "text", '
                       f'"json_object" or "json_schema", got {show(fmt)}',
                       param="response_format")
    _only(fmt, ("type", "json_schema") if kind == "json_schema" else ("type",),
          "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with a name and a "
                       f"schema, got {show(spec)}", param="response_format")
    _only(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
    for key, check, what in (("name", is_text, "a non-empty string"),
                             ("schema", lambda v: isinstance(v, dict), "an object"),
                             ("strict", is_bool, "a boolean"),
                             ("description", is_str, "a string")):
        value = spec.get(key)
        if (value is not None or key in ("name", "schema")) and not check(value):
            raise APIError(400, f"response_format.json_schema.{key} must be {what}, got "
                           f"{show(value)}", param="response_format")
    return {"json": spec["schema"]}


def _structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's structured_outputs object: StructuredOutputsParams' keywords (it checks them)."""
    if not isinstance(value, dict):
        raise APIError(400, f"structured_outputs must be an object, got {show(value)}",
                       param="structured_outputs")
    _only(value, (*_STRUCTURED_KEYS, *_STRUCTURED_OFF), "structured_outputs")
    for key, offs in _STRUCTURED_OFF.items():
        if value.get(key) is not None and not any(same(value[key], off) for off in offs):
            raise APIError(400, f"structured_outputs.{key} is not supported by jaxserve (got "
                           f"{show(value[key])})", param="structured_outputs")
    return {key: value[key] for key in _STRUCTURED_KEYS if value.get(key) is not None}


def _only(value: dict, keys: tuple[str, ...], where: str) -> None:
    """A 400 naming the top-level field for a key of `value` outside `keys` (an object's typo
    is refused as a field's is)."""
    for key in value:
        if key not in keys and value[key] is not None:
            raise APIError(400, f"{where}: unknown field {show(key)}",
                           param=where.split(".")[0])
