"""The test server: constants, a uvicorn in a thread, and the checks every server test uses
(the fixtures that build it are in conftest.py)."""

import contextlib
import re
import socket
import threading
import time

import uvicorn

from jaxserve.server.connections import uvicorn_config

MODEL = "stories"
KEY = "sk-jaxserve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"
BODY_LIMIT = 64 << 10


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


def wait_idle(server, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if not stats["num_requests_running"] and not stats["num_requests_waiting"]:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {server.engine.stats()}")
