"""Prefix caching's pages and keys (core/prefix_cache.py, page_pool.py, kv_manager.py), no jax:
scripted cases worked out by hand, then a hypothesis state machine that writes a shadow of
every page's KV and checks that what a request reads is always its own tokens' KV."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core.kv_manager import KVCacheManager
from jaxserve.core.page_pool import PagePool
from jaxserve.request import Request, SamplingParams

_ids = iter(range(1_000_000))


def make_request(prompt: list[int]) -> Request:
    return Request(f"r{next(_ids)}", prompt, SamplingParams(), 0.0, seed=0, max_len=64,
                   eos_token_ids=frozenset())


def caching(num_pages: int, page_size: int = 4) -> KVCacheManager:
    return KVCacheManager(PagePool(num_pages), page_size, enable_prefix_caching=True)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Look up, allocate and compute the rest, key the full pages: what the scheduler does for
    a request over its steps up to its first sampled token. The tokens the cache gave."""
    hit = kv.lookup(request)
    request.num_computed_tokens = hit
    n = len(request.all_ids) - hit
    assert kv.allocate(request, n) is not None
    request.num_computed_tokens += n
    kv.cache_full_pages(request, request.num_computed_tokens)
    return hit


def serve(kv: KVCacheManager, prompt: list[int]) -> int:
    """One request computed and freed; the tokens it found cached."""
    request = make_request(prompt)
    hit = admit(kv, request)
    kv.free(request)
    return hit


# -- scripted, by hand ----------------------------------------------------------------------------


def test_hits_queries_and_the_last_token_cap():
    kv = caching(17)  # page_size 4
    a = make_request(list(range(10)))  # [0 1 2 3][4 5 6 7][8 9 . .]
    assert admit(kv, a) == 0
    assert (kv.queries, kv.hits, kv.num_cached_pages) == (10, 0, 2)  # the partial page: no key
    b = make_request([*range(8), 50, 51, 52])
    assert admit(kv, b) == 8
    assert b.pages[:2] == a.pages[:2] and b.pages[2] not in a.pages
    assert [kv.pool.refcount(p) for p in a.pages] == [2, 2, 1]
    assert (kv.queries, kv.hits) == (21, 8)
    c = make_request(list(range(8)))  # all in full pages: the second is computed again
    assert kv.lookup(c) == 4 and c.pages == a.pages[:1]
    d = make_request(list(range(9)))  # token 8 is left: both pages
    assert kv.lookup(d) == 8 and d.pages == a.pages[:2]
    e = make_request([0, 1, 2, 3])
    assert kv.lookup(e) == 0 and e.pages == []
    assert (kv.queries, kv.hits) == (21 + 8 + 9 + 4, 8 + 4 + 8)
    assert kv.pool.refcount(a.pages[0]) == 4
    for r in (a, b, c, d, e):
        kv.free(r)
    # the keyed pages wait, evictable; the rest are free
    assert kv.pool.num_free == kv.pool.num_usable and kv.pool.num_evictable == 2
    assert serve(kv, [*range(8), 60]) == 8


def test_skipping_the_cache_still_keys_the_pages():
    kv = caching(17)
    serve(kv, list(range(9)))
    r = make_request(list(range(12)))
    assert kv.lookup(r, use_cache=False) == 0 and r.pages == []
    assert (kv.queries, kv.hits) == (9, 0)  # nothing counted
    assert kv.allocate(r, 12) is not None
    r.num_computed_tokens = 12
    kv.cache_full_pages(r, 12)  # its first 2 pages duplicate the cached ones; its third is new
    assert kv.num_cached_pages == 3
    kv.free(r)
    assert serve(kv, list(range(13))) == 12


def test_a_preempted_request_finds_its_own_pages():
    kv = caching(17)
    r = make_request(list(range(6)))
    admit(kv, r)
    r.output_ids += [70, 71, 72]  # decoded up to 9 tokens: [0 1 2 3][4 5 70 71][72]
    assert kv.allocate(r, 3) is not None
    r.num_computed_tokens += 3
    kv.cache_full_pages(r, r.num_computed_tokens)
    pages = list(r.pages)
    kv.free(r)  # preempted
    r.num_computed_tokens = 0
    assert kv.lookup(r) == 8 and r.pages == pages[:2]


def test_registration_stops_at_the_tokens_the_host_knows():
    kv = caching(17)
    r = make_request(list(range(6)))
    admit(kv, r)
    assert kv.allocate(r, 4) is not None
    r.num_computed_tokens += 4  # decode steps whose sampled tokens are still on the device
    kv.cache_full_pages(r, r.num_computed_tokens)
    assert kv.num_cached_pages == 1  # tokens 4..7 are not on the host yet
    r.output_ids += [80, 81]
    kv.cache_full_pages(r, r.num_computed_tokens)
    assert kv.num_cached_pages == 2


def test_lru_eviction_under_pressure():
    """Three 8-token prefixes (2 pages each) and a suffix token: a request holds 3 pages, and
    leaves 2 keyed ones when it ends. 5 usable pages keep two prefixes, not three."""
    prefixes = [[p] * 8 for p in (1, 2, 3)]

    def hits(num_pages: int, rounds: list[list[int]]) -> list[int]:
        kv = caching(num_pages)
        out = [serve(kv, prefixes[i] + [9]) for i in rounds]
        assert kv.pool.num_free == kv.pool.num_usable
        return out

    # room for all three: the second round hits every one
    assert hits(8, [0, 1, 2, 0, 1, 2]) == [0, 0, 0, 8, 8, 8]
    # room for two: in the same order, each request evicts the next one's prefix (LRU's worst)
    assert hits(6, [0, 1, 2, 0, 1, 2]) == [0, 0, 0, 0, 0, 0]
    # most recent first: 2 and 1 hit, and 0 evicts 2 (now the least recently freed)
    assert hits(6, [0, 1, 2, 2, 1, 0, 1, 2]) == [0, 0, 0, 8, 8, 0, 8, 0]


def test_eviction_takes_free_pages_first_and_leaves_before_their_prefix():
    kv = caching(6)  # 5 usable
    serve(kv, [1] * 12 + [9])  # keys 3 pages, leaves 2 free
    r = make_request([2] * 8)
    assert kv.lookup(r) == 0 and kv.allocate(r, 8) is not None  # the 2 free ones
    assert kv.num_cached_pages == 3 and kv.pool.num_evictable == 3
    r2 = make_request([3] * 4)
    assert kv.lookup(r2) == 0 and kv.allocate(r2, 4) is not None  # evicts the deepest page
    assert kv.num_cached_pages == 2
    assert kv.lookup(make_request([1] * 12 + [9])) == 8


def test_evicting_a_prefix_drops_its_descendants():
    kv = caching(7)  # 6 usable
    a = make_request([1] * 4 + [2] * 4 + [3])
    admit(kv, a)
    b = make_request([1] * 4 + [2] * 4 + [4] * 4 + [5])
    assert admit(kv, b) == 8  # shares a's 2 pages, keys its third under them
    kv.free(b)
    kv.free(a)  # a's pages are now the most recently freed
    assert kv.num_cached_pages == 3 and kv.pool.num_evictable == 3
    # 6 pages: the 3 free ones, then b's deepest page, then a's two (the second drops none)
    c = make_request([7] * 21)
    assert kv.lookup(c) == 0 and kv.allocate(c, 21) is not None
    assert kv.num_cached_pages == 0 and kv.pool.num_free == 0
    kv.free(c)


def test_an_evictable_descendant_of_an_evicted_page_is_free():
    """a and b compute their first 2 pages at once: b's third page hangs from a's second. a
    ends, then b: a's pages are the oldest evictable, so b's third page, evictable, loses its
    key with a's second and is free, and the next allocation takes it instead of evicting."""
    kv = caching(8)  # 7 usable
    a = make_request([1] * 4 + [2] * 4 + [3])
    b = make_request([1] * 4 + [2] * 4 + [3] * 4 + [6])
    for r in (a, b):
        assert kv.lookup(r) == 0 and kv.allocate(r, len(r.all_ids)) is not None
        r.num_computed_tokens = len(r.all_ids)
    kv.cache_full_pages(a, 9)
    kv.cache_full_pages(b, 13)
    assert kv.num_cached_pages == 3 and kv.cache.key(b.pages[2])[0] == a.pages[1]
    a_first, b_third = a.pages[0], b.pages[2]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_evictable == 3
    c = make_request([8] * 20)
    assert kv.lookup(c) == 0 and kv.allocate(c, 20) is not None  # 4 free, then a's second
    assert kv.num_cached_pages == kv.pool.num_evictable == 1 and kv.pool.num_free == 2
    d = make_request([9] * 4)
    assert kv.lookup(d) == 0 and kv.allocate(d, 4) == [b_third]
    assert kv.lookup(make_request([1] * 4 + [7])) == 4 and kv.cache.key(a_first) is not None


def test_a_stale_parent_is_never_taken_for_its_child():
    """Two requests compute the same first page at once: b's own copy stays unkeyed and its
    second page hangs from a's. Once a's page is evicted (b does not hold it), b's next pages
    are keyed from its own first page, and a page id handed out again means nothing stale."""
    kv = caching(6)  # 5 usable
    a = make_request([1] * 4 + [2])
    b = make_request([1] * 4 + [3] * 4 + [4])
    for r in (a, b):  # both admitted before either keys a page
        assert kv.lookup(r) == 0 and kv.allocate(r, len(r.all_ids)) is not None
        r.num_computed_tokens = len(r.all_ids)
    kv.cache_full_pages(a, 5)
    kv.cache_full_pages(b, 9)
    a_first = a.pages[0]
    assert kv.cache.key(b.pages[0]) is None  # the duplicate
    assert kv.cache.key(b.pages[1])[0] == a_first
    kv.free(a)  # a_first evictable; a's second page free
    c = make_request([5] * 4 + [6] * 4)  # takes the free pages, then evicts a_first
    assert kv.lookup(c) == 0 and kv.allocate(c, 8) is not None
    assert a_first in c.pages and kv.num_cached_pages == 0  # b's second page went with it
    c.num_computed_tokens = 8
    kv.cache_full_pages(c, 8)  # a_first now keys [5 5 5 5]
    b.output_ids += [4, 4, 4]  # its third page fills up
    assert kv.allocate(b, 3) == []
    b.num_computed_tokens += 3
    kv.cache_full_pages(b, b.num_computed_tokens)
    assert kv.cache.key(b.pages[0]) is not None  # keyed from its own first page again
    kv.free(c)
    d = make_request([1] * 4 + [3] * 4 + [4] * 5)
    assert kv.lookup(d) == 12 and d.pages == b.pages[:3]


def test_a_page_id_handed_out_again_is_not_taken_for_a_parent():
    """b's first page duplicates a's, so b's pages after it hang from a's page, which b does
    not hold. That page is evicted and keyed again by c, for other tokens, before b's second
    page fills: b's second page must not be keyed under it."""
    kv = caching(6)  # 5 usable
    a = make_request([1] * 4 + [2])
    b = make_request([1] * 4 + [3, 3])
    for r in (a, b):
        assert kv.lookup(r) == 0 and kv.allocate(r, len(r.all_ids)) is not None
        r.num_computed_tokens = len(r.all_ids)
    kv.cache_full_pages(a, 5)
    kv.cache_full_pages(b, 6)  # its first page is a duplicate, its second not full
    a_first = a.pages[0]
    kv.free(a)
    c = make_request([5] * 4 + [6] * 4 + [7] * 4)
    assert kv.lookup(c) == 0 and kv.allocate(c, 12) is not None  # 2 free, then a_first
    c.num_computed_tokens = 12
    kv.cache_full_pages(c, 12)
    assert c.pages[2] == a_first and kv.cache.key(a_first)[1] == (7, 7, 7, 7)
    b.output_ids += [3, 3]
    assert kv.allocate(b, 2) == []
    b.num_computed_tokens = 8
    kv.cache_full_pages(b, 8)
    assert kv.lookup(make_request(c.all_ids + [3] * 4 + [9])) == 12  # c's pages only
    assert kv.lookup(make_request([1] * 4 + [3] * 4 + [9])) == 8  # b's own, keyed again


def test_reset_prefix_cache():
    kv = caching(17)
    serve(kv, list(range(9)))
    r = make_request([5] * 6)
    admit(kv, r)
    assert not kv.reset_prefix_cache() and kv.num_cached_pages == 3  # r holds pages
    kv.free(r)
    assert kv.reset_prefix_cache()
    assert kv.num_cached_pages == 0 and kv.pool.num_evictable == 0
    assert kv.pool.num_free == kv.pool.num_usable
    assert serve(kv, list(range(9))) == 0


def test_caching_off_is_a_free_list():
    kv = KVCacheManager(PagePool(9), 4)
    r = make_request(list(range(9)))
    assert kv.lookup(r) == 0
    assert kv.allocate(r, 9) == [1, 2, 3]
    r.num_computed_tokens = 9
    kv.cache_full_pages(r, 9)
    kv.free(r)
    assert kv.num_cached_pages == 0 and kv.pool.num_evictable == 0
    assert list(kv.pool._free) == [4, 5, 6, 7, 8, 1, 2, 3]
    assert kv.reset_prefix_cache() and (kv.queries, kv.hits) == (0, 0)
    with pytest.raises(ValueError, match="not allocated"):
        kv.pool.free([1])
    with pytest.raises(ValueError, match="not allocated"):
        kv.pool.free([0])


# -- random sequences, against a shadow of the KV ----------------------------------------------

PAGE = 2
NUM_PAGES = 8  # 7 usable: two requests of up to 12 tokens run short of pages
MAX_TOKENS = 12
PREFIXES = ([1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7], [])


def sampled(position: int) -> int:
    """The token sampled at a position: known before the host reads it, so the shadow can
    record the KV of a token still pending."""
    return position % 3


def tokens_of(request: Request) -> list[int]:
    """Its tokens, pending ones included."""
    known = request.all_ids
    return known + [sampled(len(known) + i) for i in range(request.num_pending)]


class PrefixCacheMachine(RuleBasedStateMachine):
    """The scheduler's use of the manager: requests that share a few prefixes are admitted
    (lookup, allocate, a first chunk), step, sample tokens the host reads later, finish, are
    preempted and resumed; their full pages are keyed at the end of an iteration. Each step
    writes a shadow of the KV (page -> per slot, the tokens its KV is of: the position's and
    every one before it), and a request must only ever read the KV of its own tokens."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(PagePool(NUM_PAGES), PAGE, enable_prefix_caching=True)
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # preempted, or short of pages at admission
        self.kv_of: dict[int, list[tuple[int, ...] | None]] = {}
        self.queries = self.hits = 0

    def _admit(self, request: Request, use_cache: bool, n: int) -> None:
        tokens = request.all_ids
        hit = self.kv.lookup(request, use_cache=use_cache)
        if use_cache:
            self.queries += len(tokens)
            self.hits += hit
            assert hit % PAGE == 0 and hit <= len(tokens) - 1
        else:
            assert hit == 0
        assert len(request.pages) == hit // PAGE
        request.num_computed_tokens = hit
        self._check_reads(request)  # a hit never hands out another prefix's KV
        self.running.append(request)
        if not self._step(request, n):
            self.running.remove(request)
            self.kv.free(request)  # gives its hits back
            request.num_computed_tokens = 0
            self.waiting.append(request)

    def _step(self, request: Request, n: int) -> bool:
        """Allocate and write the KV of up to n more tokens; sample once the last is in."""
        tokens = tokens_of(request)
        start = request.num_computed_tokens
        n = min(n, len(tokens) - start)
        new = self.kv.allocate(request, n)
        if new is None:
            return False
        for page in new:
            assert self.kv.pool.refcount(page) == 1 and page not in self.kv.cache
            self.kv_of[page] = [None] * PAGE
        for p in range(start, start + n):
            page = request.pages[p // PAGE]
            # nobody else reads it, and no key says what it holds: a write changes nothing seen
            assert self.kv.pool.refcount(page) == 1 and page not in self.kv.cache
            self.kv_of[page][p % PAGE] = tuple(tokens[:p + 1])
        request.num_computed_tokens += n
        if request.num_computed_tokens == len(tokens):
            request.num_pending += 1
        return True

    def _read(self, request: Request) -> None:
        request.output_ids[:] = tokens_of(request)[len(request.prompt_ids):]
        request.num_pending = 0

    def _check_reads(self, request: Request) -> None:
        tokens = tokens_of(request)
        for p in range(request.num_computed_tokens):
            assert self.kv_of[request.pages[p // PAGE]][p % PAGE] == tuple(tokens[:p + 1])

    @precondition(lambda self: len(self.running) + len(self.waiting) < 6)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=6),
          use_cache=st.sampled_from([True, True, True, False]), n=st.integers(1, 8))
    def add(self, prefix, suffix, use_cache, n):
        prompt = prefix + suffix
        if prompt:
            self._admit(make_request(prompt), use_cache, n)

    @precondition(lambda self: len(self.running) + len(self.waiting) < 5)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=4),
          n=st.integers(1, 8))
    def add_twins(self, prefix, suffix, n):
        """Two requests that compute the same pages in one iteration: the second's are
        duplicates, and its later pages hang from the first's."""
        if prefix + suffix:
            self._admit(make_request(prefix + suffix), True, n)
            self._admit(make_request(prefix + suffix + [5, 5, 5]), True, n)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), n=st.integers(1, 8))
    def resume(self, data, n):
        request = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self._admit(request, True, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 8))
    def step(self, data, n):
        request = data.draw(st.sampled_from(self.running))
        if request.num_tokens >= MAX_TOKENS:
            self._finish(request)
        elif not self._step(request, n):
            self._preempt(request)

    @rule()
    def end_iteration(self):
        for request in self.running:
            self.kv.cache_full_pages(request, request.num_computed_tokens)

    @precondition(lambda self: any(r.num_pending for r in self.running))
    @rule(data=st.data())
    def read(self, data):
        self._read(data.draw(st.sampled_from([r for r in self.running if r.num_pending])))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._finish(data.draw(st.sampled_from(self.running)))

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.running)))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._read(request)  # it waits for its pending tokens before it is resumed
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))

    @precondition(lambda self: self.kv.num_cached_pages)
    @rule()
    def reset(self):
        cached = self.kv.num_cached_pages
        done = self.kv.reset_prefix_cache()
        assert done == (not self.running)
        assert self.kv.num_cached_pages == (0 if done else cached)

    @invariant()
    def pages_are_accounted_for(self):
        pool, cache = self.kv.pool, self.kv.cache
        holders = Counter(p for r in self.running for p in r.pages)
        assert all(len(set(r.pages)) == len(r.pages) for r in self.running)
        assert all(not r.pages for r in self.waiting)
        assert 0 not in holders
        assert all(pool.refcount(p) == holders[p] for p in range(NUM_PAGES))
        free, evictable = list(pool._free), list(pool._evictable)
        keyed = set(cache._key_of)
        assert len(free) + len(evictable) + len(holders) == pool.num_usable
        assert set(free) | set(evictable) | set(holders) == set(range(1, NUM_PAGES))
        assert set(evictable) == keyed - set(holders) and not set(free) & keyed
        assert pool.num_free == len(free) + len(evictable)
        for r in self.running:  # a page two requests hold is a cached page they both read
            shared = [i for i, p in enumerate(r.pages) if holders[p] > 1]
            assert all(r.pages[i] in keyed and i < r.num_computed_tokens // PAGE for i in shared)
        if not self.running:
            assert pool.num_free == pool.num_usable

    @invariant()
    def every_read_is_of_its_own_tokens(self):
        """Shared pages included: a page two requests hold has their same tokens up to there."""
        for request in self.running:
            self._check_reads(request)

    @invariant()
    def every_key_names_the_kv_its_page_holds(self):
        """Walked up to the first page, a key spells the prefix whose KV its page holds."""
        cache = self.kv.cache
        assert {p: k for k, p in cache._page_of.items()} == cache._key_of
        children: dict[int, set[int]] = {}
        for page, (parent, tokens, _) in cache._key_of.items():
            if parent is not None:
                children.setdefault(parent, set()).add(page)
            prefix = tokens
            while parent is not None:
                parent, tokens, _ = cache._key_of[parent]  # a parent is always keyed
                prefix = tokens + prefix
            end = len(prefix)
            assert self.kv_of[page] == [prefix[:p + 1] for p in range(end - PAGE, end)]
        assert cache._children == children

    @invariant()
    def stats_count_tokens(self):
        assert (self.kv.queries, self.kv.hits) == (self.queries, self.hits)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_machine = PrefixCacheMachine.TestCase
