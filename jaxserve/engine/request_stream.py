"""One request's outputs on the caller's event loop, as an async iterator (`AsyncEngine` makes
them; the engine thread hands outputs to them with `call_soon_threadsafe`)."""

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from jaxserve.request import RequestOutput


class StreamOwner(Protocol):
    """What a stream asks of the engine that made it (`AsyncEngine`)."""

    def _forget(self, stream: "RequestStream") -> None: ...

    def abort_streams(self, streams: list["RequestStream"]) -> None: ...


class RequestStream:
    """One request's outputs, as an async iterator of `RequestOutput`s.

    A reader that falls behind holds one output however far behind it is, and loses nothing:
    a cumulative output replaces the one it has not read, a delta (`delta`: the request's
    output_kind is DELTA) is added to it (`RequestOutput.add`). Iteration ends after the
    finished output, raises the error that ended the request, or ends at once after `abort()`.
    """

    def __init__(self, request_id: str, owner: StreamOwner, loop: asyncio.AbstractEventLoop,
                 delta: bool = False):
        self.request_id = request_id
        self.loop = loop
        self.delta = delta
        self.finished = False  # a finished output was yielded
        self.inter_token_latencies: list[float] = []  # seconds between tokens, as they arrived
        self._owner = owner
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._done = False
        self._num_tokens = 0
        self._last_token_time: float | None = None
        # called on the event loop when an item arrives or iteration ends: one listener over
        # many streams (streams.merge) needs no task per stream
        self.on_ready: Callable[[], None] | None = None

    @property
    def ready(self) -> bool:
        """Whether `__anext__` would return (or end) without waiting."""
        return bool(self._items) or self._done

    def _push(self, item: RequestOutput | BaseException, now: float) -> None:
        """On the event loop: an output (stamped by the engine thread) or an error."""
        if isinstance(item, RequestOutput):
            new = len(item.outputs[0].token_ids) - (0 if self.delta else self._num_tokens)
            if new > 0:
                if self._last_token_time is not None:  # a multi-step output spreads its gap
                    self.inter_token_latencies += [(now - self._last_token_time) / new] * new
                self._last_token_time, self._num_tokens = now, self._num_tokens + new
        if (isinstance(item, RequestOutput) and self._items
                and isinstance(self._items[-1], RequestOutput)):
            # a reader that stopped reading holds one output
            if self.delta:
                self._items[-1].add(item)
            else:
                self._items[-1] = item
        else:
            self._items.append(item)
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items and not self._done:
            self._ready.clear()
            await self._ready.wait()
        if self._done:
            raise StopAsyncIteration
        items = list(self._items)
        self._items.clear()
        for item in items:
            if isinstance(item, BaseException):
                self._done = True
                self._owner._forget(self)
                raise item
        output = items[-1]
        if output.finished:
            self._done = self.finished = True
            self._owner._forget(self)
        return output

    def abort(self) -> None:
        """Abort the request unless it finished; iteration ends. Safe to call twice."""
        self._owner.abort_streams([self])

    def _close(self) -> bool:
        """End iteration; True if the request was still open (it must be aborted)."""
        if self._done:
            return False
        self._done = True
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()
        return True
