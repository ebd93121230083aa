"""The engine loop, once: the engine, the simulator and the tests' fake all step through it.

    schedule -> dispatch this iteration -> read the previous one -> scheduler.update

A runner is anything with `dispatch(out) -> handle` (start the iteration's device work and
return at once) and `collect(handle) -> {request id: samples}` (wait for it; each samples
object is a `Samples`, or anything with its `.tokens`: the ids the request sampled). With `overlap`, an iteration is read one
step later, while the device already runs the next one (the host never stalls the device);
without it, at once. Host only: no jax here.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.request import Request


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled (or prompt) token's logprob and rank, and the top-K ids and logprobs."""

    logprob: float
    rank: int
    top_ids: np.ndarray  # [K] int32
    top_logprobs: np.ndarray  # [K] float32


@dataclass
class Samples:
    """What one request got from one iteration."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None  # when the request asked for logprobs
    prompt_start: int = 0  # prompt_logprobs[j] is for the prompt token at prompt_start + 1 + j
    prompt_logprobs: list[TokenLogprobs] | None = None


class Runner(Protocol):
    def dispatch(self, out: SchedulerOutput) -> Any: ...

    def collect(self, handle: Any) -> Mapping[str, Samples]: ...


@dataclass
class Step:
    """One pass of the loop: what it dispatched, and the iteration it read (if any)."""

    scheduled: SchedulerOutput  # no chunks: nothing was dispatched
    done: SchedulerOutput | None = None  # the iteration whose results were read
    results: Mapping[str, Samples] = field(default_factory=dict)  # by request id
    touched: list[Request] = field(default_factory=list)  # requests update() advanced
    # done's prompt tokens (of requests it gave their first token) plus the tokens it
    # generated: what vLLM's iteration_tokens_total counts per step
    num_tokens: int = 0


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, overlap: bool = True):
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.inflight: tuple[SchedulerOutput, Any] | None = None  # dispatched, not yet read
        self.num_steps = 0  # iterations dispatched
        # called with each iteration's schedule before it is dispatched (the tests' log)
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.inflight is not None

    def step(self) -> Step:
        out = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(out)
        flight = (out, self.runner.dispatch(out)) if out.chunks else None
        if flight is not None:
            self.num_steps += 1
        if self.overlap:
            previous, self.inflight = self.inflight, flight
        else:
            previous = flight
        if previous is None:
            return Step(out)
        done, handle = previous
        results = self.runner.collect(handle)
        before = [len(chunk.request.output_ids) for chunk in done.chunks]
        touched = self.scheduler.update(
            done, {rid: samples.tokens for rid, samples in results.items()})
        num_tokens = sum(
            len(chunk.request.output_ids) - n
            + (len(chunk.request.prompt_ids) if n == 0 and chunk.request.output_ids else 0)
            for chunk, n in zip(done.chunks, before, strict=True))
        return Step(out, done, results, touched, num_tokens)
