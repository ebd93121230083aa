"""The waiting queue: requests in the order they will be admitted, with O(1) removal.

A policy whose order never changes with time (`Policy.static_order`) keeps the queue sorted as
requests arrive (a binary search per insert); any other appends and sorts when it ranks. Removing
a request (it was admitted, or aborted) only marks its entry dead, so that aborting every one of
400,000 queued requests costs 400,000 O(1) steps, not 400,000 list scans:

    entries  [dead dead | live dead live live dead live]
                       ^ start: entries before it are dead and never looked at again

Reading the queue skips dead entries; the list is compacted once dead entries outnumber live
ones, so a read costs O(live) amortised and memory stays within twice the live count.
"""

import bisect
from collections.abc import Callable, Iterator
from typing import Any

from jaxserve.request import Request


class _Entry:
    __slots__ = ("alive", "request")

    def __init__(self, request: Request):
        self.request = request
        self.alive = True


class WaitingQueue:
    """`key`: the sort key of a static-order policy (None: arrival order, append only)."""

    def __init__(self, key: Callable[[Request], Any] | None = None):
        self._key = key
        self._entries: list[_Entry] = []
        self._start = 0  # entries before it are all dead
        self._by_request: dict[Request, _Entry] = {}  # live entries; Requests hash by identity

    def add(self, request: Request) -> None:
        if request in self._by_request:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = _Entry(request)
        if self._key is None:
            self._entries.append(entry)
        else:  # dead entries keep their keys, so the list stays sorted with them in it
            key = self._key
            i = bisect.bisect_right(self._entries, key(request), lo=self._start,
                                    key=lambda e: key(e.request))
            self._entries.insert(i, entry)
        self._by_request[request] = entry

    def remove(self, request: Request) -> None:
        """O(1) amortised: the entry is marked dead, and the dead are dropped once they
        outnumber the live (a dead entry still holds its request: a long-running server would
        otherwise keep every request it ever queued). KeyError if the request is not
        waiting."""
        self._by_request.pop(request).alive = False
        if len(self._entries) - len(self._by_request) > max(64, len(self._by_request)):
            self._entries = [e for e in self._entries[self._start:] if e.alive]
            self._start = 0

    def __contains__(self, request: Request) -> bool:
        return request in self._by_request

    def __len__(self) -> int:
        return len(self._by_request)

    def __bool__(self) -> bool:
        return bool(self._by_request)

    def __iter__(self) -> Iterator[Request]:
        """Live requests in queue order (sorted for a static-order key, else arrival)."""
        self._skip_dead_head()
        entries = self._entries
        return (entries[i].request for i in range(self._start, len(entries)) if entries[i].alive)

    def head(self, limit: int) -> list[Request]:
        """The first `limit` live requests in queue order."""
        self._skip_dead_head()
        out, entries, i = [], self._entries, self._start
        while len(out) < limit and i < len(entries):
            if entries[i].alive:
                out.append(entries[i].request)
            i += 1
        return out

    def _skip_dead_head(self) -> None:
        entries, start = self._entries, self._start
        while start < len(entries) and not entries[start].alive:
            start += 1
        if start > max(64, len(entries) - start):  # the dead head outgrew the rest: drop it
            del entries[:start]
            start = 0
        self._start = start
