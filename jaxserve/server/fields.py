"""The pieces every part of the server's request checking shares: the error response
(`APIError`, in vLLM's envelope) and the small checks of a field's value. A leaf: protocol.py,
structured.py, body.py and the middleware import it."""

from typing import Any

from jaxserve.config.checks import show

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
               504: "TimeoutError"}


class APIError(Exception):
    """An error response: HTTP status, message, the offending request field, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def same(value: Any, off: Any) -> bool:
    """value == off, with a bool never equal to a number (True == 1 in Python)."""
    return value == off and isinstance(value, bool) == isinstance(off, bool)


def get_field(body: dict, name: str, check, what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(400, f"{name} must be {what}, got {show(value)}", param=name)
    return value


def is_text(value: Any) -> bool:
    """A non-empty string that UTF-8 can encode (JSON can carry a lone surrogate)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
