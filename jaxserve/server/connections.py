"""Connection hygiene: what a client that holds connections open, or opens too many, may take.

    header_timeout_s         a connection's request line and headers must arrive within this
                             (slowloris): else 408 and the connection is closed. Counted from
                             the connection's start and again after each response.
    max_connections          one more open connection is answered 503 and closed at once
    max_concurrent_requests  one more /v1 request in flight is answered 503 (Retry-After)

The request body's own deadline (`body_timeout_s`) is kept where the body is read
(`app._read_json`); idle keep-alive connections close after uvicorn's `timeout_keep_alive`.
Every answer is in the OpenAI error envelope; the first two are written on the raw connection
(no request was parsed yet, so there is no ASGI request to answer).
"""

import json
import logging

import h11
import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.server.fields import APIError

log = logging.getLogger("jaxserve.server")


def _raw_error(transport, error: APIError) -> None:
    """Write `error` as a whole HTTP response on `transport` and close it."""
    body = json.dumps(error.body()).encode()
    reason = {408: "Request Timeout", 503: "Service Unavailable"}[error.status]
    head = (f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    transport.write(head + body)
    transport.close()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a cap on open connections; the
    limits are class attributes (`protocol_class` makes a subclass with a config's)."""

    header_timeout_s = 10.0
    max_connections = 1000

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d are open (max_connections)",
                        len(self.connections) - 1)
            _raw_error(transport, APIError(503, f"the server has {self.max_connections} open "
                                           "connections (max_connections); retry later"))
            return
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request's headers, on a kept-alive connection

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            _raw_error(self.transport, APIError(408, "the request's headers did not arrive "
                                                f"within {self.header_timeout_s} s "
                                                "(header_timeout_s)"))


def protocol_class(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` /v1 requests in flight (a stream counts until it
    ends); one more gets a 503 with Retry-After."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            scope.setdefault("jaxserve", {})["error"] = "max_concurrent_requests"
            error = APIError(503, f"{self.limit} requests are in flight "
                             "(max_concurrent_requests); retry later",
                             headers={"Retry-After": "1"})
            response = JSONResponse(error.body(), status_code=503, headers=error.headers)
            return await response(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def uvicorn_config(app, *, header_timeout_s: float, max_connections: int,
                   timeout_graceful_shutdown: float | None = None) -> uvicorn.Config:
    """The uvicorn config jaxserve serves with: h11 with the guards above, no log config of
    its own (jaxserve's logging), lifespan on."""
    return uvicorn.Config(app, http=protocol_class(header_timeout_s, max_connections),
                          log_config=None, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=timeout_graceful_shutdown)
