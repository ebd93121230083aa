"""Reading a request's body, and writing JSON that always renders.

A body is JSON by its Content-Type (else 415), arrives whole within its deadline (else 408: a
client that trickles its body would hold a connection and a handler for ever), stays under the
size limit (413), parses to an object (400), and holds only valid Unicode: JSON's \\u escapes
can carry a lone UTF-16 surrogate, which no tokenizer, response or log line can encode (400
naming the field). No client string then reaches a response that could fail to render.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxserve.config.checks import show
from jaxserve.server.fields import APIError


class SafeJSONResponse(JSONResponse):
    """JSON that always renders: text that cannot be UTF-8 (a lone surrogate a client sent
    and an error message quotes) is written as JSON's \\u escapes instead of failing."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode()


async def read_json(request: Request, max_body_bytes: int,
                    body_timeout_s: float) -> dict[str, Any]:
    """The request's body as a JSON object: 415 unless its Content-Type is JSON, 408 unless it all
    arrives within `body_timeout_s`, 413 past `max_body_bytes`, 400 unless it parses to an
    object whose text is all valid Unicode."""
    kind = request.headers.get("content-type")
    media = (kind or "").split(";")[0].strip().lower()
    if kind is not None and media != "application/json" and not media.endswith("+json"):
        raise APIError(415, "the request body must be JSON (Content-Type: "
                       f"application/json); got Content-Type {show(kind)}")
    limit = max_body_bytes
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    body, size = bytearray(), 0
    async for chunk in _within(request.stream(), body_timeout_s):
        size += len(chunk)
        too_big = too_big or size > limit
        if too_big and size > 16 * limit:
            break
        if not too_big:  # past the limit, read on (so the client gets our answer) but drop
            body += chunk
    if too_big:
        raise APIError(413, f"the request body is over the limit of {limit} bytes "
                       "(max_body_bytes)")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_unicode(data)
    return data


async def _within(chunks: AsyncIterator[bytes], seconds: float) -> AsyncIterator[bytes]:
    """`chunks` (a request body), all of which must arrive within `seconds` (a client that
    trickles its body would hold a connection and a handler for ever): else 408."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks, None), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {seconds:g} s "
                           "(body_timeout_s)", headers={"Connection": "close"}) from None
        if chunk is None:
            return
        yield chunk


def _check_unicode(data: dict[str, Any]) -> None:
    """Every string of the body, keys too, is valid Unicode: JSON's \\u escapes can carry a
    lone UTF-16 surrogate, which no tokenizer, response or log line can encode. 400 naming
    the top-level field that holds one."""
    for key, value in data.items():
        stack = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack += item.keys()
                stack += item.values()
            elif isinstance(item, list):
                stack += item
            elif isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    name = key.encode("utf-8", "backslashreplace").decode()
                    raise APIError(400, f"{name} holds text that is not valid Unicode (a lone "
                                   "UTF-16 surrogate)", param=name) from None
