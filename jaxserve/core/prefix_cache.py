"""The prefix cache's table: which page holds the KV of which exact token prefix (automatic
prefix caching, as vLLM V1's).

A full page is keyed by what its KV depends on:

    key = (parent, tokens, extra)
    parent  the cached page holding the page before it; None for a first page
    tokens  its page_size token ids, a tuple
    extra   anything else that changes the KV (an adapter); None for the base model

    tokens  [a b c d][e f g h][i j k l]                       page_size 4
    keys    (None, (a, b, c, d), None) -> page 7
            (7,    (e, f, g, h), None) -> page 12
            (12,   (i, j, k, l), None) -> page 3

Lookups are exact, not merely likely: a dict compares keys that share a hash by equality, the
tuple's token by token, and a parent's page id stands for its whole prefix by induction, since
each prefix has at most one page and each page at most one key. A key costs O(page_size) to hash
and compare; one that spelled out its whole prefix would cost O(prefix). vLLM keys by a hash of
the parent's hash and the tokens instead: content-addressed, but a hash collision would hand out
another prefix's KV.

The induction needs a parent id to still mean the page it meant when the child was keyed. So
dropping a page's key (it is evicted, or the cache is reset) drops every descendant's key too:
a page id handed out again can never be read as the parent of a stale child, and a page that
can no longer be reached is free at once instead of lingering among the evictable ones. (Parent
serial numbers that are never reused would also be exact without the cascade, but would leave
those unreachable pages to age out of the LRU queue.)
"""

from collections.abc import Hashable

PageKey = tuple[int | None, tuple[int, ...], Hashable]


class PrefixCache:
    """An exact, two-way map between full pages' keys and the pages holding their KV."""

    def __init__(self):
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._children: dict[int, set[int]] = {}  # page -> the pages keyed under it

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, page: int) -> bool:
        return page in self._key_of

    def page(self, key: PageKey) -> int | None:
        return self._page_of.get(key)

    def key(self, page: int) -> PageKey | None:
        return self._key_of.get(page)

    def match(self, tokens: list[int], page_size: int, max_pages: int,
              extra: Hashable = None) -> list[int]:
        """The cached pages holding the longest run of tokens' full pages from the start, at
        most max_pages of them."""
        pages: list[int] = []
        parent = None
        for start in range(0, max_pages * page_size, page_size):
            page = self._page_of.get((parent, tuple(tokens[start:start + page_size]), extra))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def add(self, key: PageKey, page: int) -> None:
        """Key a page whose KV is written. The key must be new, its parent keyed, the page not."""
        if page in self._key_of:
            raise ValueError(f"page {page} is already keyed")
        if key in self._page_of:
            raise ValueError(f"page {self._page_of[key]} already holds this prefix")
        parent = key[0]
        if parent is not None and parent not in self._key_of:
            raise ValueError(f"parent page {parent} is not keyed")
        self._page_of[key] = page
        self._key_of[page] = key
        if parent is not None:
            self._children.setdefault(parent, set()).add(page)

    def drop(self, page: int) -> list[int]:
        """Drop the page's key and every descendant's: the pages that lost one, this one first."""
        parent = self._key_of[page][0]
        if parent is not None:
            siblings = self._children[parent]
            siblings.remove(page)
            if not siblings:
                del self._children[parent]
        dropped, stack = [], [page]
        while stack:
            p = stack.pop()
            del self._page_of[self._key_of.pop(p)]
            stack.extend(self._children.pop(p, ()))
            dropped.append(p)
        return dropped

    def clear(self) -> None:
        self._page_of.clear()
        self._key_of.clear()
        self._children.clear()
