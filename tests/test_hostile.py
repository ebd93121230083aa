"""A hostile client cannot wedge the server: an amplifying request is refused before anything is
queued, a mass abort leaves the engine serving, a stuck engine turns /health 503 and cannot hold
SIGTERM, stalled and surplus connections are closed, garbage in any field is a 4xx in the
envelope, and a mixed hostile load leaves every page, queue and connection idle."""

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import SERVER_ENGINE
from fake_engine import SilentEngine, StuckEngine
from served import (
    AUTH,
    BODY_LIMIT,
    KEY,
    MODEL,
    PROMPT,
    assert_error,
    succeeds,
    uvicorn_server,
    uvicorn_url,
    wait_idle,
)

from jaxserve.benchmarks import hostile
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.request import SamplingParams
from jaxserve.server import ServerConfig, build_app
from jaxserve.server import app as server_app

TIMEOUT_S = 1.0  # this module's header and body timeouts
MAX_WAITING = 8


@pytest.fixture(scope="module")
def server(stories_dir):
    """The stories server with a small queue and short connection timeouts."""
    engine = AsyncEngine(LLMEngine(stories_dir, EngineConfig.from_overrides(**SERVER_ENGINE)),
                         max_waiting_requests=MAX_WAITING)
    config = ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT, body_timeout_s=TIMEOUT_S)
    with uvicorn_server(build_app(engine, config, MODEL),
                        header_timeout_s=TIMEOUT_S) as (url, uv):
        yield SimpleNamespace(url=url, engine=engine, uvicorn=uv)


@pytest.fixture(scope="module")
def http(server):
    """A connection per request: this server answers a kept-alive connection idle for
    TIMEOUT_S with a 408 and closes it, and a request sent as it does so would get that 408."""
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30, limits=limits) as c:
        yield c


def _idle(server, timeout: float = 60.0) -> dict:
    """The engine with no request and every page free, and no connection left open."""
    stats = wait_idle(server, timeout)
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    deadline = time.monotonic() + timeout
    while server.uvicorn.server_state.connections:
        assert time.monotonic() < deadline, len(server.uvicorn.server_state.connections)
        time.sleep(0.05)
    return stats


def test_amplifying_request_is_400_before_anything_is_queued(server, http):
    """Prompts x n past max_seqs_per_request: a 400 naming the field, nothing queued."""
    body = {"prompt": ["Once"] * 5000, "n": 20, "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, "n", "max_seqs_per_request")
    assert_error(http.post("/v1/completions", json=body | {"n": 1}), 400, "prompt",
                 "max_seqs_per_request")
    assert server.engine.stats()["num_requests_waiting"] == 0
    succeeds(http)


def test_the_waiting_queue_is_bounded_by_default(stories_dir):
    """Not given, max_waiting_requests is the KV pool's page count (never under max_num_seqs)."""
    engine = LLMEngine(stories_dir, EngineConfig.from_overrides(**SERVER_ENGINE))
    async_engine = AsyncEngine(engine)
    try:
        assert async_engine.max_waiting_requests == engine.scheduler.kv.pool.num_usable
    finally:
        asyncio.run(async_engine.shutdown())


def test_mass_abort_of_queued_sequences_leaves_the_engine_serving(server, http):
    """100,000 queued sequences, all aborted (as when their clients go): the queue empties, every
    page is free, and the next request completes (bench/hostile.py times this)."""
    engine = server.engine
    limit, engine.max_waiting_requests = engine.max_waiting_requests, 200_000
    params = SamplingParams(max_tokens=2)

    async def flood():
        streams = []
        for k in range(25):
            streams += await engine.add_requests(
                [(f"flood-{k}-{i}", {"prompt_token_ids": [1, 2, 3]}, params)
                 for i in range(4000)])
        assert engine.stats()["num_requests_waiting"] > 50_000
        for stream in streams:
            stream.abort()

    try:
        asyncio.run(flood())
    finally:
        engine.max_waiting_requests = limit
    succeeds(http)
    _idle(server)


def test_commands_between_two_steps_are_bounded_and_a_requests_adds_never_split():
    """A flood of aborts is applied a budget at a time, with a step between (the running
    requests go on); a request's adds (a tuple) are applied together, alone if over budget."""
    from jaxserve.engine.async_engine import _commands_within

    assert _commands_within(["abort"] * 10, 4) == 4
    assert _commands_within([("add",) * 3, "abort", ("add",) * 5], 4) == 2
    assert _commands_within([("add",) * 9, "abort"], 4) == 1
    assert _commands_within([], 4) == 0


def test_health_is_503_while_the_engine_loop_is_stuck():
    fake = StuckEngine()
    engine = AsyncEngine(fake, stall_timeout_s=0.3)
    with uvicorn_url(build_app(engine, ServerConfig(), "stuck")) as url:
        assert httpx.get(url + "/health").status_code == 200
        body = {"prompt": [1, 2, 3], "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60):
            assert fake.stepping.wait(60)  # its step never returns
            # the first iteration after idle: the stats predate its request, and nothing else
            # is queued (its client is still there), yet the loop is stuck on it
            deadline = time.monotonic() + 60
            while (r := httpx.get(url + "/health")).status_code == 200:
                assert time.monotonic() < deadline, "health stayed 200"
                time.sleep(0.05)
            assert_error(r, 503, None, "no progress")
        fake.release.set()  # the step returns: the loop runs again
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "health stayed 503"
            time.sleep(0.05)


def test_a_client_gone_while_tokenizing_or_queued_stops_that_work():
    """The engine thread is stuck, so a second request's sequences stay queued for it (not yet
    taken): when its client goes, they are dropped at once, not left for the engine; and a
    client gone while its prompts are tokenized stops the tokenizing."""
    fake = StuckEngine()
    engine = AsyncEngine(fake)
    app = build_app(engine, ServerConfig(), "stuck")
    try:
        with uvicorn_url(app) as url:
            body = {"prompt": [1, 2, 3], "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60):
                assert fake.stepping.wait(60)  # the first request holds the thread
                # 16 prompts: as many as may wait (50 were a 400: more than it could ever admit)
                data = json.dumps({"prompt": [[4, 5]] * 16}).encode()
                host, port = url.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port))) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                    deadline = time.monotonic() + 60
                    while len(engine._live) < 17:  # its 16 are queued for the engine
                        assert time.monotonic() < deadline, len(engine._live)
                        time.sleep(0.01)
                deadline = time.monotonic() + 60  # its client gone: the 16 go
                while len(engine._live) > 1:
                    assert time.monotonic() < deadline, len(engine._live)
                    time.sleep(0.01)
    finally:
        fake.release.set()
    api = SimpleNamespace(tokenizer=None)  # the tokenizing loop checks the flag per prompt
    cancelled = threading.Event()
    cancelled.set()
    req = SimpleNamespace(prompts=[[1, 2]] * 3, truncate_prompt_tokens=None, echo=False)
    with pytest.raises(server_app._Disconnected):
        server_app._API._completion_prompts(api, req, cancelled)


_STUCK_SERVER = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import SilentEngine, StuckEngine
from jaxserve.server import ServerConfig, serve
sys.exit(serve(StuckEngine(), ServerConfig(port={port}, shutdown_grace_s={grace}), "stuck"))
"""


def test_sigterm_ends_the_process_within_the_grace_period_whatever_the_engine_does(tmp_path):
    """The engine thread is stuck in a step: SIGTERM still ends the open stream with a 503 error
    event and [DONE], and the process exits 0 (within the grace period and a few seconds; the
    test allows a minute, a hang's bound: the stuck step would hold the process for ever)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    grace = 1.0
    script = tmp_path / "stuck_server.py"
    script.write_text(textwrap.dedent(_STUCK_SERVER.format(
        tests=str(Path(__file__).parent), port=port, grace=grace)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.1)
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            proc.send_signal(signal.SIGTERM)
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == 503
        assert proc.wait(timeout=grace + 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# -- connections -------------------------------------------------------------------------------


def _raw(url: str, data: bytes, wait: float = 10.0) -> bytes:
    """Send `data` on a new connection and read until the server closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(4096):
            out += chunk
    return out


def _envelope(response: bytes, status: int) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), response
    error = json.loads(body)["error"]
    assert error["code"] == status and error["message"]
    return error


def test_stalled_headers_are_408_and_the_connection_closed(server, http):
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        error = _envelope(_raw(server.url, partial), 408)  # _raw gives up after 10 s
        assert "header_timeout_s" in error["message"]
    succeeds(http)


def test_a_trickled_body_is_408(server, http):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")
    error = _envelope(_raw(server.url, head + b'{"prompt":'), 408)
    assert "body_timeout_s" in error["message"]
    succeeds(http)


def test_connections_and_requests_past_their_caps_are_503():
    engine = AsyncEngine(SilentEngine())
    config = ServerConfig(max_concurrent_requests=2)
    with uvicorn_server(build_app(engine, config, "stuck"), max_connections=4) as (url, uv):
        host, port = url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(4)]
        try:
            deadline = time.monotonic() + 60
            while len(uv.server_state.connections) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert "max_connections" in _envelope(_raw(url, b""), 503)["message"]
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 60
        while uv.server_state.connections:  # closed on both ends
            assert time.monotonic() < deadline
            time.sleep(0.01)
        body = {"prompt": [1, 2, 3], "stream": True}
        with httpx.Client(base_url=url, timeout=10) as client, \
                client.stream("POST", "/v1/completions", json=body) as one, \
                client.stream("POST", "/v1/completions", json=body) as two:
            assert one.status_code == two.status_code == 200
            r = client.post("/v1/completions", json=body)
            assert_error(r, 503, None, "max_concurrent_requests")
            assert r.headers["Retry-After"] == "1"
        assert httpx.get(url + "/health").status_code == 200  # not a /v1 request


# -- garbage in every field --------------------------------------------------------------------

_SURROGATE = b'"\\ud800"'  # JSON's escape of a lone UTF-16 surrogate
_INVALID_UTF8 = b'"\xff\xfe"'
_NUL = b'"a\\u0000b"'
_MARK = "@@BAD@@"  # swapped for the bad string in the raw body
_COMPLETION = ({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, [
    {"model": _MARK}, {"prompt": _MARK}, {"prompt": [PROMPT, _MARK]}, {"stop": _MARK},
    {"stop": ["zz", _MARK]}, {"user": _MARK}, {"suffix": _MARK}, {"seed": _MARK},
    {"logit_bias": {_MARK: 1}}, {"stream": True, "stream_options": {_MARK: True}},
    {"response_format": {"type": _MARK}}, {_MARK: 1}])
_CHAT = ({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}, [
    {"model": _MARK}, {"messages": [{"role": "user", "content": _MARK}]},
    {"messages": [{"role": _MARK, "content": PROMPT}]},
    {"messages": [{"role": "user", "content": PROMPT, "name": _MARK}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": _MARK}]}]},
    {"stop": [_MARK]}, {"user": _MARK}, {"tools": [{"type": "function",
                                                     "function": {"name": _MARK}}]},
    {_MARK: 1}])


@pytest.mark.parametrize("bad", [_SURROGATE, _INVALID_UTF8, _NUL],
                         ids=["surrogate", "invalid-utf8", "nul"])
@pytest.mark.parametrize(("path", "bodies"), [("/v1/completions", _COMPLETION),
                                              ("/v1/chat/completions", _CHAT)],
                         ids=["completions", "chat"])
def test_garbage_text_in_any_field_is_a_4xx_in_the_envelope(server, http, path, bodies, bad):
    """A lone surrogate, invalid UTF-8 or a NUL in each field (values, list items, object keys):
    never a 5xx, every error in the envelope; the first two are always a 400."""
    base, patches = bodies
    for patch in patches:
        data = json.dumps(base | patch).encode().replace(json.dumps(_MARK).encode(), bad)
        r = http.post(path, content=data, headers={"content-type": "application/json"})
        assert r.status_code < 500, (patch, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (patch, r.text)
        if bad != _NUL:
            assert r.status_code == 400, (patch, r.text)
    for where, headers in (("/v1/%ff%fe", AUTH), ("/v1/models?x=%ed%a0%80", AUTH),
                           ("/v1/models", {"Authorization": b"Bearer \xff\xfe"})):
        r = http.get(where, headers=headers)
        assert r.status_code < 500 and (r.status_code == 200 or r.json()["error"]), r.text
    succeeds(http)


def test_model_fields_unicode_and_content_type(server, http):
    """A surrogate in `model` is a 400 (it was a plain-text 500); `"model": ""` is the served
    model, as vLLM; a body that is not JSON by its Content-Type is a 415."""
    r = http.post("/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}',
                  headers={"content-type": "application/json"})
    assert_error(r, 400, "model")
    r = http.post("/v1/completions", json={"model": "", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = http.post("/v1/completions", content=b"prompt=x&max_tokens=2",
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(r, 415, None, "application/json")
    succeeds(http)


# -- load --------------------------------------------------------------------------------------


def test_hostile_load_leaves_the_server_idle(server, http):
    """80 clients at once, 20 of them hostile (oversized, malformed, disconnecting, stalled),
    against an 8-slot engine with a queue of 8: every well-formed request completes or gets a
    429, no 5xx, and the pool, queues and connections return to idle (bench/hostile.py runs
    400 clients, 100 hostile, against `jaxserve serve`)."""
    result = asyncio.run(hostile.run(server.url, 80, 20, headers=AUTH,
                                     max_body_bytes=BODY_LIMIT, stall_s=TIMEOUT_S + 10))
    assert not result["failures"], result
    statuses = result["statuses"]
    assert set(statuses["good"]) <= {200, 429} and statuses["good"].get(200, 0) >= 8, result
    assert statuses["oversized"] == {413: 5} and statuses["malformed"] == {400: 5}, result
    assert statuses["stalled"] == {408: 5}, result
    _idle(server)
    succeeds(http)
