"""Type checks for user-given values (a leaf module): bad input is a ValueError naming the field,
never a TypeError from deep inside, and never a bool taken for a number."""

import math
import numbers


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
