"""Which pages each request holds. Page tables are append-only; only the scheduler preempts."""

from jaxserve.core.page_pool import PagePool
from jaxserve.request import Request


class KVCacheManager:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        """Pages to add so the request holds num_computed_tokens + num_new_tokens positions."""
        tokens = request.num_computed_tokens + num_new_tokens
        return max(0, -(-tokens // self.page_size) - len(request.pages))

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Append the pages the new tokens need; None (nothing taken) when the pool is short."""
        n = self.pages_needed(request, num_new_tokens)
        if n == 0:  # most decode steps: the last page has room
            return []
        pages = self.pool.allocate(n)
        if pages is not None:
            request.pages.extend(pages)
        return pages

    def free(self, request: Request) -> None:
        self.pool.free(request.pages)
        request.pages = []

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def fragmentation(self, requests: list[Request]) -> float:
        """Internal fragmentation: allocated token slots not holding a token / allocated slots."""
        slots = sum(len(r.pages) for r in requests) * self.page_size
        if slots == 0:
            return 0.0
        used = sum(min(r.num_computed_tokens, len(r.pages) * self.page_size) for r in requests)
        return 1.0 - used / slots
