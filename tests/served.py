"""The test server: constants, a uvicorn in a thread, and the checks every server test uses
(the fixtures that build it are in conftest.py)."""

import asyncio
import contextlib
import re
import socket
import threading
import time

import httpx
import uvicorn

from jaxserve.server.connections import uvicorn_config

MODEL = "stories"
KEY = "sk-jaxserve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"
BODY_LIMIT = 64 << 10
# a kept-alive connection is reused only within a second of its last response: uvicorn closes
# one idle for 5 s, httpx's own expiry is 5 s too, and a request sent on one the server is just
# closing fails ("Server disconnected") whenever a test pauses about 5 s between two requests
KEEPALIVE = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=1.0)


@contextlib.contextmanager
def uvicorn_server(app, header_timeout_s: float = 10.0, max_connections: int = 1000):
    """uvicorn in a thread on a free port of 127.0.0.1, with `jaxserve serve`'s connection
    guards; yields (base URL, the uvicorn server)."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, header_timeout_s=header_timeout_s,
                                           max_connections=max_connections,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def uvicorn_url(app, **guards):
    """`uvicorn_server`, yielding the base URL only."""
    with uvicorn_server(app, **guards) as (url, _):
        yield url


def metrics_of(http) -> dict[str, float]:
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
    return values


def succeeds(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def assert_error(r, status, param=None, text=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    if text is not None:
        assert text in error["message"]


def wait_idle(server, timeout=60.0):
    """The engine's stats once no request runs or waits (aborts and the last steps take their
    time on a busy machine: `timeout` only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if not stats["num_requests_running"] and not stats["num_requests_waiting"]:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {server.engine.stats()}")


@contextlib.contextmanager
def held(server, count: int):
    """In the block, the server's engine advances no request until `count` are in it, steps
    until all of them run, then holds them (its iterations still apply adds and aborts, so
    that a request past a full queue is refused and a request aborted goes): none of them can
    finish inside the block, however slow or busy this machine. Released at its end."""
    llm = server.engine.engine
    step, released = llm.step, threading.Event()

    def held_step():  # on the engine thread, the only one that touches the engine
        stats = llm.stats()
        running = stats["num_requests_running"]
        if released.is_set() or (running + stats["num_requests_waiting"] >= count > running):
            return step()
        llm.last_step_tokens = None  # nothing ran: no iteration for the metrics to count
        return []

    llm.step = held_step
    try:
        yield
    finally:
        released.set()
        del llm.step  # the engine's own again


def abandon_while_running(server, body: dict) -> None:
    """POST `body` (not streamed) to /v1/completions and go away, the connection closed, once
    the engine runs it, the engine held meanwhile (`held`): the request cannot finish first,
    and it was admitted (a client gone while its request is being admitted leaves nothing
    for the engine to abort); returns once the server let it go."""
    async def go():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            request = asyncio.ensure_future(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while server.engine.stats()["num_requests_running"] < 1:
                assert time.monotonic() < deadline and not request.done(), server.engine.stats()
                await asyncio.sleep(0.01)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request

    with held(server, 1):
        asyncio.run(go())
        wait_idle(server)  # aborted while held: it never ran on
