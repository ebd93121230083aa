"""Load on an in-process engine, as a serving client would offer it: arrivals at a request rate
(Poisson or gamma, as `--burstiness`), at most `max_concurrency` requests in flight (a closed
loop: the next request goes in as one finishes), timestamps per token delivery.

A request's clock starts at its send time (as vLLM's client starts it when the request is sent):
its arrival time, or when a concurrency slot freed for it if that came later, so time spent
waiting for a slot is not TTFT, and time spent waiting for the engine's step in progress is.
Send times are `bench serve`'s (vLLM's): scaled so the last goes out at n / rate.

Sweeps reuse one engine (one compile) and swap its scheduler between runs: `use_scheduler`
accepts the options that only the scheduler reads, within the shapes the runner compiled.
"""

import dataclasses
import heapq
import time

from jaxserve.benchmarks.datasets import Sample
from jaxserve.benchmarks.serve import serve_arrivals
from jaxserve.config.engine import EngineConfig
from jaxserve.core.scheduler import make_scheduler
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.request import SamplingParams
from jaxserve.sim.metrics import RequestRecord

# options the scheduler alone reads; the two limits may shrink (the runner's shapes cover less)
SCHEDULER_OPTIONS = frozenset({
    "batching", "policy", "window_ms", "adaptive_window", "window_ms_min", "window_ms_max",
    "slo_ms", "sjf_predictor", "length_bucketing", "min_batch_size", "max_batch_size",
    "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"})


def use_scheduler(engine: LLMEngine, **options) -> EngineConfig:
    """Give an idle engine a fresh scheduler built from its config with `options` changed."""
    unknown = sorted(set(options) - SCHEDULER_OPTIONS)
    if unknown:
        raise ValueError(f"{unknown} change compiled shapes or weights: build a new engine")
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests; finish them before a new scheduler")
    base = engine.config
    config = dataclasses.replace(base, **options)
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(config, name) > getattr(base, name):
            raise ValueError(f"{name} {getattr(config, name)} exceeds the engine's "
                             f"{getattr(base, name)}, which its compiled shapes cover")
    engine.scheduler = make_scheduler(config, engine.runner.num_pages,
                                      engine.runner.chunk_buckets[-1],
                                      sliding_window=engine.sliding_window)
    return config


@dataclasses.dataclass
class OfflineRun:
    records: list[RequestRecord]
    errors: list[str | None]
    duration: float  # from the start to the last token
    token_ids: list[list[int]]


def run_load(engine: LLMEngine, samples: list[Sample], *, request_rate: float = float("inf"),
             burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
             temperature: float = 0.0, progress: bool = False,
             lora_requests: list | None = None) -> OfflineRun:
    """Play `samples` on the engine in real time (ignore_eos: each gets its output_len).
    `lora_requests`: each sample's LoRA adapter (None: the base model)."""
    from tqdm import tqdm

    n = len(samples)
    arrivals = serve_arrivals(n, request_rate, burstiness, seed)
    records = [RequestRecord(0.0, s.prompt_len) for s in samples]
    errors: list[str | None] = [None] * n
    token_ids: list[list[int]] = [[] for _ in samples]
    seen = [0] * n
    limit = max_concurrency or n
    slots = [0.0] * min(limit, n)  # when each free concurrency slot freed (a heap)
    nxt = in_flight = 0
    last = 0.0
    bar = tqdm(total=n, desc="requests", disable=not progress)
    start = time.monotonic()  # the scheduler's clock
    while nxt < n or in_flight:
        now = time.monotonic() - start
        while nxt < n and arrivals[nxt] <= now and in_flight < limit:
            sample = samples[nxt]
            params = SamplingParams(max_tokens=sample.output_len, temperature=temperature,
                                    ignore_eos=True, seed=seed + nxt)
            # sent at its time or when its slot freed: waiting for the engine's step in
            # progress (the loop adds requests between steps) counts, as a server's queue does
            freed = heapq.heappop(slots)
            sent = max(float(arrivals[nxt]), freed)
            records[nxt].arrival = sent
            try:
                adapter = {} if lora_requests is None else {"lora_request": lora_requests[nxt]}
                request = engine.add_request(str(nxt), sample.engine_prompt, params,
                                             arrival_time=start + sent, **adapter)
                records[nxt].prompt_len = len(request.prompt_ids)
                in_flight += 1
            except ValueError as err:
                errors[nxt] = str(err)
                heapq.heappush(slots, freed)
                bar.update(1)
            nxt += 1
        next_arrival = arrivals[nxt] if nxt < n and in_flight < limit else float("inf")
        if not in_flight or _window_holds(engine, start + now):
            wake = engine.scheduler.next_wakeup()
            until = min(next_arrival, now + 1.0, float("inf") if wake is None else wake - start)
            time.sleep(max(0.0, until - (time.monotonic() - start)))
            continue
        outputs = engine.step()
        now = time.monotonic() - start
        for output in outputs:
            i = int(output.request_id)
            ids = output.outputs[0].token_ids
            records[i].deliver(now, len(ids) - seen[i])
            seen[i] = len(ids)
            last = now
            if output.finished:
                token_ids[i] = list(ids)
                in_flight -= 1
                heapq.heappush(slots, now)
                bar.update(1)
    while engine.has_unfinished_requests():  # an iteration still in flight holds no tokens
        engine.step()
    bar.close()
    return OfflineRun(records, errors, last, token_ids)


def _window_holds(engine: LLMEngine, now: float) -> bool:
    """Whether the batching window keeps every waiting request out and nothing runs (then
    `engine.step()` would sleep, and arrivals meanwhile would be late)."""
    scheduler = engine.scheduler
    wake = scheduler.next_wakeup()
    return (wake is not None and wake > now
            and len(scheduler.waiting) < scheduler.window.max_batch_size)


def warm_up(engine: LLMEngine, samples: list[Sample], num: int = 4) -> None:
    """A few short requests through the whole host path before anything is timed."""
    short = [Sample(s.prompt, s.prompt_len, min(s.output_len, 4)) for s in samples[:num]]
    run_load(engine, short)
