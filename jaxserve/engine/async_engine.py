"""The engine on a background thread, for asyncio callers (the HTTP server).

`LLMEngine` is not thread-safe, so only the engine thread touches it. Callers send commands
through a queue that the thread applies between steps, and outputs come back through each
request's stream, handed to the caller's event loop with `call_soon_threadsafe` (one call per
step). The event loop never waits on the device: it awaits futures the thread resolves.

    event loop                                  engine thread
    await add_request()  --add-->   [commands]  --> LLMEngine.add_request (between two steps)
              ack  <------------------------------- accepted | ValueError | QueueFullError
    async for out in stream  <--------------------- step() outputs, one hand-off per step
    abort()              --abort--> [commands]  --> LLMEngine.abort: pages free before the next step

The thread sleeps on a condition while there is no work. If a step raises, the engine is dead:
every open stream gets `EngineDeadError`, and so does every later request. The thread stamps a
heartbeat every iteration: work that waits while the heartbeat is old is a stalled engine
(`stalled_for`, /health's 503). Shutdown never waits on a stuck thread: past the grace period
the caller's side fails every open request itself.
"""

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.llm_engine import LLMEngine, PromptType
from jaxserve.engine.request_stream import RequestStream
from jaxserve.request import LoRARequest, RequestOutput, RequestOutputKind, SamplingParams

log = logging.getLogger("jaxserve")

_IDLE_POLL_S = 0.005  # work exists but nothing could be dispatched: look again this soon
_STOP_MARGIN_S = 2.0  # past the shutdown deadline, how long a stuck engine thread is waited for
# commands (adds, aborts) applied between two steps at most: 100,000 aborts at once must not hold
# the running requests' next step for their whole length (a request's adds are never split)
_COMMANDS_PER_ITERATION = 8192


class EngineDeadError(RuntimeError):
    """The engine thread died; no request can run any more."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and accepts no requests."""


class QueueFullError(RuntimeError):
    """`max_waiting_requests` requests already wait; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(RuntimeError):
    """The request ran past `request_timeout_s` and was aborted."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    arrival_time: float
    stream: RequestStream
    ack: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Call:
    """A function of the engine run on its thread between two steps (loading an adapter),
    its result or error resolving `done` on the caller's loop."""

    fn: Callable[[], Any]
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def set_it():
            if not self.done.done():
                if error is None:
                    self.done.set_result(result)
                else:
                    self.done.set_exception(error)

        _call_soon(self.loop, set_it)


class AsyncEngine:
    """An `LLMEngine` stepped by a background thread.

    `max_waiting_requests`: at most this many requests wait for a slot; one more raises
    `QueueFullError`. Not given: as many as the KV pool has pages (each waiting request needs
    one at least), and never fewer than `max_num_seqs`; None set later: unbounded.
    `request_timeout_s`: a request still unfinished this long after its arrival is aborted and
    its stream raises `RequestTimeoutError` (None: no limit). Both are plain attributes, read
    when a request is added. `stall_timeout_s`: work that waited this long without an engine
    iteration makes `stalled_for` report it. `on_death(error)`, if set, is called on the engine
    thread once the engine died and every client was told (a server exits then, so that its
    supervisor restarts it). `on_iteration(num_tokens)`, if set, is called on the engine thread
    for each step whose results were read, with its prompt and generated tokens.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None,
                 request_timeout_s: float | None = None, stall_timeout_s: float = 60.0):
        if max_waiting_requests is None:
            max_waiting_requests = max(engine.max_num_seqs, engine.num_kv_pages)
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.engine = engine
        self.max_waiting_requests: int | None = max_waiting_requests
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.on_death: Callable[[BaseException], None] | None = None
        self.on_iteration: Callable[[int], None] | None = None
        self._cond = threading.Condition()
        # guarded by _cond: a request's adds, together (a tuple), or one abort (a str)
        self._commands: list[tuple[_Add, ...] | str | _Call] = []
        self._stop_at: float | None = None  # guarded by _cond: shutting down, deadline
        self._error: BaseException | None = None  # guarded by _cond: the engine died of it
        self._idle = False  # guarded by _cond: the thread sleeps for want of work
        self._heartbeat = time.monotonic()  # the thread's last sign of progress
        self._working = False  # commands taken, their iteration not over
        # requests added and not yet ended, by id: the callers' side fails them itself when a
        # shutdown finds the engine thread stuck
        self._live: dict[str, _Add] = {}
        self._live_lock = threading.Lock()
        # engine-thread state
        self._streams: dict[str, RequestStream] = {}
        # a heap of (deadline, tie-breaker, stream); entries of ended streams are skipped
        self._deadlines: list[tuple[float, int, RequestStream]] = []
        self._deadline_ids = itertools.count()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread; add_request on an event loop) ----------------------------

    @property
    def is_running(self) -> bool:
        """False once the engine died or shut down."""
        return self._error is None and self._stop_at is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What killed the engine, if it died."""
        return self._error

    def stats(self) -> dict[str, Any]:
        """`LLMEngine.stats()` as of the end of the latest engine iteration."""
        return dict(self._stats)

    def stalled_for(self) -> float | None:
        """Seconds the engine has made no iteration while work waits, when that is past
        `stall_timeout_s` (None: not stalled, or idle)."""
        with self._cond:
            if self._idle and not self._commands:
                return None
            heartbeat = self._heartbeat
            pending = bool(self._commands)
        # `_working`: commands taken and their iteration not over (the stats, made before them,
        # may show no request: the first iteration after idle)
        busy = pending or self._working or self._stats.get(
            "num_requests_running", 0) or self._stats.get("num_requests_waiting", 0)
        age = time.monotonic() - heartbeat
        return age if busy and age > self.stall_timeout_s else None

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | None = None,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request and return its stream once the engine accepted it.

        Raises ValueError (bad input, naming the field), QueueFullError, EngineDeadError or
        EngineStoppedError, and nothing is left queued. Cancelled while waiting: aborted.
        """
        return (await self.add_requests([(request_id, prompt, params)], arrival_time))[0]

    async def add_requests(self, requests: list[tuple[str, PromptType, SamplingParams | None]],
                           arrival_time: float | None = None,
                           lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Queue several requests together (a prompt's n samples, a list of prompts): the
        engine takes them all in one iteration, so they start together (one at a time, each
        would wait for an engine step, and a static batch would form without the rest). All
        or none: on any error every one of them is aborted and the first error raised.
        `lora_request`: the adapter they all run with (None: the base model)."""
        limit = self.max_waiting_requests
        if limit is not None and len(requests) > limit + self.engine.max_num_seqs:
            # all or none, and never all: a 429 would be retried for ever
            raise ValueError(f"n: {len(requests)} requests together (n x the number of prompts) "
                             "can never be admitted at once: the engine runs "
                             f"{self.engine.max_num_seqs} (max_num_seqs) and queues "
                             f"{limit} (max_waiting_requests)")
        loop = asyncio.get_running_loop()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        adds = [_Add(rid, prompt, params, arrival, RequestStream(
            rid, self, loop, delta=params is not None
            and params.output_kind is RequestOutputKind.DELTA),
            loop.create_future(), lora_request) for rid, prompt, params in requests]
        with self._live_lock:
            self._live.update((a.request_id, a) for a in adds)
        try:
            self._send(*adds)
        except BaseException:
            self._forget(*(a.stream for a in adds))
            raise
        try:
            results = await asyncio.gather(*(a.ack for a in adds), return_exceptions=True)
        except asyncio.CancelledError:
            self.abort_streams([a.stream for a in adds])
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort_streams([a.stream for a in adds])
            raise errors[0]
        return [a.stream for a in adds]

    async def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the engine thread between two steps (the engine is not thread-safe);
        its result, or its error raised here."""
        loop = asyncio.get_running_loop()
        command = _Call(fn, loop.create_future(), loop)
        with self._cond:
            if self._error is not None:
                raise EngineDeadError(f"the engine is dead: {self._error!r}")
            if self._stop_at is not None:
                raise EngineStoppedError("the engine is shutting down")
            self._commands.append(command)
            self._cond.notify()
        return await command.done

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter while serving: read in a worker thread (a ValueError names what is
        wrong), then registered on the engine thread between two steps."""
        adapter = await asyncio.to_thread(self.engine.read_lora, lora)
        await self.call(lambda: self.engine.add_lora(lora, adapter))

    async def remove_lora(self, name: str) -> bool:
        """Unload an adapter (its requests in flight finish with it); False if unknown."""
        return await self.call(lambda: self.engine.remove_lora(name))

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ones are ignored); thread-safe, returns at once."""
        if not isinstance(request_id, str):  # the engine thread takes any other command for an add
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        self._abort_ids([request_id])

    def abort_streams(self, streams: list[RequestStream]) -> None:
        """`RequestStream.abort` for many at once, as one command batch (a client with
        thousands of sequences that goes away takes one lock, not thousands)."""
        self._forget(*streams)
        self._abort_ids([stream.request_id for stream in streams if stream._close()])

    def _abort_ids(self, request_ids: list[str]) -> None:
        with self._cond:
            if self._error is None and request_ids:
                self._commands += request_ids
                self._cond.notify()

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Accept nothing new, let running requests finish for up to `grace_s`, abort the rest
        (their streams raise EngineStoppedError) and stop the thread. Returns by the deadline
        plus a few seconds whatever the thread does: a thread still busy then (a stuck step)
        is left behind (it is a daemon) and its requests are failed from here."""
        stop_at = self.begin_shutdown(grace_s)
        timeout = max(0.0, stop_at - time.monotonic()) + _STOP_MARGIN_S
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %.1f s of the shutdown deadline "
                      "(a step is stuck); failing its requests and leaving it behind",
                      _STOP_MARGIN_S)
            self.fail_live(EngineStoppedError("the engine shut down before the request finished"))

    def begin_shutdown(self, grace_s: float = 0.0) -> float:
        """`shutdown` without waiting for the thread (any thread; a signal handler may call
        it). A shutdown already begun keeps its deadline, which is returned."""
        with self._cond:
            if self._stop_at is None:
                self._stop_at = time.monotonic() + grace_s
            self._cond.notify()
            return self._stop_at

    @property
    def thread_alive(self) -> bool:
        """Whether the engine thread still runs (after a shutdown: it is stuck)."""
        return self._thread.is_alive()

    def fail_live(self, error: BaseException) -> None:
        """Fail every request added and not yet ended, from the callers' side (any thread):
        what a shutdown does when the engine thread is stuck and would never answer them."""
        with self._live_lock:
            live, self._live = list(self._live.values()), {}
        now = time.monotonic()
        for add in live:
            self._reply(add, error)
            _hand_over(add.stream.loop, [(add.stream, error)], now)

    def _forget(self, *streams: RequestStream) -> None:
        """The streams ended (or were never queued): not live any more."""
        with self._live_lock:
            for stream in streams:
                add = self._live.get(stream.request_id)
                if add is not None and add.stream is stream:
                    del self._live[stream.request_id]

    def _send(self, *commands: _Add) -> None:
        with self._cond:
            if self._error is not None:
                raise EngineDeadError(f"the engine is dead: {self._error!r}")
            if self._stop_at is not None:
                raise EngineStoppedError("the engine is shutting down")
            if self._idle:  # it wakes now: the stall clock starts with this work
                self._heartbeat = time.monotonic()
            self._commands.append(commands)
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as error:  # the engine is unusable: fail everyone, loudly
            log.exception("engine thread died")
            self._die(error)

    def _iterate(self) -> bool:
        """Apply commands, expire timeouts, run one step; False when shut down."""
        engine = self.engine
        with self._cond:
            while not (self._commands or engine.has_unfinished_requests()
                       or self._stop_at is not None):
                self._idle = True
                self._cond.wait()
            self._idle = False
            taken = _commands_within(self._commands, _COMMANDS_PER_ITERATION)
            commands, self._commands = self._commands[:taken], self._commands[taken:]
            self._working = bool(commands)
            stop_at = self._stop_at
        for i, command in enumerate(commands):
            if isinstance(command, str):
                self.engine.abort(command)
                self._streams.pop(command, None)
                continue
            if isinstance(command, _Call):
                try:
                    command.resolve(command.fn())
                except Exception as error:  # its caller's to answer (a bad adapter)
                    command.resolve(error=error)
                continue
            for j, add in enumerate(command):
                try:
                    self._add(add)
                except BaseException:  # the engine dies: the commands not applied get its answer
                    with self._cond:
                        self._commands[:0] = [command[j:], *commands[i + 1:]]
                    raise
        now = time.monotonic()
        self._expire(now)
        if stop_at is not None and (now >= stop_at or not engine.has_unfinished_requests()):
            self._abort_all(EngineStoppedError("the engine shut down before the request finished"))
            self._stats = engine.stats()
            return False
        if engine.has_unfinished_requests():
            steps_before = engine.num_steps
            self._publish(engine.step())
            if getattr(engine, "failed", None):  # a replica on other processes was lost:
                self._fail_lost(engine.failed)  # its requests alone
                engine.failed = []
            if self.on_iteration is not None and engine.last_step_tokens is not None:
                self.on_iteration(engine.last_step_tokens)
            if engine.num_steps == steps_before and engine.has_unfinished_requests():
                with self._cond:  # nothing could be dispatched (pages, window): don't spin
                    if not self._commands:
                        self._cond.wait(_IDLE_POLL_S)
        self._stats = engine.stats()
        self._heartbeat = time.monotonic()
        self._working = False
        return True

    def _add(self, command: _Add) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self._num_waiting_for_a_slot() >= limit:
            self._reply(command, QueueFullError(
                f"the waiting queue is full ({limit} requests wait); retry later"))
            return
        try:
            adapter = {} if command.lora_request is None else {
                "lora_request": command.lora_request}
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    command.arrival_time, **adapter)
        except Exception as error:  # bad input (ValueError), or a bug: this request's alone
            self._reply(command, error)
            return
        self._streams[command.request_id] = command.stream
        if self.request_timeout_s is not None:
            heapq.heappush(self._deadlines, (command.arrival_time + self.request_timeout_s,
                                             next(self._deadline_ids), command.stream))
        self._reply(command, None)

    def _num_waiting_for_a_slot(self) -> int:
        """Waiting requests the free slots will not take in the next iteration."""
        return self.engine.num_waiting_for_a_slot()

    def _expire(self, now: float) -> None:
        """Time out requests past their deadline: O(1) per iteration while none is due (the
        deadlines of requests that ended are dropped as they come up)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, stream = heapq.heappop(self._deadlines)
            if self._streams.get(stream.request_id) is not stream:  # ended already
                continue
            del self._streams[stream.request_id]
            self.engine.abort(stream.request_id)
            _hand_over(stream.loop, [(stream, RequestTimeoutError(
                f"request exceeded request_timeout_s ({self.request_timeout_s} s) and was "
                "aborted"))], now)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            else:  # a cumulative output's lists are the request's own, which this thread
                for completion in output.outputs:  # goes on appending to: hand over copies
                    completion.token_ids = list(completion.token_ids)
                    if completion.logprobs is not None:
                        completion.logprobs = list(completion.logprobs)
            by_loop[stream.loop].append((stream, output))
        for loop, items in by_loop.items():
            _hand_over(loop, items, now)

    def _fail_lost(self, failed: list[tuple[str, BaseException]]) -> None:
        now = time.monotonic()
        for request_id, error in failed:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _hand_over(stream.loop, [(stream, EngineDeadError(str(error)))], now)

    def _abort_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        while self.engine.has_unfinished_requests():  # collect the step still in flight
            self.engine.step()
        self._fail_streams(error)

    def _fail_streams(self, error: BaseException) -> None:
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream in self._streams.values():
            by_loop[stream.loop].append((stream, error))
        self._streams.clear()
        self._deadlines.clear()
        with self._live_lock:
            self._live.clear()
        for loop, items in by_loop.items():
            _hand_over(loop, items, now)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            commands, self._commands = self._commands, []
        dead = EngineDeadError(f"the engine is dead: {error!r}")
        for command in commands:
            if isinstance(command, tuple):
                for add in command:
                    self._reply(add, dead)
            elif isinstance(command, _Call):
                command.resolve(error=dead)
        self._fail_streams(dead)
        self._stats = self._stats | {"num_requests_running": 0, "num_requests_waiting": 0,
                                     "kv_cache_usage": 0.0}
        if self.on_death is not None:
            self.on_death(error)

    @staticmethod
    def _reply(command: _Add, error: BaseException | None) -> None:
        def resolve():
            if not command.ack.done():  # the caller may have been cancelled meanwhile
                if error is None:
                    command.ack.set_result(None)
                else:
                    command.ack.set_exception(error)

        _call_soon(command.stream.loop, resolve)


def _commands_within(commands: list[tuple | str | _Call], budget: int) -> int:
    """How many of `commands` (from the front) to apply before the next step: at least one, and
    no more than `budget` adds and aborts in all, unless the first alone is more."""
    total = 0
    for i, command in enumerate(commands):
        total += 1 if isinstance(command, str | _Call) else len(command)
        if total > budget:
            return max(i, 1)
    return len(commands)


def _hand_over(loop: asyncio.AbstractEventLoop, items: list, now: float) -> None:
    def deliver():
        for stream, item in items:
            stream._push(item, now)

    _call_soon(loop, deliver)


def _call_soon(loop: asyncio.AbstractEventLoop, callback) -> None:
    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
        loop.call_soon_threadsafe(callback)
