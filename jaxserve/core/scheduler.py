"""The host scheduler: which requests run each iteration and how many tokens each (vLLM V1's rule).

There is no prefill or decode phase: a request has computed tokens and total tokens, and every
iteration hands out tokens under `max_num_batched_tokens`: running decodes first, then running
prompt chunks, then waiting requests in policy order, each prompt chunked to what the budget
leaves. The batching mode only changes admission:

    continuous  join free slots every iteration (the window may gate it: the two-layer strategy)
    dynamic     a batch forms in the window (up to max_batch_size) and runs to completion
    static      a batch of up to max_batch_size runs to completion; nothing joins until it ends

With `length_buckets` (the runner's prefill chunk sizes), the prompt chunks that join in one
iteration share a bucket, so the runner pads fewer rows to a longer chunk; the first waiting
request in policy order always may join.

Speculative decoding (`num_spec_tokens` > 0, a `proposer`): in an iteration that speculates
(`speculates()`: at most `spec_max_batch` running), a decode row whose tokens the host holds
feeds its newest token and up to k proposed ones, and samples 1 to k + 1 tokens: its computed
tokens count all k + 1 positions until `update` learns how many the verification kept, and
rolls the rest back (their K/V is overwritten by the tokens that follow).
"""

import bisect
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from jaxserve.config.engine import EngineConfig
from jaxserve.core.admission import Admission
from jaxserve.core.kv_manager import KVCacheManager
from jaxserve.core.page_pool import PagePool
from jaxserve.core.policies import Policy, make_policy
from jaxserve.core.predictors import resolve_predictor
from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.core.waiting import WaitingQueue
from jaxserve.core.window import AdaptiveWindow, BatchingWindow
from jaxserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxserve.spec import Proposer

BATCHING_MODES = ("static", "dynamic", "continuous")


class Scheduler(Admission):
    def __init__(self, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_chunk_tokens: int,
                 batching: str = "continuous", policy: str | Policy = "fcfs",
                 window: BatchingWindow | None = None, decode_steps: int = 1,
                 length_buckets: tuple[int, ...] = (), enable_prefix_caching: bool = False,
                 num_spec_tokens: int = 0, proposer: "Proposer | None" = None,
                 spec_max_batch: int | None = None, sliding_window: int | None = None,
                 max_loras: int = 0, clock: Callable[[], float] = time.monotonic):
        """max_loras: at most this many LoRA adapters among the running requests (the
        device's slots for them); 0: no bound."""
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {batching!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({max_num_seqs}) so every running request can decode")
        if min(max_num_batched_tokens, max_chunk_tokens) < 2:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and "
                             f"max_chunk_tokens ({max_chunk_tokens}) must be at least 2: a prompt "
                             "chunk feeds 2 or more tokens, or a prompt could never start")
        # sliding_window: every layer's, so pages behind a running request's window go back
        self.kv = KVCacheManager(PagePool(num_pages), page_size, enable_prefix_caching,
                                 sliding_window)
        self.enable_prefix_caching = enable_prefix_caching
        # requests whose computed tokens filled a page since their pages were last keyed (an
        # ordered set: the first to key a prefix holds it)
        self._to_key: dict[Request, None] = {}
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_chunk_tokens = max_chunk_tokens
        self.batching = batching
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(self.kv)
        self.window = window or BatchingWindow(max_batch_size=max_num_seqs)
        self.decode_steps = decode_steps
        self.length_buckets = tuple(length_buckets)
        self.clock = clock
        self.waiting = WaitingQueue(
            (lambda r: self.policy.key(r, 0.0)) if self.policy.static_order else None)
        self.running: list[Request] = []
        self._running_changes = 0  # counts changes to running's set (a request in or out)
        self._ranked: list[Request] = []  # running in policy order, as of _ranked_at changes
        self._ranked_at = -1
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_preemptions = 0
        self._batch: set[str] = set()  # static/dynamic: the batch running to completion
        self._batch_rows = 0  # its size when it formed
        if num_spec_tokens and proposer is None:
            raise ValueError("num_spec_tokens needs a proposer")
        self.num_spec_tokens = num_spec_tokens
        self.proposer = proposer
        self.spec_max_batch = spec_max_batch
        # vLLM's spec_decode counters: rows that proposed, tokens proposed, tokens kept (in
        # all, and per position of the proposal)
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * num_spec_tokens

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        pages = -(-request.max_len // self.kv.page_size)
        if pages > self.kv.pool.num_usable:  # it would preempt itself for ever
            raise ValueError(f"request {request.request_id!r} needs {pages} KV pages at its "
                             f"max length {request.max_len}; the KV cache has "
                             f"{self.kv.pool.num_usable}")
        self.waiting.add(request)  # first: a policy that cannot order it leaves no trace
        self.requests[request.request_id] = request
        self.window.observe_arrival(request.arrival_time)

    def abort(self, request_id: str) -> Request | None:
        """Abort in any state; its pages are free at once. None if unknown or finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus,
               stop_reason: int | str | None = None) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._running_changes += 1
            self.kv.free(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.set_status(status)
        request.stop_reason = stop_reason
        request.metrics.finished_time = self.clock()
        self.requests.pop(request.request_id, None)
        self._batch.discard(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one iteration ---------------------------------------------------------------------------

    def speculates(self) -> bool:
        """Whether the next iteration verifies proposals (the engine loop then reads it before
        scheduling another: the proposals need every token on the host)."""
        return bool(self.num_spec_tokens and self.running) and (
            self.spec_max_batch is None or len(self.running) <= self.spec_max_batch)

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(speculative=self.speculates())
        if self._to_key:
            self._key_pages()
        budget = self.max_num_batched_tokens
        # nothing can join while every slot is taken: skip ordering the (maybe long) queue
        admissible = self._admissible(now) if len(self.running) < self.max_num_seqs else []
        running = self._running_order(now)
        page_size, chunks = self.kv.page_size, out.chunks
        key_pages = self._to_key if self.enable_prefix_caching else None
        # decodes first, in policy order, then prompt chunks: decodes are never starved by
        # chunks. In this one pass (most rows of most steps) a plain decode row commits at
        # once: its pages hold its next position, or it takes a page from the pool (_commit's
        # decode branch inline: per request per step). From the first decode row that cannot
        # (the pool or the budget is short), every decode row goes the general way below, in
        # order; multi-step and speculative iterations take every row that way. A request
        # whose pending tokens reach max_len only waits for update() to finish it.
        decoding, chunking = [], []
        inline = self.decode_steps == 1 and not out.speculative and self.kv.sliding_window is None
        num_inline = 0
        for r in running:
            start = r.num_computed_tokens
            total = len(r.prompt_ids) + len(r.output_ids) + r.num_pending
            if total > start + 1:
                chunking.append(r)
            elif total == start + 1 and r.max_len > total:
                if inline and budget > 0 and (start < len(r.pages) * page_size
                                              or self.kv.allocate(r, 1) is not None):
                    budget -= 1
                    r.num_computed_tokens = start + 1
                    r.num_pending += 1
                    chunks.append(ScheduledChunk(r, start, 1, 1))
                    if key_pages is not None and (start + 1) % page_size == 0:
                        key_pages[r] = None
                    num_inline += 1
                else:
                    inline = False
                    decoding.append(r)
        runs_on = None  # the requests that run on (the rest only wait to be finished)
        will_admit = bool(admissible) and len(running) < self.max_num_seqs
        # several decode steps per dispatch only when nobody waits to join and every row can
        # take them all (so K is 1 or decode_steps: two compiled shapes, no overshoot); a row
        # with sampler controls samples once per step (its mask needs the previous token)
        if (self.decode_steps > 1 and decoding and not chunking and not will_admit
                and not out.speculative
                and all(r.remaining_tokens >= self.decode_steps and not r.params.controlled
                        and self.policy.allows_multi_step(r) for r in decoding)):
            out.decode_steps = self.decode_steps
        queue = deque(decoding + chunking)
        while queue and budget > 0:
            request = queue.popleft()
            n = self._chunk(request, budget)
            if n == 0:
                continue
            draft = self._draft(request, budget) if n == 1 and out.speculative else None
            positions = n if n > 1 else 1 + len(draft) if draft is not None else out.decode_steps
            self.kv.release_outside_window(request)  # before it asks for more
            allocated = True
            while allocated and self.kv.allocate(request, positions) is None:
                # as vLLM V1: the policy's last of every running request that runs on, even
                # one already given its tokens this iteration (its row is taken back). Those
                # that only wait for update() to finish them free their pages then: rather
                # than preempt itself, the request waits an iteration for them
                if runs_on is None:  # (those committed so far among them)
                    runs_on = {c.request for c in chunks} | set(decoding) | set(chunking)
                candidates = [r for r in self.running if r in runs_on]
                victim = self.policy.victim(candidates, now)
                allocated = victim is not request
                if victim is request and len(candidates) < len(self.running):
                    break
                budget += self._uncommit(victim, out)
                self._preempt(victim, out)
                if victim in queue:
                    queue.remove(victim)
            if allocated:
                budget -= positions if draft is not None else n
                self._commit(request, n, out, draft)
        if out.speculative and not any(c.draft for c in out.chunks):
            for chunk in out.chunks:  # nothing to verify: its rows decode one token as usual
                chunk.draft = None
        if out.preempted:
            # pages ran short: the preempted go back first, nobody new takes their pages (and a
            # newcomer never joins a multi-step iteration, whose K it was not counted in)
            out.batch_rows = self._batch_rows if self._batch else 0
            return out
        bucket = max((self._bucket(c.num_tokens) for c in out.chunks
                      if c.num_tokens > 1 and c.draft is None),
                     default=None) if admissible and self.length_buckets else None
        adapters = ({r.lora_name for r in self.running} - {None}) if self.max_loras else None
        for request in admissible:
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            if (adapters is not None and request.lora_name is not None
                    and request.lora_name not in adapters and len(adapters) >= self.max_loras):
                continue  # its adapter waits for a slot: every one is running another's
            # its cached prefix first: the chunk starts past it (taken back if it cannot join)
            self._lookup(request)
            n = self._chunk(request, budget)
            if n == 0:
                self._unlookup(request)
                break
            if self.length_buckets and n > 1:
                b = self._bucket(n)
                if bucket is not None and b != bucket and request is not admissible[0]:
                    self._unlookup(request)
                    continue  # joins in an iteration of its own bucket
                bucket = b if bucket is None else max(bucket, b)
            if self.kv.allocate(request, n if n > 1 else out.decode_steps) is None:
                self._unlookup(request)
                break  # new requests never preempt running ones
            if self.enable_prefix_caching and request.params.prompt_logprobs is None:
                self.kv.count_lookup(request, request.num_computed_tokens)
            if request.num_cached_tokens is None:  # as vLLM reports it: the first admission's
                request.num_cached_tokens = request.num_computed_tokens
            self.waiting.remove(request)
            request.set_status(RequestStatus.RUNNING)
            self.running.append(request)
            if adapters is not None and request.lora_name is not None:
                adapters.add(request.lora_name)
            self._running_changes += 1
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            self.policy.on_admit(request, now)
            budget -= n
            self._commit(request, n, out)
        out.batch_rows = self._batch_rows if self._batch else 0
        out.decode_only = num_inline == len(chunks)  # (nothing preempted: none taken back)
        return out

    def _running_order(self, now: float) -> list[Request]:
        """The running requests in policy order. A policy whose keys are fixed per request
        orders the same set alike every time: sorted again only when the set changed."""
        if not self.policy.fixed_keys:
            return self.policy.order(self.running, now)
        if self._ranked_at != self._running_changes:
            self._ranked = self.policy.order(self.running, now)
            self._ranked_at = self._running_changes
        return self._ranked

    def _bucket(self, num_tokens: int) -> int:
        return bisect.bisect_left(self.length_buckets, num_tokens) if self.length_buckets else 0

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens to feed this iteration: 1 to decode, else a prompt chunk of at least 2 (a
        1-token row is a decode row to the runner), or 0 when the budget leaves too little."""
        if request.num_to_compute == 1:
            return 1
        n = min(request.num_to_compute, budget, self.max_chunk_tokens)
        return n if n >= 2 else 0

    def _draft(self, request: Request, budget: int) -> list[int] | None:
        """The tokens a decode row proposes, to verify with its newest one (None: it decodes
        as usual: a row with sampler controls, whose masks follow each token, or one whose
        newest tokens are still on the device). At most k, one fewer than it may still
        generate (the verification samples one past them), within the budget."""
        if request.num_pending or request.params.controlled:
            return None
        k = min(self.num_spec_tokens, request.remaining_tokens - 1, budget - 1)
        return self.proposer.propose(request, k)[:k] if k > 0 else []

    def _commit(self, request: Request, n: int, out: SchedulerOutput,
                draft: list[int] | None = None) -> None:
        start = request.num_computed_tokens
        if draft is not None:  # verification row: its newest token and the draft
            n = samples = 1 + len(draft)
            request.num_computed_tokens += n
        elif n == 1:  # decode row: feeds one token, runs decode_steps steps
            samples = out.decode_steps
            request.num_computed_tokens += samples
        else:
            request.num_computed_tokens += n
            samples = 1 if request.num_computed_tokens == request.num_tokens else 0
        request.num_pending += samples
        out.chunks.append(ScheduledChunk(request, start, n, samples, draft))
        if (self.enable_prefix_caching
                and request.num_computed_tokens // self.kv.page_size > start // self.kv.page_size):
            self._to_key[request] = None  # a page filled: keyed once its step is dispatched

    # -- prefix caching ------------------------------------------------------------------------

    def _lookup(self, request: Request) -> None:
        """A joining request starts past its longest cached prefix (none for a request that
        wants prompt logprobs: they come from computing the prompt)."""
        if self.enable_prefix_caching:
            request.num_computed_tokens = self.kv.lookup(
                request, use_cache=request.params.prompt_logprobs is None, count=False)

    def _unlookup(self, request: Request) -> None:
        """It does not join after all: the cached pages go back (evictable again)."""
        if self.enable_prefix_caching:
            self.kv.free(request)
            request.num_computed_tokens = 0

    def _key_pages(self) -> None:
        """Key the pages the dispatched steps filled. They run at the start of the next
        schedule: every step writing them was dispatched (and none is taken back any more), so
        any step that reads them through a hit comes after it on the device (each step takes
        the KV pool the one before returned). A page whose last tokens the host has not read
        yet (sampled on the device) is keyed by a later schedule."""
        size = self.kv.page_size
        for request in list(self._to_key):
            if request.status is not RequestStatus.RUNNING:  # finished or preempted: freed
                del self._to_key[request]
                continue
            known = len(request.prompt_ids) + len(request.output_ids)
            self.kv.cache_full_pages(request, request.num_computed_tokens)  # capped at known
            if known // size >= request.num_computed_tokens // size:
                del self._to_key[request]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache): False, and nothing
        forgotten, while any request holds pages."""
        return self.kv.reset_prefix_cache()

    def _uncommit(self, request: Request, out: SchedulerOutput) -> int:
        """Take back the request's row of this iteration (before preempting it): the tokens
        it had been given, 0 if none."""
        for i, chunk in enumerate(out.chunks):
            if chunk.request is request:
                del out.chunks[i]
                request.num_computed_tokens = chunk.start
                request.num_pending -= chunk.num_samples
                return chunk.num_tokens
        return 0

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute later: free the pages, back to the waiting queue (its policy key is kept)."""
        self.running.remove(request)
        self._running_changes += 1
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.set_status(RequestStatus.WAITING)
        request.metrics.num_preemptions += 1
        request.metrics.last_preempted_time = self.clock()
        self.waiting.add(request)
        self.num_preemptions += 1
        out.preempted.append(request)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int] | None = None) -> None:
        """A dispatched iteration was read: the tokens it sampled are pending no more. The
        output processor (engine/outputs.py) appends those each request keeps, applies the stops and
        calls `finish` for the requests they end. `sampled`: by request id, the tokens each
        verification row got (1 + the proposed tokens it kept); the positions of the rest are
        computed no more."""
        if sampled is None:  # (most iterations: no verification row)
            for chunk in out.chunks:
                chunk.request.num_pending -= chunk.num_samples
            return
        for chunk in out.chunks:
            request = chunk.request
            request.num_pending -= chunk.num_samples
            if chunk.draft is None or request.request_id not in sampled:
                continue
            got = sampled[request.request_id]
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens -= chunk.num_samples - got
            if chunk.draft:
                self.spec_drafts += 1
                self.spec_draft_tokens += len(chunk.draft)
                self.spec_accepted_tokens += got - 1
                for i in range(got - 1):
                    self.spec_accepted_per_pos[i] += 1

    def stats(self) -> dict[str, float]:
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "kv_pages_total": self.kv.pool.num_usable,
            "kv_pages_free": self.kv.pool.num_free,
            "kv_cache_usage": self.kv.usage,
            "kv_fragmentation": self.kv.fragmentation(self.running),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.kv.queries,
            "prefix_cache_hits": self.kv.hits,
            "kv_pages_released_by_window": self.kv.released,
            "spec_decode_num_drafts": self.spec_drafts,
            "spec_decode_num_draft_tokens": self.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
        }


def make_scheduler(config: EngineConfig, num_pages: int, max_chunk_tokens: int,
                   clock: Callable[[], float] = time.monotonic,
                   sliding_window: int | None = None) -> Scheduler:
    """The scheduler an engine config describes (the engine's, the simulator's, benchmarks').
    `sliding_window`: the model's every layer's (ModelConfig.shared_window), whose pages
    behind it go back; not with a draft model, which reads the target's pages from the
    start."""
    max_batch = min(config.max_batch_size or config.max_num_seqs, config.max_num_seqs)
    min_batch = min(config.min_batch_size, max_batch)
    if config.adaptive_window:
        window = AdaptiveWindow(config.window_ms, min_batch, max_batch,
                                window_ms_min=config.window_ms_min,
                                window_ms_max=config.window_ms_max)
    else:
        window = BatchingWindow(config.window_ms, min_batch, max_batch)
    policy = make_policy(config.policy, slo_ms=config.slo_ms,
                         predictor=resolve_predictor(config.sjf_predictor)
                         if config.policy == "sjf" else None)
    spec = config.speculative_config
    proposer = None
    if spec is not None and spec.method == "ngram":
        from jaxserve.spec.ngram import NgramProposer

        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec is not None:
        from jaxserve.spec.draft_model import DraftModelProposer

        proposer = DraftModelProposer()
        sliding_window = None
    return Scheduler(
        sliding_window=sliding_window,
        num_spec_tokens=0 if spec is None else spec.num_speculative_tokens, proposer=proposer,
        spec_max_batch=None if spec is None else spec.disable_by_batch_size,
        num_pages=num_pages, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_chunk_tokens=max_chunk_tokens,
        batching=config.batching, policy=policy, decode_steps=config.decode_steps,
        max_loras=config.max_loras if config.enable_lora else 0,
        window=window, clock=clock, enable_prefix_caching=config.enable_prefix_caching,
        length_buckets=config.prefill_chunk_sizes if config.length_bucketing else ())
