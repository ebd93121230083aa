"""Calibrate the simulator against the real engine on this device, and check it.

    profile_runner   time the real runner over decode rows x prefill tokens x context, pipelined
                     as the engine runs it (iteration t+1 dispatched before t is read)
    calibrate        profile, fit the StepCostModel, save it (the simulator reuses it)
    run_on_engine    play a workload on the real engine, offline, arrival times honoured
    validate         the same workload on the engine and in the simulator: relative errors

This module is the bridge (it imports the engine); `jaxserve.sim` stays host-only.
"""

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.buckets import prefill_shapes
from jaxserve.core.page_pool import PagePool
from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.engine.llm_engine import LLMEngine, freeze_gc
from jaxserve.request import Request, SamplingParams
from jaxserve.sim.cost_model import (
    WAKE_STEPS,
    StepCostModel,
    cost_settings,
    default_fit_path,
    fit_noise_memory,
    normal_scores,
    spread_quantiles,
    step_shape,
)
from jaxserve.sim.metrics import RequestRecord, compute_metrics, idle_arrivals
from jaxserve.sim.simulator import Simulator
from jaxserve.sim.workload import RequestSpec, synthetic

VALIDATED = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "output_throughput")


def _row(pool: PagePool, page_size: int, rid: str, start: int, num_tokens: int,
         num_samples: int) -> ScheduledChunk:
    """A running request positioned so that its row feeds [start, start + num_tokens)."""
    length = start + num_tokens
    request = Request(rid, [3] * length, SamplingParams(max_tokens=64, temperature=0.0),
                      0.0, seed=0, max_len=length + 64, eos_token_ids=frozenset())
    request.num_computed_tokens = start
    request.pages = pool.allocate(-(-(start + max(num_tokens, num_samples)) // page_size)) or []
    if not request.pages:
        raise ValueError("the KV cache is too small to profile this shape")
    return ScheduledChunk(request, start, num_tokens, num_samples)


def time_iteration(engine: LLMEngine, out: SchedulerOutput,
                   budget_s: float = 0.1) -> float:
    """Seconds per iteration with one iteration in flight, as the engine runs (about budget_s
    of iterations, at least 2)."""
    runner = engine.runner
    start = time.perf_counter()
    runner.collect(runner.dispatch(out))  # warm
    reps = int(min(16, max(2, budget_s / (time.perf_counter() - start))))
    start = time.perf_counter()
    flight = runner.dispatch(out)
    for _ in range(reps - 1):
        nxt = runner.dispatch(out)
        runner.collect(flight)
        flight = nxt
    runner.collect(flight)
    return (time.perf_counter() - start) / reps


def profile_shapes(engine: LLMEngine) -> list[tuple[int, int, int, int, int]]:
    """(decode rows, decode context, decode steps, prefill rows, prefill chunk) to time; the
    prefill rows start at context 0 or half the model length."""
    config, runner = engine.config, engine.runner
    max_len = runner.max_model_len
    steps = sorted({1, config.decode_steps})
    contexts = sorted({16, max_len // 4, max_len // 2, max_len - 2 * max(steps) - 1})
    rows = sorted({min(b, config.max_num_seqs) for b in runner.row_buckets})
    shapes = [(b, ctx, k, 0, 0) for b in rows for ctx in contexts for k in steps]
    for b, c in prefill_shapes(runner.chunk_buckets, runner.prefill_row_buckets,
                               config.max_num_batched_tokens):
        for ctx in (0, max_len // 2):
            if ctx + c <= max_len:
                shapes.append((0, ctx, 1, min(b, config.max_num_seqs), c))
    for b in (1, max(1, config.max_num_seqs // 2)):  # decode and prefill in one iteration
        for c in runner.chunk_buckets[:2]:
            if b < config.max_num_seqs:
                shapes.append((b, max_len // 4, 1, 1, c))
    return shapes


def profile_output(engine: LLMEngine,
                   shape: tuple[int, int, int, int, int]) -> SchedulerOutput:
    num_decode, ctx, k, num_prefill, chunk = shape
    page_size, budget = engine.config.page_size, engine.config.max_num_batched_tokens
    pool = PagePool(engine.runner.num_pages)
    out = SchedulerOutput(decode_steps=k)
    for i in range(num_decode):
        out.chunks.append(_row(pool, page_size, f"d{i}", ctx, 1, k))
    # every chunk in the chunk's bucket, so the runner makes them one call (the budget may be
    # exceeded: the runner does not check it)
    buckets = engine.runner.chunk_buckets
    shortest = max([2] + [c + 1 for c in buckets if c < chunk])
    left = budget - num_decode
    for i in range(num_prefill):  # the first chunk is the longest; the rest share what is left
        # (no chunk past the budget, which the scheduler never cuts: nor can a ragged call run it)
        n = min(chunk, budget) if i == 0 else max(
            shortest, min(chunk, (left - chunk) // max(1, num_prefill - 1)))
        start = ctx if num_decode == 0 else 0
        out.chunks.append(_row(pool, page_size, f"p{i}", start, n, 1))
    return out


def profile_runner(engine: LLMEngine, passes: int = 3, progress: bool = False):
    """[(StepShape, seconds)] over the profile shapes: the median of `passes` passes, each in
    a fresh random order, so a burst of load on the machine hits one shape's sample at most."""
    from tqdm import tqdm

    runner = engine.runner
    outs = [profile_output(engine, shape) for shape in profile_shapes(engine)]
    times: list[list[float]] = [[] for _ in outs]
    rng = np.random.default_rng(0)
    with tqdm(total=passes * len(outs), desc="profiling", disable=not progress) as bar:
        for _ in range(passes):
            for i in rng.permutation(len(outs)):
                times[i].append(time_iteration(engine, outs[i]))
                bar.update(1)
    return [(step_shape(out, runner.row_buckets, runner.chunk_buckets,
                        bool(getattr(runner, "ragged", False))),
             float(np.median(t))) for out, t in zip(outs, times, strict=True)]


def calibrate(model: str, config: EngineConfig, path: str | Path | None = None,
              engine: LLMEngine | None = None, progress: bool = True,
              open_loop_requests: int = 96, freeze: bool = False,
              between: Callable[[int], None] | None = None, rounds: int = 1) -> StepCostModel:
    """Profile the runner on this device, fit the cost model, save it (default: the cache).
    `open_loop_requests`: requests per open-loop rate in `measure_engine`. `freeze`: the
    process is the engine's, as a server's is: `freeze_gc` once the engine is warm.
    `rounds`, `between`: as in `measure_engine`."""
    if engine is None:
        engine = LLMEngine(model, config, progress=progress)
        if freeze:
            freeze_gc()
    samples = profile_runner(engine, progress=progress)
    device = jax.devices()[0]
    runner = engine.runner
    fit = StepCostModel.fit(samples, runner.row_buckets, runner.chunk_buckets, info={
        "model": str(model), "model_path": str(engine.model_path), "backend": runner.platform,
        "device": getattr(device, "device_kind", str(device)),
        "num_pages": runner.num_pages, "max_model_len": runner.max_model_len,
        "attention_impl": runner.attention_impl, "matmul_impl": runner.matmul_impl,
        "ragged": bool(getattr(runner, "ragged", False)),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "engine": cost_settings(config),
    })
    served_runs = measure_engine(engine, fit, open_loop_requests=open_loop_requests,
                                 between=between, rounds=rounds)
    fit.idle_wakeup = measure_wakeup(engine, fit, served_runs)
    fit.save(path or default_fit_path(model, config))
    return fit


def measure_engine(engine: LLMEngine, fit: StepCostModel, seed: int = 1,
                   min_steps: int = 20,
                   open_loop_rates: tuple[float, ...] = (4.0, 12.0, 24.0, 48.0),
                   open_loop_requests: int = 96,
                   between: Callable[[int], None] | None = None, rounds: int = 1,
                   ) -> list[tuple[list[RequestSpec], list[RequestRecord]]]:
    """Set the fit's engine factors from steps of the real engine: closed loops keeping 2, 4
    ... max_num_seqs requests in flight, then open loops (Poisson arrivals at a few rates, where
    the engine idles between requests as a server does, and runs slower for a while after).
    With one iteration in flight, the step that reads an iteration's tokens starts one period
    after the step before it: that period (the step and the loop around it, host work included:
    on a small model a period is mostly host time) is the iteration's cost. Decode-only steps
    give a factor per padded row count, from the open loops where they ran it at least
    min_steps times, else from all runs (0: all of them, for counts seen fewer times); the
    steps with prompt chunks then give the prefill factor. Ratios of sums: step times are
    heavy-tailed, and the simulator must match their sum. The first WAKE_STEPS iterations after
    the engine woke from idle run slower: they are left out of the factors and give the wake
    factors instead, one per kind (decode-only, with prompt chunks; a kind seen fewer than
    min_steps times takes the factor of all woke iterations). The open loops' iterations give
    the spreads, how each kind scatters around its predicted cost, steady and woke apart, and
    how consecutive iterations scatter together (`fit_noise_memory`).

    The open loops run in `rounds` rounds of open_loop_requests / rounds requests per rate, and
    `between(r)` (untimed) runs after round r: validation plays its trace there, so that the
    engine factors and the runs they are checked against sample the machine over the same
    minutes (this machine's speed drifts by 10-20% from one minute to the next)."""
    # (start, what the step dispatched, whether it left the engine with nothing to do)
    starts: list[tuple[float, SchedulerOutput | None, bool]] = []
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        flight = engine.core.inflight
        starts.append((start, None if flight is None else flight[0],
                       not engine.has_unfinished_requests()))
        return outputs

    engine.step = timed_step
    # (iteration, period, open loop, iterations since the engine last woke from idle, run,
    # the iteration's index in its run)
    periods: list[tuple[SchedulerOutput, float, bool, int, int, int]] = []
    num_runs = 0
    served_runs: list[tuple[list[RequestSpec], list[RequestRecord]]] = []

    def collect_periods(open_loop: bool):
        # a step that dispatched nothing may be followed by an idle wait: no period across it.
        # The engine woke when the step before left it with nothing to do and an open loop
        # then slept until the next arrival (as the simulator's idle); a closed loop never
        # sleeps, it only starts
        nonlocal num_runs
        since = 0
        for i in range(len(starts) - 2):
            (_, out, _), read, after = starts[i:i + 3]
            slept = i == 0 or (open_loop and starts[i - 1][2])
            since = 0 if slept else since + 1
            if out is not None and read[1] is not None:
                periods.append((out, after[0] - read[0], open_loop, since, num_runs, i))
        starts.clear()
        num_runs += 1

    try:
        for i, concurrency in enumerate(engine.runner.row_buckets):
            concurrency = min(concurrency, engine.config.max_num_seqs)
            specs = synthetic(2 * concurrency + 6, float("inf"), seed=seed + i, input_len=96,
                              output_len=64, max_model_len=engine.max_model_len)
            run_closed_loop(engine, specs, concurrency)
            collect_periods(False)
        rounds = max(1, rounds)
        per_round = -(-open_loop_requests // rounds)
        for r in range(rounds):
            for j, rate in enumerate(open_loop_rates):  # as served: arrivals, idle, wake-ups
                specs = synthetic(per_round, rate, seed=seed + 100 + j + len(open_loop_rates) * r,
                                  input_len=96, output_len=64, max_model_len=engine.max_model_len)
                served_runs.append((specs, run_on_engine(engine, specs)[0]))
                collect_periods(True)
            if between is not None:
                del engine.step
                try:
                    between(r)
                finally:
                    engine.step = timed_step
                starts.clear()
    finally:
        engine.__dict__.pop("step", None)
    rows, d, p, wall, served, since, run, index = [], [], [], [], [], [], [], []
    for out, t, open_loop, k, r, i in periods:
        shape = step_shape(out, fit.row_buckets, fit.chunk_buckets, fit.info.get("ragged", False))
        rows.append(shape.decode_rows)
        d.append(fit.parts(shape)[0])
        p.append(fit.parts(shape)[1])
        wall.append(t)
        served.append(open_loop)
        since.append(k)
        run.append(r)
        index.append(i)
    rows, d, p, wall, served, since, run, index = map(
        np.array, (rows, d, p, wall, served, since, run, index))
    steady = since >= WAKE_STEPS  # the first iterations after idle: the wake factor's

    def prefer_steady(kind: np.ndarray) -> np.ndarray:  # all of a kind if none ran steady
        return kind & steady if (kind & steady).any() else kind

    decode_only = prefer_steady((p == 0) & (d > 0))
    factors = {0: float(wall[decode_only].sum() / d[decode_only].sum())} if (
        decode_only.any()) else {}
    for b in np.unique(rows[decode_only]):
        pick = decode_only & (rows == b)
        if (pick & served).sum() >= min_steps:
            pick &= served
        if pick.sum() >= min_steps:
            factors[int(b)] = float(wall[pick].sum() / d[pick].sum())
    fit.decode_factor = factors
    rest = prefer_steady(p > 0)
    decode_part = np.array([fit.decode_factor_for(int(b)) for b in rows[rest]]) * d[rest]
    if rest.any():
        fit.prefill_factor = float(max(0.0, (wall[rest] - decode_part).sum()) / p[rest].sum())
    predicted = np.array([fit.decode_factor_for(int(b)) for b in rows]) * d + (
        fit.prefill_factor * p)
    woke = served & ~steady
    for name, kind in (("wake_factor", p == 0), ("wake_prefill_factor", p > 0)):
        pick = woke & kind if (woke & kind).sum() >= min_steps else woke
        if pick.sum() >= min_steps and predicted[pick].sum() > 0:
            setattr(fit, name, float(wall[pick].sum() / predicted[pick].sum()))
    # the scatter of served iterations: decode-only and with prompt chunks, steady and woke
    for name, kind in (("spread", p == 0), ("prefill_spread", p > 0)):
        pick = served & steady & kind
        setattr(fit, name, spread_quantiles(fit, rows[pick], d[pick], p[pick], wall[pick]))
        pick = woke & kind
        if pick.sum() >= min_steps:
            setattr(fit, "wake_" + name,
                    spread_quantiles(fit, rows[pick], d[pick], p[pick], wall[pick]))
    # how consecutive served iterations scatter together: normal scores of measured /
    # predicted within each of the four kinds, correlated across lags
    scores = np.zeros(len(wall))
    wake = np.array([fit.wake_prefill_factor if x > 0 else fit.wake_factor for x in p])
    ratio = wall / np.maximum(np.where(steady, 1.0, wake) * predicted, 1e-12)
    for group in (served & steady & (p == 0), served & steady & (p > 0),
                  served & ~steady & (p == 0), served & ~steady & (p > 0)):
        if group.sum() >= 2:
            scores[group] = normal_scores(ratio[group])
    fit.noise_share, fit.noise_memory = fit_noise_memory(scores[served], run[served],
                                                         index[served])
    return served_runs


def measure_wakeup(engine: LLMEngine, fit: StepCostModel,
                   served_runs: list[tuple[list[RequestSpec], list[RequestRecord]]],
                   sim_seeds: int = 4) -> float:
    """The wake-up term: what the simulator (this fit, wake factors and spreads included, no
    wake-up term) leaves unexplained of the time to first token of the requests that arrived at
    an idle engine, on the calibration's own open loops (`measure_engine`'s served runs:
    workloads and what the engine measured); the mean over those requests. Measured on served
    runs because that is how the simulator is used (lone requests added by hand and timed read
    about 4 ms here, where the simulator fell 1-1.5 ms short on served runs), and on the idle
    arrivals alone: at the loops' higher rates a small error in step cost compounds through
    the queue into tens of ms of TTFT, which is not a wake-up's (charged to the few idle
    arrivals there, it read 10-11 ms where the trace needed about 1 ms)."""
    no_wakeup = dataclasses.replace(fit, idle_wakeup=0.0)
    missing: list[float] = []
    for specs, records in served_runs:
        sims = [Simulator(engine.config, no_wakeup, engine.runner.num_pages, engine.max_model_len,
                          seed=s).run(specs).records for s in range(sim_seeds)]
        for i, (record, idle) in enumerate(zip(records, idle_arrivals(records), strict=True)):
            if idle:
                missing.append(record.ttft - float(np.mean([sim[i].ttft for sim in sims])))
    return float(max(0.0, np.mean(missing))) if missing else 0.0


def run_closed_loop(engine: LLMEngine, specs: list[RequestSpec], concurrency: int,
                    seed: int = 0) -> None:
    """Keep `concurrency` requests in the engine until every spec has run (arrivals ignored)."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    pending = list(reversed(specs))
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.scheduler.requests) < concurrency:
            spec = pending.pop()
            params = SamplingParams(max_tokens=spec.output_len, temperature=0.0,
                                    ignore_eos=True)
            engine.add_request(None, {"prompt_token_ids": rng.integers(
                3, vocab, size=spec.prompt_len).tolist()}, params)
        for output in engine.step():  # read each output, as run_on_engine does
            len(output.outputs[0].token_ids)


def run_on_engine(engine: LLMEngine, specs: list[RequestSpec], seed: int = 0,
                  ) -> tuple[list[RequestRecord], float]:
    """Play the workload on the engine in real time; per-request records (seconds from the
    start) and the duration up to the last token. Each play starts from an empty prefix cache,
    as the simulator's runs do: a replay of the same prompts would otherwise find them all
    cached and skip their prefills (the later plays' TTFT a quarter of the first's)."""
    engine.reset_prefix_cache()
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    specs = sorted(specs, key=lambda s: s.arrival)
    prompts = [list(s.prompt_ids) if s.prompt_ids is not None
               else rng.integers(3, vocab, size=s.prompt_len).tolist() for s in specs]
    records = [RequestRecord(s.arrival, s.prompt_len, s.label, s.slo_ms) for s in specs]
    seen = [0] * len(specs)
    nxt, last = 0, 0.0
    start = time.monotonic()
    while nxt < len(specs) or engine.has_unfinished_requests():
        now = time.monotonic()
        while nxt < len(specs) and start + specs[nxt].arrival <= now:
            spec = specs[nxt]
            params = SamplingParams(max_tokens=spec.output_len, temperature=0.0,
                                    ignore_eos=True, priority=spec.priority, slo_ms=spec.slo_ms)
            engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, params,
                               arrival_time=start + spec.arrival)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + specs[nxt].arrival - time.monotonic()))
            continue
        outputs = engine.step()
        now = time.monotonic() - start
        for output in outputs:
            i = int(output.request_id)
            n = len(output.outputs[0].token_ids)
            records[i].deliver(now, n - seen[i])
            seen[i] = n
            last = now
    return records, last


def simulate_expected(config: EngineConfig, fit: StepCostModel, specs: list[RequestSpec],
                      seeds: int) -> dict:
    """The simulator's metrics averaged over runs with seeds 0 .. seeds-1."""
    return _mean([Simulator(config, fit, fit.info["num_pages"], fit.info["max_model_len"],
                            seed=seed).run(specs).metrics() for seed in range(max(1, seeds))])


def validate(model: str, config: EngineConfig,
             workload: Callable[[int], list[RequestSpec]],
             fit_path: str | Path | None = None, progress: bool = True,
             recalibrate: bool = False, repeats: int = 1, freeze: bool = False,
             sim_seeds: int = 8, open_loop_requests: int = 96) -> dict:
    """Run workload(max_model_len) on the engine and in the simulator; metrics of both and the
    relative errors of VALIDATED, and the agreement claimed ("claims": each error, or the
    engine mean's uncertainty where that is larger). Both sides are expectations: the engine's metrics are the
    means over `repeats` runs of the workload (a served engine's speed on this kind of machine
    drifts by tens of percent from one run to the next), and the simulator's the means over
    `sim_seeds` runs (seeds of its step-time spread). "noise" is how far the engine's single
    runs land from their mean (the floor under any simulator error on this machine),
    "uncertainty" twice the standard error of their mean, and "runs" holds each run's
    metrics. The saved fit is used unless there is none or
    `recalibrate`; a fresh calibration interleaves its open loops with the engine runs
    (`measure_engine`'s rounds), so both see the machine at the same speeds. `freeze` and
    `open_loop_requests`: as in `calibrate`."""
    engine = LLMEngine(model, config, progress=progress)
    if freeze:
        freeze_gc()
    specs = workload(engine.max_model_len)
    path = Path(fit_path or default_fit_path(model, config))
    runs: list[dict] = []

    def play(_round: int = 0) -> None:
        runs.append(compute_metrics(*run_on_engine(engine, specs)))

    run_on_engine(engine, specs[:min(len(specs), 8)])  # warm the host path; not measured
    if path.is_file() and not recalibrate:
        fit = StepCostModel.load(path)
        for _ in range(max(1, repeats)):
            play()
    else:
        fit = calibrate(model, config, path, engine, progress, open_loop_requests,
                        between=play, rounds=max(1, repeats))
    real = _mean(runs)
    simulated = simulate_expected(config, fit, specs, sim_seeds)

    def error(metrics: dict) -> dict:
        return {k: abs(metrics[k] - real[k]) / abs(real[k]) for k in VALIDATED if real[k]}

    report = {"real": real, "sim": simulated, "errors": error(simulated), "fit": fit.info}
    # what the comparison can tell apart: the engine's side is a mean of runs, known to about
    # twice its standard error; no agreement closer than that is claimed
    report["claims"] = dict(report["errors"])
    if len(runs) > 1:
        report["noise"] = {k: max(error(m)[k] for m in runs) for k in report["errors"]}
        report["uncertainty"] = {
            k: 2 * float(np.std([m[k] for m in runs], ddof=1)) / len(runs)**0.5 / abs(real[k])
            for k in report["errors"]}
        report["claims"] = {k: max(e, report["uncertainty"][k])
                            for k, e in report["errors"].items()}
        report["runs"] = runs
    return report


def _mean(runs: list[dict]) -> dict:
    """Each numeric metric averaged over runs."""
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]
            if isinstance(runs[0][k], (int, float))}
