"""Queue orders. A policy ranks requests (lower key first) and so picks the preemption victim.

    fcfs      arrival order
    priority  two-level QoS: realtime (priority <= 0) and batch (> 0) share admissions by weight
              (3:1), lower priority value first within a class; realtime rows decode one step
              per dispatch
    sjf       shortest predicted output first, aged so long requests are not starved
    mlfq      FastServe's skip-join multi-level feedback queue: the prompt picks the entry level,
              tokens served demote, waiting promotes
    edf       earliest deadline (arrival + the request's TTFT target) first
    lpm       longest prefix match first (SGLang's): the waiting request with the most prompt
              tokens in the prefix cache goes first, so pages are reused before they are
              evicted; one waiting `starvation_s` goes first whatever its match

New policies subclass `Policy`; the scheduler only calls `order`, `victim`, `on_admit`,
`allows_multi_step` and (once, with its KV manager) `bind`. Keys may depend on the time (aging). A policy whose keys rank waiting
requests alike at every time sets `static_order`: the scheduler then keeps its waiting queue
sorted as requests arrive, so a long queue is not sorted every iteration.
"""

import itertools
import math
import weakref
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from jaxserve.core.predictors import Predictor, PromptLengthPredictor
from jaxserve.request import Request, RequestStatus


class Policy(ABC):
    name: str
    static_order: bool = False  # key(r, t) ranks waiting requests alike for every t
    # key(r, t) is fixed per request and order() a plain sort by it: the running requests'
    # order changes only when one joins or leaves (the scheduler sorts them only then)
    fixed_keys: bool = False

    @abstractmethod
    def key(self, request: Request, now: float) -> Any:
        """Sort key: requests with lower keys are served first."""

    def order(self, requests: Iterable[Request], now: float, limit: int | None = None,
              presorted: bool = False) -> list[Request]:
        """The first `limit` (default all) requests, first served first; `presorted`: they
        come in key order already (the waiting queue: only the first `limit` are read)."""
        if presorted:
            return list(itertools.islice(requests, limit))
        ranked = sorted(requests, key=lambda r: self.key(r, now))
        return ranked if limit is None else ranked[:limit]

    def victim(self, running: list[Request], now: float) -> Request:
        """The running request to preempt when pages run out: the one served last."""
        return max(running, key=lambda r: self.key(r, now))

    def on_admit(self, request: Request, now: float) -> None:  # noqa: B027 (optional hook)
        """A waiting request joined the running batch (stateful policies keep their books)."""

    def allows_multi_step(self, request: Request) -> bool:
        """Whether the request's decode row may run several steps in one dispatch."""
        return True

    def bind(self, kv) -> None:  # noqa: B027 (optional hook)
        """The scheduler's KV manager (core.kv_manager), for a policy that reads the cache."""


class FCFS(Policy):
    name = "fcfs"
    static_order = True
    fixed_keys = True

    def key(self, request: Request, now: float) -> Any:
        return (request.arrival_time, request.request_id)


class PriorityPolicy(Policy):
    """Two classes share admissions by weight, as stride scheduling over requests: class c's
    k-th queued request gets the tag  pass_c + k / weight_c, lowest first (ties: realtime):

        realtime (3)   rt1 1/3   rt2 2/3   rt3 1     rt4 4/3 ...
        batch    (1)                       b1  1     b2  2   ...

    Admitting from c advances pass_c by 1 / weight_c, and lifts a class with nothing waiting to
    pass_c, so an idle class banks no credit. Lower `priority` first within a class. When pages
    run short the batch class gives its pages up first, then within a class the highest
    `priority` value, then the request first admitted last (as vLLM's victim: the largest
    (priority, arrival)); a re-admission keeps the first one's seniority. A batch request
    preempted `batch_preemptions` times is given up last of all, so realtime load that keeps
    the pool full cannot starve it (it would recompute for ever).
    """

    name = "priority"
    static_order = True

    def __init__(self, weights: tuple[float, float] = (3.0, 1.0), realtime_max_priority: int = 0,
                 batch_preemptions: int = 2):
        if min(weights) <= 0:
            raise ValueError(f"priority weights must be positive, got {weights}")
        self.weights = weights
        self.realtime_max_priority = realtime_max_priority
        self.batch_preemptions = batch_preemptions
        self._pass = [0.0, 0.0]  # per class: realtime, batch
        self._idle: set[int] = set()  # classes with nothing waiting at the last admission order
        self._admissions = 0
        self._admitted: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def qos_class(self, request: Request) -> int:
        """0: realtime, 1: batch."""
        return 0 if request.priority <= self.realtime_max_priority else 1

    def key(self, request: Request, now: float) -> Any:
        return (self.qos_class(request), request.priority, request.arrival_time,
                request.request_id)

    def order(self, requests: Iterable[Request], now: float, limit: int | None = None,
              presorted: bool = False) -> list[Request]:
        ranked = sorted(requests, key=lambda r: self.key(r, now)) if not presorted else list(
            requests)  # the weighted merge needs both classes whole
        split = bisect_left(ranked, 1, key=self.qos_class)  # keys sort realtime first
        classes = (ranked[:split], ranked[split:])
        if ranked and ranked[0].status == RequestStatus.WAITING:  # the waiting queue (running
            self._idle = {c for c in (0, 1) if not classes[c]}  # ones are ordered for budget)
        out, taken = [], [0, 0]
        limit = len(ranked) if limit is None else min(limit, len(ranked))
        while len(out) < limit:  # merge by tag: pass_c + k / weight_c for c's k-th request
            tags = [self._pass[c] + (taken[c] + 1) / self.weights[c]
                    if taken[c] < len(classes[c]) else math.inf for c in (0, 1)]
            c = 0 if tags[0] <= tags[1] else 1
            out.append(classes[c][taken[c]])
            taken[c] += 1
        return out

    def on_admit(self, request: Request, now: float) -> None:
        c = self.qos_class(request)
        self._pass[c] += 1.0 / self.weights[c]
        for idle in self._idle:
            self._pass[idle] = max(self._pass[idle], self._pass[c])
        self._admissions += 1
        self._admitted.setdefault(request, self._admissions)  # seniority survives preemption

    def victim(self, running: list[Request], now: float) -> Request:
        """Batch before realtime, then the highest priority value, then the one first admitted
        last (never admitted here: before all others). A batch request preempted
        `batch_preemptions` times ranks after every other: it was the one given up each time,
        and a newer stamp would make it the victim again at once."""
        def rank(r: Request):
            batch = self.qos_class(r) == 1
            promoted = batch and r.metrics.num_preemptions >= self.batch_preemptions
            return (batch and not promoted, -math.inf if promoted else r.priority,
                    self._admitted.get(r, 0), self.key(r, now))

        return max(running, key=rank)

    def allows_multi_step(self, request: Request) -> bool:
        # a realtime row streams a token per dispatch: K steps would delay each token K-fold
        return self.qos_class(request) == 1


class SJF(Policy):
    """Shortest predicted remaining output first. Aging: a waiting request's predicted length
    shrinks by `aging_tokens_per_s` per second waited, so a long one eventually goes first."""

    name = "sjf"
    static_order = True  # every waiting request ages at the same rate

    def __init__(self, predictor: Predictor | None = None, aging_tokens_per_s: float = 50.0):
        self.predictor = predictor or PromptLengthPredictor()
        self.aging_tokens_per_s = aging_tokens_per_s
        self._predicted: weakref.WeakKeyDictionary[Request, float] = weakref.WeakKeyDictionary()

    def predicted(self, request: Request) -> float:
        """Predicted total output tokens, computed once per request, never past what the
        request may produce (its max_tokens, or the room left in max_model_len)."""
        value = self._predicted.get(request)
        if value is None:
            value = self._predicted[request] = min(float(self.predictor(request)),
                                                   float(request.max_len - len(request.prompt_ids)))
        return value

    def key(self, request: Request, now: float) -> Any:
        # tokens still in flight count as served: a preempted request's key must not change
        # while it waits in the queue, which is kept sorted
        served = request.num_tokens - len(request.prompt_ids)
        remaining = max(0.0, self.predicted(request) - served)
        waited = now - request.arrival_time
        return (remaining - self.aging_tokens_per_s * waited, request.arrival_time,
                request.request_id)


class MLFQ(Policy):
    """Levels 0 (first) .. num_levels - 1; level i holds requests whose service s lies in
    [q (2^i - 1), q (2^(i+1) - 1)), q = quantum_tokens, so quanta double per level. Service is
    output tokens served plus the prompt counted at `prompt_token_cost` each: the prompt alone
    decides the entry level (skip-join: a long prompt skips the top queues). A request waiting
    `starvation_s` since arrival or its last preemption is promoted to level 0, and once
    admitted keeps level 0 until served `quantum_tokens` more (FastServe's promotion), so it is
    not the first victim when pages run short and makes progress. A preemption after which it
    made no progress does not restart its wait, and `fruitless_preemptions` of them in a row
    count as starving: the demoted request is the victim every time pages run short, and would
    recompute and be preempted over and over until `starvation_s`. FCFS within a level."""

    name = "mlfq"

    def __init__(self, num_levels: int = 4, quantum_tokens: float = 16.0,
                 prompt_token_cost: float = 0.25, starvation_s: float = 5.0,
                 fruitless_preemptions: int = 2):
        self.num_levels = num_levels
        self.quantum_tokens = quantum_tokens
        self.prompt_token_cost = prompt_token_cost
        self.starvation_s = starvation_s
        self.fruitless_preemptions = fruitless_preemptions
        # promoted requests once admitted: the output length up to which they stay at level 0
        self._boost: weakref.WeakKeyDictionary[Request, float] = weakref.WeakKeyDictionary()
        # per request: its output length and preemptions when its wait began, and when
        self._wait: weakref.WeakKeyDictionary[Request, tuple[int, int, float]] = (
            weakref.WeakKeyDictionary())

    def level(self, request: Request, now: float) -> int:
        if request.status == RequestStatus.WAITING and self._starving(request, now):
            return 0
        if len(request.output_ids) < self._boost.get(request, -1.0):
            return 0
        service = len(request.prompt_ids) * self.prompt_token_cost + len(request.output_ids)
        return min(self.num_levels - 1, int(math.log2(1.0 + service / self.quantum_tokens)))

    def _starving(self, request: Request, now: float) -> bool:
        preempted = request.metrics.last_preempted_time
        n, k = len(request.output_ids), request.metrics.num_preemptions
        wait = self._wait.get(request)
        if wait is None or n > wait[0]:  # first seen, or served since: the wait starts anew
            wait = self._wait[request] = (n, k, request.arrival_time if preempted is None
                                          else preempted)
        return (now - wait[2] >= self.starvation_s
                or k - wait[1] >= self.fruitless_preemptions)

    def on_admit(self, request: Request, now: float) -> None:
        if self._starving(request, now):
            self._boost[request] = len(request.output_ids) + self.quantum_tokens

    def key(self, request: Request, now: float) -> Any:
        return (self.level(request, now), request.arrival_time, request.request_id)


class EDF(Policy):
    """Earliest deadline first; the deadline is arrival + the request's slo_ms (or the default)."""

    name = "edf"
    static_order = True
    fixed_keys = True

    def __init__(self, default_slo_ms: float = 1000.0):
        self.default_slo_ms = default_slo_ms

    def deadline(self, request: Request) -> float:
        slo = request.params.slo_ms or self.default_slo_ms
        return request.arrival_time + slo / 1000.0

    def key(self, request: Request, now: float) -> Any:
        return (self.deadline(request), request.arrival_time, request.request_id)


class LPM(Policy):
    """Longest prefix match first (SGLang's `lpm`): a waiting request's key is the prompt
    tokens the prefix cache holds for it, most first, then arrival. A request waiting
    `starvation_s` since it arrived (or was last preempted) goes before every other, first come
    first served among those, so a request whose prefix nobody shares is not passed over for
    ever. Past `max_queue` waiting requests it orders them first come first served, as SGLang
    does: matching a long queue every iteration would cost more than it saves. Running requests
    keep arrival order (the victim is the one that arrived last); without prefix caching it is
    fcfs."""

    name = "lpm"

    def __init__(self, starvation_s: float = 5.0, max_queue: int = 128):
        self.starvation_s = starvation_s
        self.max_queue = max_queue
        self._kv = None

    def bind(self, kv) -> None:
        self._kv = kv

    def key(self, request: Request, now: float) -> Any:
        waited_since = request.metrics.last_preempted_time or request.arrival_time
        if (request.status is not RequestStatus.WAITING or self._kv is None
                or now - waited_since >= self.starvation_s):
            return (0, 0, request.arrival_time, request.request_id)
        return (1, -self._kv.cached_prefix_len(request), request.arrival_time,
                request.request_id)

    def order(self, requests: Iterable[Request], now: float, limit: int | None = None,
              presorted: bool = False) -> list[Request]:
        requests = list(requests)
        if len(requests) > self.max_queue:
            ranked = sorted(requests, key=lambda r: (r.arrival_time, r.request_id))
            return ranked if limit is None else ranked[:limit]
        return super().order(requests, now, limit)

    def victim(self, running: list[Request], now: float) -> Request:
        return max(running, key=lambda r: (r.arrival_time, r.request_id))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, PriorityPolicy, SJF, MLFQ, EDF,
                                                         LPM)}


def make_policy(name: str, *, predictor: Predictor | None = None,
                slo_ms: float = 1000.0) -> Policy:
    """A policy by name; `predictor` is sjf's, `slo_ms` edf's default TTFT target."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    if name == "sjf":
        return SJF(predictor)
    if name == "edf":
        return EDF(slo_ms)
    return POLICIES[name]()
