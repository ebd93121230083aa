"""Request streams on the event loop: several choices' streams merged into one, a non-streaming
request followed to its end, a client's disconnect watched, and the SSE line format."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from jaxserve.async_engine import RequestStream
from jaxserve.request import RequestOutput


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    # the newest output per choice (outputs are cumulative: a slow reader skips the ones between,
    # and holds one output per choice however far it falls behind)
    latest: dict[int, RequestOutput] = {}
    ended: set[int] = set()
    errors: list[Exception] = []
    changed = asyncio.Event()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                latest[i] = out
                changed.set()
        except Exception as error:
            errors.append(error)
        ended.add(i)
        changed.set()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            await changed.wait()
            changed.clear()
            if errors:
                raise errors[0]
            while latest:
                i = next(iter(latest))
                yield i, latest.pop(i)
            if len(ended) == len(streams) and not latest:
                return
    finally:
        for task in tasks:
            task.cancel()


async def follow(streams: list[RequestStream], on_output) -> None:
    """Call on_output(choice index, output) for every output until all streams end."""
    async with contextlib.aclosing(merge(streams)) as updates:
        async for i, out in updates:
            on_output(i, out)


async def until_disconnect(request: Request, work) -> bool:
    """Run `work` unless the client disconnects first; True when it completed."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        task.result()  # an engine error raises here
        return True
    return False
