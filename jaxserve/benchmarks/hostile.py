"""A hostile load: well-formed clients and hostile ones at once against an OpenAI-compatible server.

Each well-formed client sends one completion (every other one streamed) and must get a 200 or,
when the queue is full, a 429; the hostile ones send an oversized body, malformed JSON, a stream
they drop after its first event, or headers that never end (slowloris). `run` counts the answers
by kind and status; a well-formed request that got anything else, or any 5xx, is a failure.
`bench/hostile.py` runs it at full size against `jaxserve serve`; the test suite at CI size.
"""

import asyncio
import json
import time
from collections import Counter
from typing import Any
from urllib.parse import urlparse

import httpx

HOSTILE_KINDS = ("oversized", "malformed", "disconnect", "stalled")


async def _good(client: httpx.AsyncClient, i: int, body: dict) -> tuple[str, int]:
    if i % 2:
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        if r.status_code == 200 and (lines[-1:] != ["data: [DONE]"]
                                     or any('"error"' in line for line in lines)):
            return "good", 0  # a broken stream counts as a failure
        return "good", r.status_code
    r = await client.post("/v1/completions", json=body)
    return "good", r.status_code


async def _hostile(client: httpx.AsyncClient, kind: str, body: dict, max_body_bytes: int,
                   url: str, stall_s: float) -> tuple[str, int]:
    if kind == "oversized":
        r = await client.post("/v1/completions", json=body | {"prompt": "x" * max_body_bytes})
        return kind, r.status_code
    if kind == "malformed":
        r = await client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                              headers={"content-type": "application/json"})
        return kind, r.status_code
    if kind == "disconnect":
        async with client.stream("POST", "/v1/completions",
                                 json=body | {"stream": True, "max_tokens": 200,
                                              "ignore_eos": True}) as r:
            async for _ in r.aiter_lines():
                break  # gone after the first event
        return kind, r.status_code
    # stalled: a request line and half the headers, then nothing
    where = urlparse(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.read(64), stall_s)
        status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0
    except TimeoutError:
        status = -1  # never answered: held open
    writer.close()
    return kind, status


async def run(url: str, clients: int, hostile: int, *, headers: dict[str, str] | None = None,
              max_tokens: int = 8, max_body_bytes: int = 4 << 20,
              stall_s: float = 30.0) -> dict[str, Any]:
    """`clients` at once, `hostile` of them hostile (the kinds in turn). Returns the statuses
    by kind ({"good": {200: n, 429: m}, ...}), the failures, and the wall time."""
    body = {"prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(120.0)) as client:
        tasks = []
        for i in range(clients):
            if i < hostile:
                kind = HOSTILE_KINDS[i % len(HOSTILE_KINDS)]
                tasks.append(_hostile(client, kind, body, max_body_bytes, url, stall_s))
            else:
                tasks.append(_good(client, i, body))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    statuses: dict[str, Counter] = {}
    failures = []
    for result in results:
        if isinstance(result, BaseException):
            failures.append(repr(result))
            continue
        kind, status = result
        statuses.setdefault(kind, Counter())[status] += 1
        if (kind == "good" and status not in (200, 429)) or status >= 500:
            failures.append(f"{kind}: {status}")
    return {"clients": clients, "hostile": hostile, "seconds": time.monotonic() - start,
            "statuses": {k: dict(v) for k, v in statuses.items()}, "failures": failures}


def main(url: str, clients: int, hostile: int, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    result = asyncio.run(run(url, clients, hostile, headers=headers))
    print(json.dumps(result, indent=2))
    return result
