"""A fake model runner whose tokens can be worked out by hand, and a driver shaped like LLMEngine.

The fake "model" samples, after position p of a request, the token

    token_after(prompt, p) = (sum(prompt) + p) % 97 + 3        (always in [3, 99])

so a request's output depends only on its prompt, never on batching, chunking, preemption or
overlap; the logprob it gives token t at any position is `fake_logprob(t)` = -t / 100, rank 1,
and its top-K are t, t + 1, ... (logprobs -(t + k) / 100). The runner consumes a SchedulerOutput
as the real runner does (decode rows are chunks of one token and run `decode_steps` steps;
others are prompt chunks that sample once at their end) and checks the scheduler's invariants on
every step. Its "device" keeps, like the real one, only the tokens the previous dispatch sampled
(the carry), so a decode row whose input token is not on the host must find it there.

It implements the engine's runner interface (jaxserve/engine/loop.py's Runner): `LLMEngine(model_dir, config,
runner=FakeRunner(...))` runs the real engine on it, with no model compiled.
"""

from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.window import BatchingWindow
from jaxserve.engine.loop import EngineCore
from jaxserve.request import Request, RequestStatus, Samples, SamplingParams, TokenLogprobs


def token_after(prompt_ids: list[int], position: int) -> int:
    """The token the fake model samples after `position` of a request with this prompt."""
    return (sum(prompt_ids) + position) % 97 + 3


def fake_logprob(token: int) -> float:
    return -token / 100


def fake_logprobs(token: int, num_top: int = 20) -> TokenLogprobs:
    """The fake model's logprobs of `token` at any position: rank 1, top-K from it upwards."""
    top = np.arange(token, token + num_top, dtype=np.int32)
    return TokenLogprobs(fake_logprob(token), 1, top, -top.astype(np.float32) / 100)


def expected_token(request: Request, position: int) -> int:
    """The token that stands at `position` of the request's sequence."""
    if position < len(request.prompt_ids):
        return request.prompt_ids[position]
    return token_after(request.prompt_ids, position - 1)


def expected_output(prompt_ids: list[int], max_tokens: int,
                    stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """What a request alone would produce: max_tokens tokens, or up to and including a stop."""
    out = []
    for i in range(max_tokens):
        out.append(token_after(prompt_ids, len(prompt_ids) - 1 + i))
        if out[-1] in stop_ids:
            break
    return out


def make_request(request_id: str, prompt: int | list[int], max_tokens: int = 4, *,
                 arrival: float = 0.0, priority: int = 0, eos: frozenset[int] = frozenset(),
                 named_eos: frozenset[int] = frozenset(), **params) -> Request:
    """A request; `prompt` is a list of ids or a length (ids derived from the id, all >= 3)."""
    if isinstance(prompt, int):
        salt = sum(map(ord, request_id))
        prompt = [(salt + 7 * i) % 50 + 3 for i in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, priority=priority, **params)
    return Request(request_id, prompt, sp, arrival_time=arrival, seed=0,
                   max_len=len(prompt) + max_tokens, eos_token_ids=eos, named_eos_ids=named_eos)


class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1000.0


@dataclass(frozen=True)
class Row:
    request_id: str
    start: int
    num_tokens: int
    num_samples: int


@dataclass
class StepLog:
    """What one iteration scheduled, and the scheduler's state right after schedule()."""

    rows: list[Row]
    decode_steps: int
    batch_rows: int
    preempted: list[str]
    running: list[str]
    waiting: list[str]
    num_free_pages: int
    time: float

    @property
    def ids(self) -> list[str]:
        return [r.request_id for r in self.rows]

    def row(self, request_id: str) -> Row | None:
        return next((r for r in self.rows if r.request_id == request_id), None)


class FakeRunner:
    """Runs a SchedulerOutput on the fake model, checking invariants as it goes (those about
    the scheduler's state once `scheduler` is set: a Driver sets it, a test of LLMEngine sets
    it to the engine's)."""

    num_compilations_after_warmup = 0

    def __init__(self, scheduler: Scheduler | None = None, *, num_pages: int = 65,
                 max_model_len: int = 64, chunk_buckets: tuple[int, ...] = (16,)):
        self.scheduler = scheduler
        self.num_pages, self.max_model_len = num_pages, max_model_len
        self.chunk_buckets = chunk_buckets
        self.carry: dict[str, tuple[int, int]] = {}  # request id -> (position, token) on "device"
        self.tables: dict[int, tuple[int, list[int]]] = {}  # id(request) -> (preemptions, pages)
        # the "KV pool": the token whose K/V each (page, slot) holds, as the dispatched rows
        # wrote them; a row must find its whole context there (a cached prefix's pages too)
        self.kv: dict[tuple[int, int], int] = {}
        self.num_dispatches = 0

    def warmup(self, progress: bool = False) -> float:
        return 0.0  # nothing to compile

    def execute(self, out: SchedulerOutput) -> dict[str, Samples]:
        """Check the step, then return what each row samples (and its logprobs, and the
        prompt's when the request asks)."""
        if self.scheduler is not None:
            self.check(out)
        sampled: dict[str, Samples] = {}
        carry = {}
        for chunk in out.chunks:
            request = chunk.request
            params = request.params
            samples = Samples([])
            if params.prompt_logprobs is not None:  # this chunk's logits score prompt tokens
                n = min(chunk.num_tokens, len(request.prompt_ids) - 1 - chunk.start)
                if n > 0:
                    samples.prompt_start = chunk.start
                    samples.prompt_logprobs = [
                        fake_logprobs(request.prompt_ids[chunk.start + 1 + j])
                        for j in range(n)]
            if chunk.draft is not None:  # verification: the drafts it would have sampled, then
                # its own token where the first wrong one stands (or past them all)
                samples.tokens = []
                for j in range(chunk.num_samples):
                    samples.tokens.append(token_after(request.prompt_ids, chunk.start + j))
                    if j == len(chunk.draft) or chunk.draft[j] != samples.tokens[-1]:
                        break
                if params.logprobs is not None:
                    samples.logprobs = [fake_logprobs(t) for t in samples.tokens]
            elif chunk.num_samples:
                last = chunk.start + chunk.num_tokens - 1  # the first sample follows it
                samples.tokens = [token_after(request.prompt_ids, last + j)
                                  for j in range(chunk.num_samples)]
                if params.logprobs is not None:
                    samples.logprobs = [fake_logprobs(t) for t in samples.tokens]
                carry[request.request_id] = (last + chunk.num_samples, samples.tokens[-1])
            if samples.tokens or samples.prompt_logprobs is not None:
                sampled[request.request_id] = samples
        self.carry = carry  # the device holds only the latest dispatch's samples
        self.num_dispatches += 1
        return sampled

    # the engine loop's runner interface: the fake computes at dispatch, hands out at collect
    def dispatch(self, out: SchedulerOutput) -> dict[str, Samples]:
        return self.execute(out)

    @staticmethod
    def finish(sampled: dict[str, Samples]) -> None:
        pass  # sampled at dispatch

    @staticmethod
    def collect(sampled: dict[str, Samples]) -> dict[str, Samples]:
        return sampled

    def check(self, out: SchedulerOutput) -> None:
        s = self.scheduler
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), f"a request has two rows: {ids}"
        assert len(out.chunks) <= s.max_num_seqs, f"{len(out.chunks)} rows > max_num_seqs"
        assert out.num_batched_tokens <= s.max_num_batched_tokens, (
            f"{out.num_batched_tokens} tokens > budget {s.max_num_batched_tokens}")
        assert 1 <= out.decode_steps <= max(1, s.decode_steps)
        self.check_pages()
        page_size = s.kv.page_size
        for chunk in out.chunks:
            request, start, n = chunk.request, chunk.start, chunk.num_tokens
            rid = request.request_id
            assert request.status == RequestStatus.RUNNING, f"{rid} scheduled while {request.status}"
            assert n >= 1 and start >= 0
            if n > 1 and chunk.draft is None:  # (a verification row has its own call)
                assert n <= s.max_chunk_tokens, f"{rid}: chunk {n} > max_chunk_tokens"
            decode_row = n == 1 and chunk.draft is None
            positions = out.decode_steps if decode_row else n
            needed = -(-(start + positions) // page_size)
            assert needed <= len(request.pages), (
                f"{rid}: positions [{start}, {start + positions}) need {needed} pages, "
                f"holds {len(request.pages)}")
            # at scheduling time the request held num_tokens - num_samples tokens
            tokens_before = request.num_tokens - chunk.num_samples
            if chunk.draft is not None:  # its newest token, then the draft
                assert out.speculative and request.num_pending == chunk.num_samples, (
                    f"{rid}: proposes with tokens on the device")
                assert start + 1 == tokens_before and chunk.num_samples == n == 1 + len(
                    chunk.draft), f"{rid}: verification row {start}+{n} of {tokens_before}"
                assert start + n < request.max_len, f"{rid}: verifies past max_len"
                self.check_inputs(out, request, start, 1)
                self.check_kv(request, start, positions, chunk.draft)
                continue
            if chunk.num_samples:
                assert start + n == tokens_before, (
                    f"{rid}: a sampling row must end at the last token ({start}+{n} != "
                    f"{tokens_before})")
                if decode_row:
                    assert chunk.num_samples == out.decode_steps
                else:
                    assert chunk.num_samples == 1
            else:
                assert start + n < tokens_before, f"{rid}: a silent chunk reaches the end"
            assert start + n + max(0, chunk.num_samples - 1) <= request.max_len, (
                f"{rid}: runs past max_len {request.max_len}")
            self.check_inputs(out, chunk.request, start, n)
            self.check_kv(request, start, positions)

    def check_inputs(self, out: SchedulerOutput, request: Request, start: int, n: int) -> None:
        """Every input token is on the host or, for a decode row, carried on the device."""
        rid = request.request_id
        host = len(request.prompt_ids) + len(request.output_ids)
        for q in range(start, start + n):
            if q < host:
                assert request.all_ids[q] == expected_token(request, q), (
                    f"{rid}: host token at {q} is {request.all_ids[q]}, "
                    f"expected {expected_token(request, q)}")
                continue
            assert n == 1, f"{rid}: prompt chunk input at {q} is not on the host"
            assert rid in self.carry, f"{rid}: input at {q} is neither on the host nor carried"
            position, token = self.carry[rid]
            assert position == q, f"{rid}: carried token is at {position}, row starts at {q}"
            assert token == expected_token(request, q)

    def check_kv(self, request: Request, start: int, positions: int,
                 draft: list[int] = ()) -> None:
        """The row's context [0, start) is in its pages as its own tokens (whoever wrote them:
        a cached prefix is another request's KV); then it writes [start, start + positions),
        never into a page another request holds or the prefix cache keys. A verification row
        writes its draft after its newest token: what the draft got wrong must be overwritten
        before any row reads it as context."""
        rid, size = request.request_id, self.scheduler.kv.page_size
        pool, cache = self.scheduler.kv.pool, self.scheduler.kv.cache
        for q in range(start):
            held = self.kv.get((request.pages[q // size], q % size))
            assert held == expected_token(request, q), (
                f"{rid}: context position {q} in page {request.pages[q // size]} holds "
                f"{held}, not its token {expected_token(request, q)}")
        for q in range(start, start + positions):
            page = request.pages[q // size]
            assert pool.refcount(page) == 1, f"{rid}: writes into page {page}, shared"
            assert cache is None or page not in cache, f"{rid}: writes into cached page {page}"
            self.kv[page, q % size] = (expected_token(request, q) if q == start or not draft
                                       else draft[q - start - 1])

    def check_pages(self) -> None:
        """Running requests hold pages nobody else holds, but for cached pages they share
        (each at the same place in their page tables, with the same tokens up to its end);
        a page's reference count is its holders; with the free and evictable (cached, held by
        nobody) pages they make up the pool."""
        s = self.scheduler
        pool, size = s.kv.pool, s.kv.page_size
        holders: dict[int, list[tuple[Request, int]]] = {}
        for r in s.running:
            for i, p in enumerate(r.pages):
                holders.setdefault(p, []).append((r, i))
        held = list(holders)
        assert 0 not in held, "the null page was handed out"
        for page, hs in holders.items():
            assert pool.refcount(page) == len(hs), f"page {page}: refcount != its holders"
            if len(hs) > 1:
                assert s.kv.cache is not None and page in s.kv.cache, (
                    f"page {page} is held by two running requests and not cached")
                (a, i), *rest = hs
                for b, j in rest:
                    assert i == j and a.all_ids[:(i + 1) * size] == b.all_ids[:(j + 1) * size], (
                        f"page {page} shared by {a.request_id} and {b.request_id} for "
                        "different prefixes")
        assert all(not r.pages for r in s.waiting), "a waiting request holds pages"
        free = list(pool._free) + list(pool._evictable)
        assert len(free) == len(set(free)), "a page is free twice"
        assert not set(free) & set(held), "a page is both free and held"
        assert sorted(free + held) == list(range(1, pool.num_pages)), "a page leaked"
        assert len(s.running) <= s.max_num_seqs
        tables = {}
        for r in s.running:  # page tables are append-only until a preemption empties them
            preemptions, pages = self.tables.get(id(r), (r.metrics.num_preemptions, []))
            if preemptions == r.metrics.num_preemptions:
                assert r.pages[:len(pages)] == pages, f"{r.request_id}: page table rewritten"
            tables[id(r)] = (r.metrics.num_preemptions, list(r.pages))
        self.tables = tables


@dataclass
class Driver:
    """Drives the scheduler through the engine's own loop (EngineCore) on the fake runner,
    logging each iteration and moving the fake clock."""

    scheduler: Scheduler
    overlap: bool = True
    clock: FakeClock | None = None  # default: the scheduler's clock when it is a FakeClock
    step_ms: float = 1.0  # how far the clock moves per iteration
    advance: bool = True  # False: the test moves the clock itself
    runner: FakeRunner = field(init=False)
    core: EngineCore = field(init=False)
    log: list[StepLog] = field(default_factory=list)
    finished: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self):
        self.runner = FakeRunner(self.scheduler)
        self.core = EngineCore(self.scheduler, self.runner, self.overlap)
        if self.clock is None and isinstance(self.scheduler.clock, FakeClock):
            self.clock = self.scheduler.clock
        self.core.on_schedule = self._log

    def _log(self, out: SchedulerOutput) -> None:
        """The iteration, and the scheduler's state right after schedule()."""
        s = self.scheduler
        self.log.append(StepLog(
            rows=[Row(c.request.request_id, c.start, c.num_tokens, c.num_samples)
                  for c in out.chunks],
            decode_steps=out.decode_steps, batch_rows=out.batch_rows,
            preempted=[r.request_id for r in out.preempted],
            running=[r.request_id for r in s.running],
            waiting=[r.request_id for r in s.waiting],
            num_free_pages=s.kv.pool.num_free, time=s.clock()))

    @property
    def inflight(self):
        """The iteration dispatched and not yet read (None: none)."""
        return self.core.inflight

    def busy(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> StepLog:
        s = self.scheduler
        step = self.core.step()
        for request in step.touched:
            if request.status.finished:
                self.finished[request.request_id] = request
        self.runner.check_pages()
        if self.clock is not None and self.advance:
            wake = s.next_wakeup()
            if not step.scheduled.chunks and step.done is None and wake is not None:
                self.clock.now = max(self.clock.now, wake)  # the engine sleeps until the window
            else:
                self.clock.advance_ms(self.step_ms)
        return self.log[-1]

    def drain(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: "
                             f"{sorted(self.scheduler.requests)}")


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str]
    stop_reasons: dict[str, int | str | None]
    log: list[StepLog]


def run(scheduler: Scheduler, requests: list[Request], overlap: bool = True,
        clock: FakeClock | None = None, max_steps: int = 10_000) -> RunResult:
    """Add every request, drive until all finish; outputs per request and the per-step log."""
    for request in requests:
        scheduler.add_request(request)
    driver = Driver(scheduler, overlap=overlap, clock=clock)
    driver.drain(max_steps)
    pool = scheduler.kv.pool
    assert pool.num_free == pool.num_usable, "pages still held after every request finished"
    return RunResult(
        outputs={r.request_id: list(r.output_ids) for r in requests},
        finish_reasons={r.request_id: r.status.value for r in requests},
        stop_reasons={r.request_id: r.stop_reason for r in requests},
        log=driver.log)


# -- helpers for scheduler tests ---------------------------------------------------------------


def small_scheduler(clock=None, window_ms=0.0, min_batch_size=1, max_batch_size=None, **kw):
    """A Scheduler with a small pool and budget, and a window built from the arguments."""
    cfg = dict(num_pages=65, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
               max_chunk_tokens=16)
    cfg |= kw
    window = BatchingWindow(window_ms, min_batch_size, max_batch_size or cfg["max_num_seqs"])
    return Scheduler(clock=clock or FakeClock(), window=window, **cfg)


def first_step(log, request_id):
    """Index of the first step that scheduled the request."""
    return next(i for i, entry in enumerate(log) if request_id in entry.ids)


def last_step(log, request_id):
    return max(i for i, entry in enumerate(log) if request_id in entry.ids)


def mixed_requests():
    return [make_request("a", 5, 9), make_request("b", 19, 3, arrival=0.001),
            make_request("c", 1, 12, arrival=0.002), make_request("d", 8, 1, arrival=0.003),
            make_request("e", 33, 7, arrival=0.004), make_request("f", 2, 5, arrival=0.005)]


def expected(requests):
    return {r.request_id: expected_output(r.prompt_ids, r.params.max_tokens, r.stop_ids)
            for r in requests}
