"""Type checks for user-given values (a leaf module): bad input is a ValueError naming the field,
never a TypeError from deep inside, and never a bool taken for a number."""

import json
import math
import numbers
from pathlib import Path
from typing import Any


def is_int(value) -> bool:
    """An integer and not a bool (True is an int in Python, never a count or a seed here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite(value) -> bool:
    """A real number, not a bool, that fits a float and is finite (an int of 400 digits does
    not)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def show(value) -> str:
    """repr, cut short: an error message quotes the value, not a 400-digit number."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON file holding an object ({} where there is no file); a ValueError naming the
    file otherwise."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data
