"""What the scheduler hands the runner each iteration: plain data, the rows of a step
(`ScheduledChunk`: a request, where its tokens start, how many it feeds and samples) and the
iteration's settings (`SchedulerOutput`). The runner, the simulator's cost model and the
processes that replay a leader's calls read it; only the scheduler makes it."""

from dataclasses import dataclass, field

from jaxserve.request import Request


@dataclass(slots=True)  # not frozen: a frozen dataclass costs 3x as much to build, per row per step
class ScheduledChunk:
    """One request's row in a step: `num_tokens` fed from position `start`."""

    request: Request
    start: int
    num_tokens: int
    num_samples: int  # tokens the row samples: 0 mid-prompt, else 1 (or decode_steps)
    # a verification row: the proposed tokens fed after its newest one (maybe none); it
    # samples up to num_samples = 1 + len(draft). None: not one
    draft: list[int] | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    decode_steps: int = 1  # decode rows run this many steps in one dispatch
    # static/dynamic: the running batch's size. A batch that runs to completion keeps its shape
    # (finished rows are padding until the last one ends), as a static batcher's fixed-shape
    # batch does: the runner pads decode rows to at least this many.
    batch_rows: int = 0
    preempted: list[Request] = field(default_factory=list)
    # proposals are verified this iteration (Scheduler.speculates): its rows with a draft
    # must be read before the next iteration is scheduled
    speculative: bool = False
    # every chunk is a one-token decode row (most iterations): the runner need not sort them
    decode_only: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
