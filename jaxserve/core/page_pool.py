"""The pool of KV page ids. Page 0 is the null page and is never handed out."""

from collections import deque


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh page ids, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"page {page} is not allocated")
            self._used.remove(page)
            self._free.append(page)
