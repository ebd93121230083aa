"""Which pages each request holds, and (prefix caching on) which it shares. Page tables are
append-only; only the scheduler preempts.

With prefix caching, a request starts from the cached pages of its longest cached prefix
(`lookup`, at admission) and its own full pages are keyed once their KV is written
(`cache_full_pages`), so that later requests with the same prefix skip computing it:

    request A  [a b c d][e f g h][i j . .]      lookup: nothing; computes 10 tokens, keys 2 pages
    request B  [a b c d][e f g h][x y z .]      lookup: A's 2 pages (8 tokens), computes 3
    request C  [a b c d][e f g h]               lookup: A's first page only: the last token
                                                must be computed again, for its logits

The pages live in the pool (free, held, evictable) and the keys in the `PrefixCache`; see
those modules for the states and for why the keys are exact.
"""

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

from jaxserve.core.page_pool import PagePool
from jaxserve.core.prefix_cache import PageKey, PrefixCache
from jaxserve.request import Request


@dataclass(slots=True)
class _Keyed:
    """How far a request's full pages are keyed, so each call keys only the new ones."""

    num_pages: int
    parent: int | None  # the cached page holding its last keyed page (None: none yet)
    parent_key: PageKey | None  # that page's key object when it was seen
    extra: Hashable


class KVCacheManager:
    """`sliding_window`: every layer attends to the last sliding_window positions alone, so a
    request's pages wholly before its next token's window are given back as it runs
    (`release_outside_window`), its page list keeping 0 (the null page) in their place, as
    vLLM's sliding-window manager does: a long generation holds about window / page_size
    pages."""

    def __init__(self, pool: PagePool, page_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None):
        self.pool = pool
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.released = 0  # pages given back from behind a window (stats)
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of which found cached (prefix_cache_hits)
        self._keyed: dict[Request, _Keyed] = {}

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        """Pages to add so the request holds num_computed_tokens + num_new_tokens positions."""
        tokens = request.num_computed_tokens + num_new_tokens
        return max(0, -(-tokens // self.page_size) - len(request.pages))

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Append the pages the new tokens need; None (nothing taken) when the pool is short."""
        n = self.pages_needed(request, num_new_tokens)
        if n == 0:  # most decode steps: the last page has room
            return []
        pages = self.pool.allocate(n, self.cache)
        if pages is not None:
            request.pages.extend(pages)
        return pages

    def free(self, request: Request) -> None:
        held = [page for page in request.pages if page]  # 0: released behind a window
        if self.cache is None:
            self.pool.free(held)
        else:
            # last page first: the least recently freed go first, so a request's deepest pages
            # are evicted before the prefixes they hang from (whose eviction would drop them)
            self.pool.free(reversed(held), self.cache)
            self._keyed.pop(request, None)
        request.pages = []

    def release_outside_window(self, request: Request) -> None:
        """Give back the pages wholly before the window of the request's next token (position
        num_computed_tokens, the start of what it computes next: it and every later token see
        positions from num_computed_tokens - sliding_window + 1 on, and its count never goes
        back below it, speculation's rollbacks included). Each becomes 0 in the request's
        list; the kernels skip pages before a window, so no step reads it."""
        if self.sliding_window is None:
            return
        first = max(0, request.num_computed_tokens - self.sliding_window + 1)
        end = min(first // self.page_size, len(request.pages))
        released = [page for page in request.pages[:end] if page]
        if not released:
            return
        self.pool.free(released, self.cache)
        request.pages[:end] = [0] * end
        self.released += len(released)

    def lookup(self, request: Request, use_cache: bool = True, extra: Hashable = None,
               count: bool = True) -> int:
        """At admission, of a request holding nothing (new, or preempted): hand it the cached
        pages of its longest cached prefix of prompt and output tokens, and return how many
        tokens they hold (its computed tokens). At least its last token is left to compute, for
        its logits. A request looked up and then not admitted (the allocation that must follow
        failed) must be freed: `free` gives its pages back and forgets it.

        use_cache=False (a request that wants every prompt token's logprobs) takes and counts
        nothing; its pages are still keyed as they are computed. extra: what else its KV depends
        on, part of every key of its pages; by default its LoRA adapter's name (None for the
        base model), so an adapter's pages serve that adapter only. count=False leaves the stats to
        `count_lookup`, once the request surely joins (a lookup given back is tried again)."""
        if self.cache is None:
            return 0
        if request.pages or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} already holds pages or tokens")
        if extra is None:
            extra = request.lora_name
        hit: list[int] = []
        if use_cache:
            tokens = request.prompt_ids + request.output_ids
            hit = self.cache.match(tokens, self.page_size, (len(tokens) - 1) // self.page_size,
                                   extra)
            self.pool.take(hit)
            if count:
                self.count_lookup(request, len(hit) * self.page_size)
        last = hit[-1] if hit else None
        self._keyed[request] = _Keyed(len(hit), last, self.cache.key(last) if hit else None, extra)
        request.pages = hit
        return len(hit) * self.page_size

    def cached_prefix_len(self, request: Request, extra: Hashable = None) -> int:
        """The tokens a lookup would find for the request now, taking nothing (the lpm
        policy's key); 0 without prefix caching."""
        if self.cache is None:
            return 0
        if extra is None:
            extra = request.lora_name
        tokens = request.prompt_ids + request.output_ids
        return len(self.cache.match(tokens, self.page_size, (len(tokens) - 1) // self.page_size,
                                    extra)) * self.page_size

    def count_lookup(self, request: Request, num_cached_tokens: int) -> None:
        """A lookup of the request's tokens found num_cached_tokens: the stats count it."""
        self.queries += len(request.prompt_ids) + len(request.output_ids)
        self.hits += num_cached_tokens

    def cache_full_pages(self, request: Request, num_tokens: int) -> None:
        """Key the request's full pages among its first num_tokens tokens (those the host knows)
        that are not keyed yet, once the steps writing their KV are final (no row taken back)
        and dispatched ahead of any step that could read them. A page whose prefix another
        page holds already (two requests computed it at once) stays unkeyed and is freed as
        usual; the pages after it hang from the other one."""
        if self.cache is None:
            return
        size = self.page_size
        known = len(request.prompt_ids) + len(request.output_ids)
        full = min(num_tokens, known, len(request.pages) * size) // size
        keyed = self._keyed.get(request)
        if keyed is None:  # never looked up: nothing from the cache
            keyed = self._keyed[request] = _Keyed(0, None, None, None)
        if full <= keyed.num_pages:
            return
        if keyed.parent is not None and self.cache.key(keyed.parent) is not keyed.parent_key:
            # the page it hangs from lost its key: another request's page, evicted, or one
            # dropped with such an ancestor. Its id may mean another prefix by now: key again
            # from the first page, the request's own pages standing in for the lost ones
            keyed.num_pages, keyed.parent, keyed.parent_key = 0, None, None
        parent, key = keyed.parent, keyed.parent_key
        for i in range(keyed.num_pages, full):
            if not request.pages[i]:  # released behind a window before it was keyed
                full = i
                break
            key = (parent, self._page_tokens(request, i), keyed.extra)
            page = self.cache.page(key)
            if page is None:
                page = request.pages[i]
                self.cache.add(key, page)
            else:
                key = self.cache.key(page)  # the stored object, for the identity test above
            parent = page
        keyed.num_pages, keyed.parent, keyed.parent_key = full, parent, key

    def _page_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        """Page i's tokens, without joining the prompt and output lists."""
        start, end, n = i * self.page_size, (i + 1) * self.page_size, len(request.prompt_ids)
        if end <= n:
            return tuple(request.prompt_ids[start:end])
        if start >= n:
            return tuple(request.output_ids[start - n:end - n])
        return tuple(request.prompt_ids[start:] + request.output_ids[:end - n])

    def reset_prefix_cache(self) -> bool:
        """Drop every key (the weights changed, say). As vLLM's: False, and nothing dropped,
        while any request holds a page."""
        if self.pool.num_free < self.pool.num_usable:
            return False
        if self.cache is not None:
            self.cache.clear()
            self.pool.free_evictable()
        return True

    @property
    def num_cached_pages(self) -> int:
        """Keyed pages, held or evictable."""
        return 0 if self.cache is None else len(self.cache)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests (evictable ones count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def fragmentation(self, requests: list[Request]) -> float:
        """Internal fragmentation: allocated token slots not holding a token / allocated slots.
        (Per request, not per page: the stats read it every iteration. The pages released
        behind a window are the 0s at the front of a request's list, found by bisection.)"""
        size = self.page_size
        released = ([bisect.bisect_left(r.pages, True, key=bool) for r in requests]
                    if self.sliding_window is not None else [0] * len(requests))
        slots = (sum(len(r.pages) for r in requests) - sum(released)) * size
        if slots == 0:
            return 0.0
        # a page released behind a window held its tokens
        used = sum(min(r.num_computed_tokens, len(r.pages) * size) - gone * size
                   for r, gone in zip(requests, released, strict=True))
        return 1.0 - used / slots
