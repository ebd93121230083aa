"""Request streams on the event loop: several choices' streams merged into one, a non-streaming
request followed to its end, a client's disconnect watched, and the SSE line format."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from jaxserve.engine.request_stream import RequestStream
from jaxserve.request import RequestOutput


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several streams as they come: what each stream holds
    (a slow reader holds one output per choice however far it falls behind: the deltas it
    missed added together, see RequestStream). One listener, no task per stream: a request
    may have thousands. Raises the first error a stream ends with."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    ready: dict[int, None] = dict.fromkeys(range(len(streams)))  # to look at, in order
    changed = asyncio.Event()
    ended: set[int] = set()

    def listener(i: int):
        def on_ready() -> None:
            ready[i] = None
            changed.set()
        return on_ready

    for i, stream in enumerate(streams):
        stream.on_ready = listener(i)
    try:
        while len(ended) < len(streams):
            if not ready:
                changed.clear()
                await changed.wait()
                continue
            i = next(iter(ready))
            del ready[i]
            if i in ended or not streams[i].ready:
                continue
            try:
                out = await streams[i].__anext__()  # does not wait: the stream is ready
            except StopAsyncIteration:
                ended.add(i)
                continue
            if streams[i].ready:  # ended with this output (or more came): look again
                ready[i] = None
            yield i, out
    finally:
        for stream in streams:
            stream.on_ready = None


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
