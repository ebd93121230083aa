"""The pool of KV page ids and who holds them. Page 0 is the null page and is never handed out.

A usable page is in one of three states:

    held       refcount >= 1: that many requests hold it (more than one: a shared cached page)
    free       nobody holds it and the prefix cache has no key for it: handed out first
    evictable  nobody holds it, the prefix cache keys it: a lookup may take it back; once no
               page is free, an allocation evicts the least recently freed one (its key goes)

Without prefix caching no page is ever evictable and the pool is a free list.
"""

from collections import OrderedDict, deque
from collections.abc import Iterable

from jaxserve.core.prefix_cache import PrefixCache


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free or evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int, cache: PrefixCache | None = None) -> list[int] | None:
        """n pages for one holder, or None (and nothing taken) when fewer than n are free or
        evictable. Free pages go first, then evicted ones: `cache` drops their keys."""
        if n > len(self._free) + len(self._evictable):
            return None
        while len(self._free) < n:
            self._evict(cache)
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def _evict(self, cache: PrefixCache) -> None:
        """Free the least recently freed evictable page; its descendants in the cache lose
        their keys with it, and those nobody holds are free too."""
        page, _ = self._evictable.popitem(last=False)
        descendants = cache.drop(page)[1:]
        self._free.append(page)
        for p in descendants:
            if p in self._evictable:  # a held one is freed, unkeyed, when its holders let go
                del self._evictable[p]
                self._free.append(p)

    def take(self, pages: list[int]) -> None:
        """One more holder for each of these cached pages (a lookup's hits): an evictable one
        leaves the queue."""
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1

    def free(self, pages: Iterable[int], cache: PrefixCache | None = None) -> None:
        """One holder fewer for each page; a page nobody holds any more is evictable if `cache`
        keys it, else free."""
        for page in pages:
            if not 0 < page < self.num_pages or self._refs[page] == 0:
                raise ValueError(f"page {page} is not allocated")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if cache is not None and page in cache:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def free_evictable(self) -> None:
        """Every evictable page becomes free (the cache has dropped their keys)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
