"""A discrete-event simulator: the real Scheduler, KVCacheManager and policies on a virtual clock.

It runs the engine's own loop (`EngineCore`, with its overlap: iteration t+1 is scheduled and
dispatched before iteration t's tokens are read) on a simulated device that runs iterations back
to back:

    step:  arrivals <= now join | schedule() | dispatch: done = max(now, device_free) + cost
           | read the previous iteration: now = max(now, its done) | update() at now

The cost of an iteration comes from a fitted `StepCostModel`: its wake factors for the first
iterations after the engine sat idle (and its wake-up term for the first), at a quantile of the
fit's spread drawn per iteration by a generator seeded with `seed`, consecutive draws
correlated as the fit measured (a run is reproducible; runs over several seeds give the
expected metrics, as `calibrate.validate` reports them). A request
produces exactly its spec's output_len tokens (ignore_eos), so outputs need no model; sampled
tokens are zeros.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.policies import Policy
from jaxserve.core.scheduler import Scheduler, make_scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.engine.loop import EngineCore
from jaxserve.request import Request, Samples, SamplingParams
from jaxserve.sim.cost_model import StepCostModel, correlated_draws
from jaxserve.sim.metrics import RequestRecord, compute_metrics
from jaxserve.sim.workload import RequestSpec


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Timeline:
    """Per-iteration samples (at the time each iteration was scheduled)."""

    time: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)  # cumulative
    batched_tokens: list[int] = field(default_factory=list)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration: float  # virtual seconds from the start to the last token
    timeline: Timeline
    num_steps: int
    num_preemptions: int
    kv_pages_free_at_end: int
    kv_pages_total: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found there

    def metrics(self, slos_ms: dict[str, float] | None = None, label: str | None = None) -> dict:
        """vllm bench serve metrics, over every request or one label's; plus preemptions."""
        records = [r for r in self.records if label is None or r.label == label]
        return compute_metrics(records, self.duration, slos_ms) | {
            "num_preemptions": self.num_preemptions, "num_steps": self.num_steps}


def synthetic_prompt(spec: RequestSpec, index: int) -> list[int]:
    """The trace's ids, else prompt_len ids of the request's own: its first token is its index
    (past the special ids), so no two synthetic prompts share a page and the prefix cache finds
    nothing (a trace with prompt_ids shares what its prompts share)."""
    if spec.prompt_ids is not None:
        return list(spec.prompt_ids)
    return [3 + index] + [3] * (spec.prompt_len - 1)


class Simulator:
    """Runs workloads through a scheduler built from an EngineConfig, as the engine builds it."""

    def __init__(self, config: EngineConfig, cost: StepCostModel, num_pages: int,
                 max_model_len: int, policy: Policy | None = None,
                 on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
                 seed: int = 0):
        self.config = config
        self.seed = seed
        self.cost = cost
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.policy = policy  # overrides config.policy (e.g. an sjf with a custom predictor)
        self.on_step = on_step

    def make_scheduler(self, clock: VirtualClock) -> Scheduler:
        chunk = self.config.chunk_buckets(self.max_model_len)[-1]
        scheduler = make_scheduler(self.config, self.num_pages, chunk, clock=clock)
        if self.policy is not None:
            scheduler.policy = self.policy
        return scheduler

    def run(self, specs: list[RequestSpec]) -> SimResult:
        clock = VirtualClock()
        s = self.make_scheduler(clock)
        device = _Device(self, s, clock)
        core = EngineCore(s, device)  # the engine's own loop, on the simulated device
        specs = sorted(specs, key=lambda x: x.arrival)
        records: dict[str, RequestRecord] = {}
        seen: dict[str, int] = {}
        nxt, last_token = 0, 0.0
        while nxt < len(specs) or core.has_unfinished_requests():
            while nxt < len(specs) and specs[nxt].arrival <= clock.now:
                self._add(s, str(nxt), specs[nxt], records, seen)
                nxt += 1
            step = core.step()
            if step.done is None:
                if not step.scheduled.chunks:  # idle: sleep until an arrival or the window opens
                    device.idle = True
                    wake = [t for t in (s.next_wakeup(),
                                        specs[nxt].arrival if nxt < len(specs) else None)
                            if t is not None and t > clock.now]
                    if not wake:
                        if s.has_unfinished_requests():
                            raise RuntimeError("the scheduler holds requests it never schedules")
                        break
                    clock.now = min(wake)
                continue
            for request in step.touched:  # read at the iteration's end (collect moved the clock)
                rid = request.request_id
                n = len(request.output_ids)
                records[rid].deliver(clock.now, n - seen[rid])
                seen[rid] = n
                last_token = clock.now
        timeline, num_steps = device.timeline, core.num_steps
        return SimResult(list(records.values()), last_token, timeline, num_steps,
                         s.num_preemptions, s.kv.pool.num_free, s.kv.pool.num_usable,
                         s.kv.queries, s.kv.hits)

    def _add(self, s: Scheduler, rid: str, spec: RequestSpec,
             records: dict[str, RequestRecord], seen: dict[str, int]) -> None:
        params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True,
                                priority=spec.priority, slo_ms=spec.slo_ms)
        prompt = synthetic_prompt(spec, len(records))
        if len(prompt) + spec.output_len > self.max_model_len:  # the engine refuses it too
            raise ValueError(f"request {rid} (arrival {spec.arrival:g} s): prompt {len(prompt)} "
                             f"+ output {spec.output_len} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        max_len = len(prompt) + spec.output_len
        s.add_request(Request(rid, prompt, params, spec.arrival, seed=0, max_len=max_len,
                              eos_token_ids=frozenset()))
        records[rid] = RequestRecord(spec.arrival, spec.prompt_len, spec.label, spec.slo_ms)
        seen[rid] = 0


class _Device:
    """The runner `EngineCore` drives in a simulation: an iteration dispatched at `now` is done
    at max(now, the device's previous done) + its drawn cost (plus the wake-up after an idle
    spell); reading it moves the virtual clock there. Sampled tokens are zeros."""

    def __init__(self, sim: Simulator, scheduler: Scheduler, clock: VirtualClock):
        self.sim, self.scheduler, self.clock = sim, scheduler, clock
        self.timeline = Timeline()
        self.idle, self.since_wake, self.free_at = True, 0, 0.0
        self._rng = np.random.default_rng(sim.seed)
        cost = sim.cost
        self._state = self._rng.standard_normal() if cost.noise_share > 0 else 0.0
        self._draws, self._drawn = self._more_draws(), 0

    def _more_draws(self) -> np.ndarray:
        cost = self.sim.cost
        if cost.noise_share <= 0:
            return self._rng.random(4096)
        u, self._state = correlated_draws(self._rng, cost.noise_share, cost.noise_memory, 4096,
                                          self._state)
        return u

    def dispatch(self, out: SchedulerOutput) -> tuple[SchedulerOutput, float]:
        if self._drawn == len(self._draws):
            self._draws, self._drawn = self._more_draws(), 0
        self.since_wake = 0 if self.idle else self.since_wake + 1
        now = self.clock.now
        done = max(now, self.free_at) + self.sim.cost.cost(out, self._draws[self._drawn],
                                                           self.since_wake)
        self._drawn += 1
        if self.idle:
            done += self.sim.cost.idle_wakeup
            self.idle = False
        self.free_at = done
        s, t = self.scheduler, self.timeline
        t.time.append(now)
        t.kv_usage.append(s.kv.usage)
        t.running.append(len(s.running))
        t.waiting.append(len(s.waiting))
        t.preemptions.append(s.num_preemptions)
        t.batched_tokens.append(out.num_batched_tokens)
        if self.sim.on_step is not None:
            self.sim.on_step(s, out)
        return out, done

    def finish(self, flight: tuple[SchedulerOutput, float]) -> None:
        pass  # the simulated step has no controlled samples

    def collect(self, flight: tuple[SchedulerOutput, float]) -> dict[str, Samples]:
        out, done = flight
        self.clock.now = max(self.clock.now, done)
        return {c.request.request_id: Samples([0] * c.num_samples) for c in out.chunks
                if c.num_samples}
