"""Seeded structured-output workloads: JSON schemas and regexes that llguidance compiles and a
short generation can complete (strings have maxLength or a pattern, arrays maxItems, objects no
additional properties, nesting at most three deep), for the grammar tests and the end-to-end
model tests.

    json_schemas(100, seed=0)   varied object schemas (nested objects, arrays, enums, ranges,
                                patterns, booleans), each estimated at <= MAX_BYTES of compact JSON
    regexes(100, seed=0)        varied regexes (classes, alternations, bounded repetitions,
                                optional groups, literals; no anchors) that mean the same to
                                Python's re and to llguidance (Rust's regex): explicit classes,
                                no \\d or \\w (their Unicode tables differ: llguidance's \\d
                                matches digits Python 3.11's does not)
"""

import random

MAX_BYTES = 160  # an instance's estimated compact JSON, at most (two bytes per string character)

KEYS = ["id", "name", "age", "tags", "kind", "size", "note", "ok", "score", "city", "code",
        "level", "color", "owner", "count", "unit", "flag", "rank", "title", "zip"]
PATTERNS = [r"^[a-z]{2,6}$", r"^[A-Z]{3}-[0-9]{3}$", r"^[0-9]{5}$", r"^(red|green|blue)$",
            r"^[a-f0-9]{4,8}$", r"^v[0-9]\.[0-9]{1,2}$", r"^[A-Z][a-z]{1,7}$",
            r"^[a-z]{1,8}@[a-z]{2,5}\.(com|org)$"]
PATTERN_BYTES = 16  # the longest a pattern above usually gives, quoted
ENUMS = [["red", "green", "blue"], ["low", "mid", "high"], ["yes", "no"], [1, 2, 3, 5, 8],
         ["cat", "dog", "bird", "fish"], [0, 10, 100], ["on", "off", None]]


def json_schemas(n: int = 100, seed: int = 0) -> list[dict]:
    """`n` object schemas, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        schema = _object(rng, depth=rng.choice([1, 1, 2, 2, 3]))
        if _max_bytes(schema) <= MAX_BYTES:
            out.append(schema)
    return out


def regexes(n: int = 100, seed: int = 0) -> list[str]:
    """`n` regexes of 2 to 5 parts, the same for the same seed."""
    rng = random.Random(seed)
    return ["".join(_regex_part(rng) for _ in range(rng.randint(2, 5))) for _ in range(n)]


def _object(rng: random.Random, depth: int) -> dict:
    keys = rng.sample(KEYS, rng.randint(1, 4))
    props = {k: (_value(rng, depth - 1) if depth > 1 and rng.random() < 0.4 else _leaf(rng))
             for k in keys}
    required = [k for k in keys if rng.random() < 0.6] or keys[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    if rng.random() < 0.5:
        return _object(rng, depth)
    items = _object(rng, depth) if depth > 1 and rng.random() < 0.3 else _leaf(rng)
    lo = rng.randint(0, 2)
    return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean", "array"])
    if kind == "string":
        hi = rng.randint(1, 12)
        return {"type": "string", "minLength": rng.randint(0, min(hi, 3)), "maxLength": hi}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.choice(ENUMS)}
    if kind == "integer":
        lo = rng.choice([-100, -5, 0, 1, 18])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([5, 50, 1000])}
    if kind == "number":
        lo = rng.choice([-1, 0, 0.5, 10])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 100, 1e4])}
    if kind == "boolean":
        return {"type": "boolean"}
    lo = rng.randint(0, 2)
    item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9},
                       {"type": "string", "maxLength": 4}, {"type": "boolean"}])
    return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}


def _max_bytes(schema: dict) -> int:
    """A rough bound on an instance's compact JSON size (numbers' fractions taken as short)."""
    if "enum" in schema:
        return max(len(repr(v)) for v in schema["enum"]) + 2
    kind = schema["type"]
    if kind == "object":
        return 2 + sum(len(k) + 4 + _max_bytes(v) for k, v in schema["properties"].items())
    if kind == "array":
        return 2 + schema["maxItems"] * (1 + _max_bytes(schema["items"]))
    if kind == "string":
        return PATTERN_BYTES if "pattern" in schema else 2 + 2 * schema["maxLength"]
    if kind in ("integer", "number"):
        return len(str(schema["maximum"])) + 6
    return 5


_CLASSES = ["[a-z]{1,6}", "[0-9]{2,4}", "[A-Z][a-z]{0,5}", "[a-f0-9]{4}", "[A-Za-z0-9_]{1,8}",
            "[0-9]{1,3}", "[aeiou]{2}", "[xyz]{1,3}", "[#%&]", r"[^a-z\n]{1,2}"]
_ALTERNATIONS = ["(cat|dog|bird)", "(yes|no)", "(GET|POST|PUT|DELETE)", "(alpha|beta|rc)",
                 "(Mon|Tue|Wed|Thu|Fri)", "(kg|g|mg)"]
_OPTIONAL = ["(-[0-9]{1,2})?", r"(\.[a-z]{2,3})?", "(!)?", "( [A-Z])?", "(s|es)?"]
_GROUPS = [r"([a-z]{1,3}\.){1,3}", "(ab|cd){1,3}", "([0-9]:){2}", "(x[0-9]){0,2}"]
_LITERALS = ["id", "user", "v", "item", "No", "ok", "ref"]
_SEPARATORS = ["-", "_", ":", "@", r"\.", " ", ",", "/", ""]


def _regex_part(rng: random.Random) -> str:
    group = rng.choice([_CLASSES, _CLASSES, _ALTERNATIONS, _OPTIONAL, _GROUPS, _LITERALS])
    return rng.choice(group) + rng.choice(_SEPARATORS)
