"""ASGI middleware of the server: the access log (one line per request) and the API key."""

import hmac
import logging
import time

from starlette.responses import JSONResponse

from jaxserve.server.fields import APIError

log = logging.getLogger("jaxserve.server")


class AccessLog:
    """One log line per request, written when its response (streamed or not) has ended."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [0]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            info = scope.get("jaxserve", {})
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else "-"
            details = " ".join(f"{k}={v}" if k != "error" else f"error={v!r}"
                               for k, v in info.items())
            level = logging.INFO if scope["path"].startswith("/v1") else logging.DEBUG
            log.log(level, '%s "%s %s" %d %s %.3fs', client, scope["method"], scope["path"],
                    status[0], details, time.monotonic() - start)


class APIKey:
    """/v1/* need "Authorization: Bearer KEY" (compared in constant time); the rest is open."""

    def __init__(self, app, key: str | None):
        self.app = app
        self.key = None if key is None else key.encode()

    async def __call__(self, scope, receive, send):
        if self.key is not None and scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                scope.setdefault("jaxserve", {})["error"] = "missing or wrong API key"
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
                response = JSONResponse(error.body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
