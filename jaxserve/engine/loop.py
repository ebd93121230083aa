"""The engine loop, once: the engine, the simulator and the tests' fake all step through it.

    schedule -> dispatch this iteration -> read the previous one -> feed its tokens to the
    token masks -> finish this iteration (the samples that needed those tokens) ->
    OutputProcessor.update (the tokens kept, every stop, finished requests)

A runner (`Runner`) is what the loop and `LLMEngine` drive: `dispatch(out) -> handle` starts
the iteration's device work and returns at once, `collect(handle) -> {request id: Samples}`
waits for it. With `overlap`, an iteration is read one step later, while the device already
runs the next one (the host never stalls the device); without it, at once. `finish(handle)`
dispatches what of an iteration had to wait until the host held every earlier token (the rows
whose next-token masks follow from them: structured output, bad words, min_tokens): the device
runs the iteration's model meanwhile.

An iteration that verifies proposals (speculative decoding) is read at once, never overlapped:
its rows' next proposals need every token it kept. When the scheduler wants to speculate while
an iteration is in flight, the step only reads that one. Host only: no jax here.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.engine.outputs import OutputProcessor
from jaxserve.request import Request, Samples


class Runner(Protocol):
    """What LLMEngine needs of a runner (JetStream's engine API, vLLM's executor): the model
    runner and the tests' fake implement it. The loop itself (EngineCore) calls only dispatch
    and collect, all the simulator's device has."""

    num_pages: int  # KV pages, the null page 0 included
    max_model_len: int  # prompt + output tokens a request may reach
    chunk_buckets: tuple[int, ...]  # the prompt chunk lengths a step takes, ascending
    num_compilations_after_warmup: int  # each one is a bug

    def warmup(self, progress: bool = False) -> float:
        """Prepare every step shape; returns the seconds it took."""
        ...

    def dispatch(self, out: SchedulerOutput) -> Any:
        """Start the iteration's device work; return at once with a handle to collect."""
        ...

    def finish(self, handle: Any) -> None:
        """Dispatch the rest of an iteration, once every token sampled before it was read."""
        ...

    def collect(self, handle: Any) -> Mapping[str, Samples]:
        """Wait for a dispatched iteration: by request id, what each sampling row got."""
        ...


# Runner's members, which LLMEngine checks a runner has (typing names them only from 3.13 on)
RUNNER_MEMBERS = ("num_pages", "max_model_len", "chunk_buckets", "num_compilations_after_warmup",
                  "warmup", "dispatch", "finish", "collect")


@dataclass
class Step:
    """One pass of the loop: what it dispatched, and the iteration it read (if any)."""

    scheduled: SchedulerOutput  # no chunks: nothing was dispatched
    done: SchedulerOutput | None = None  # the iteration whose results were read
    touched: list[Request] = field(default_factory=list)  # requests given tokens
    # done's prompt tokens (of requests it gave their first token) plus the tokens it
    # generated: what vLLM's iteration_tokens_total counts per step
    num_tokens: int = 0


class EngineCore:
    """`processor`: the stops and text of requests (default: token stops only, no text)."""

    def __init__(self, scheduler: Scheduler, runner: Runner, overlap: bool = True,
                 processor: OutputProcessor | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.processor = OutputProcessor() if processor is None else processor
        self.inflight: tuple[SchedulerOutput, Any] | None = None  # dispatched, not yet read
        self.num_steps = 0  # iterations dispatched
        # called with each iteration's schedule before it is dispatched (the tests' log)
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.inflight is not None

    def step(self) -> Step:
        if self.inflight is not None and self.scheduler.speculates():
            (done, handle), self.inflight = self.inflight, None
            return self._read(Step(SchedulerOutput()), done, handle)
        out = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(out)
        flight = (out, self.runner.dispatch(out)) if out.chunks else None
        if flight is not None:
            self.num_steps += 1
        if self.overlap and not out.speculative:
            previous, self.inflight = self.inflight, flight
            if previous is None:
                if flight is not None:
                    self.runner.finish(flight[1])
                return Step(out)
            return self._read(Step(out), *previous, flight)
        if flight is None:  # (a speculative iteration is dispatched with nothing in flight)
            return Step(out)
        self.runner.finish(flight[1])
        return self._read(Step(out), *flight)

    def _read(self, step: Step, done: SchedulerOutput, handle: Any,
              flight: tuple[SchedulerOutput, Any] | None = None) -> Step:
        """Read the iteration `done` into `step`: the scheduler's and the outputs' updates.
        `flight`: the overlapped iteration dispatched after it, finished once done is read."""
        results = self.runner.collect(handle)
        # its samples are pending no more; verification rows keep the tokens they got
        sampled = {c.request.request_id: len(results[c.request.request_id].tokens)
                   for c in done.chunks if c.draft is not None
                   and c.request.request_id in results} if done.speculative else None
        self.scheduler.update(done, sampled)
        self.processor.feed_masks(done, results)
        if flight is not None:  # every earlier token is read now: the device samples while
            self.runner.finish(flight[1])  # the host makes the outputs
        step.done = done
        step.touched, step.num_tokens = self.processor.update(self.scheduler, done, results)
        return step
