"""The step-cost model: seconds per engine iteration, from the shapes the runner pads it to.

An iteration dispatches a decode call over B_d rows (padded to a row bucket) for K steps, and
prefill calls, each over B_p rows padded to a chunk bucket C (the runner's grouping of prompt
chunks by length, `core.buckets.prefill_calls`). Each compiled shape has its own cost, and
attention walks the pages of the longest sequence in the call (L) for every row, so:

    device = decode[B_d, K](L_d) + sum over calls prefill[B_p, C](L_p)
             + mixed x (calls - 1)
    where each table entry is  a + b * L,  fitted by least squares per shape

to timings of the real runner over decode rows x prefill tokens x context
(`jaxserve.tools.calibrate`), measured pipelined as the engine runs. A shape the profile missed takes
the nearest profiled one, scaled by its padded rows (and chunk length). Inside the engine a step
also pays for scheduling and outputs, and its calls meet other work (scattered pages, the host
thread on the same cores), so the iteration is

    cost = decode_factor[B_d] * decode + prefill_factor * prefill
           (x a wake factor for the first WAKE_STEPS iterations after the engine sat idle,
            + idle_wakeup for the first of them)

with the factors measured on the periods of steps in short closed- and open-loop runs of the
real engine (`calibrate.measure_engine`): the ratio of their summed time to the summed profile
(step times are heavy-tailed; their sum is what latencies add up). An engine waking from idle
is slower for a few iterations (threads parked, caches cold; on the CPU the first five
iterations' periods measured about 1.3x the later ones). The wake factors are their measured /
predicted time, one for iterations with prompt chunks (`wake_prefill_factor`: the first after
idle nearly always is one, the new request's prefill; 1.14-1.24 measured) and one for
decode-only iterations (`wake_factor`, 1.39-1.49), and the wake-up term the time to first
token the simulator still misses on the calibration's served runs, on average over the requests
arriving at an idle engine (`calibrate.measure_wakeup`).

A served engine's iterations scatter around that mean (the host thread, the OS, the caches),
and latency percentiles live in that scatter. The fit keeps it as quantiles of measured /
predicted over the open-loop runs' iterations, scaled to mean 1: `spread` for decode-only
iterations, `prefill_spread` for those with prompt chunks (longer, and steadier relative to
their length), and `wake_spread` / `wake_prefill_spread` for the same kinds among the first
iterations after idle, which scatter wider (a request arriving at an idle engine waits for
one of those: the tail of time to first token lives there). A wake table measured from too
few iterations is left empty and the steady one serves. A simulator passes `cost` a uniform
draw per iteration from a seeded generator and gets that quantile's cost; without a draw (or
a spread), the deterministic mean.

Consecutive iterations scatter together: a slow stretch of the machine slows several in a
row (measured on the CPU: normal scores of measured / predicted correlate 0.39 two iterations
apart and 0.23 twenty apart). The draws keep that: each is the normal CDF of
sqrt(noise_share) x a slow AR(1) part with `noise_memory` per iteration + sqrt(1 -
noise_share) x white noise (`correlated_draws`); both are fitted to the calibration's
autocorrelation (`fit_noise_memory`). Slow stretches add up inside one request's time to
first token, so they fatten its tail. The fit is saved as JSON with its samples and what it
was measured on.
"""

import hashlib
import json
import math
import os
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import numpy as np
from scipy.optimize import nnls

from jaxserve.config.engine import EngineConfig
from jaxserve.core.buckets import prefill_calls, prefill_row_buckets
from jaxserve.core.scheduler_output import SchedulerOutput

# 2: several prefill calls per iteration; 3: one-row prefill calls; 4: factors from steady
# iterations, with the wake factor and the spreads; 5: wake factors and spreads per kind;
# 6: correlated draws (noise_share, noise_memory); 7: the wake-up term from idle arrivals alone
FIT_FORMAT = 8  # 8: a ragged runner's prompt chunks as one call (step_shape)
WAKE_STEPS = 5  # iterations after an idle wait that run at the wake factor

# the engine settings a step's cost depends on; scheduling (policy, window...) and the number
# of pages are the simulator's to vary
COST_FIELDS = ("dtype", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
               "page_size", "attention_impl", "matmul_impl", "kv_cache_dtype", "decode_steps",
               "prefill_chunk_sizes", "max_top_logprobs", "enable_prompt_logprobs", "row_buckets",
               "scan_layers")


def cost_settings(config: EngineConfig) -> dict:
    """The engine settings a fit was measured under (COST_FIELDS), JSON-able."""
    return {f: list(v) if isinstance(v := getattr(config, f), tuple) else v for f in COST_FIELDS}


def fit_mismatches(fit: "StepCostModel", config: EngineConfig) -> list[str]:
    """The settings that differ between the fit's engine and `config` ("name: fit's -> now"),
    for a fit given by path; a fit saved without them (older) has none to compare."""
    measured = fit.info.get("engine")
    if not isinstance(measured, dict):
        return []
    now = cost_settings(config)
    return [f"{k}: {measured[k]!r} -> {now[k]!r}" for k in COST_FIELDS
            if k in measured and measured[k] != now[k]]


def default_fit_path(model: str, config: EngineConfig) -> Path:
    """Where the fit for this model (its shape: config.json) and engine shape is saved: the user
    cache directory."""
    base = Path(os.environ.get("JAXSERVE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxserve")
    if model == "demo":
        from jaxserve.demo import demo_model_dir

        path = demo_model_dir()
    else:
        path = Path(model).resolve()
    shape = (path / "config.json").read_text() if (path / "config.json").is_file() else ""
    key = json.dumps([FIT_FORMAT, str(path), shape, os.environ.get("JAX_PLATFORMS", ""),
                      [getattr(config, f) for f in COST_FIELDS]])
    name = model if model == "demo" else path.name
    return base / "sim" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def _bucket(n: int, sizes: tuple[int, ...]) -> int:
    return sizes[min(bisect_left(sizes, n), len(sizes) - 1)]


@dataclass(frozen=True)
class StepShape:
    """What an iteration's cost depends on: padded rows and chunk, steps, longest sequences."""

    decode_rows: int = 0  # padded; 0: no decode call
    decode_steps: int = 1
    decode_len: int = 0
    prefill: tuple[tuple[int, int, int], ...] = ()  # per call: (padded rows, chunk, longest)

    @property
    def num_calls(self) -> int:
        return (1 if self.decode_rows else 0) + len(self.prefill)


def step_shape(out: SchedulerOutput, row_buckets: tuple[int, ...],
               chunk_buckets: tuple[int, ...], ragged: bool = False) -> StepShape:
    """The shapes an iteration's calls are padded to. `ragged`: the runner packs an
    iteration's prompt chunks into one call of their total tokens (the CPU and TPU
    attention), which costs what that many tokens in even rows cost: (rows, their mean
    length) unbucketed, which the cost table scales from its nearest profiled shape, not rows
    x the longest chunk's bucket, as separate padded calls would."""
    k = out.decode_steps
    decode = [c for c in out.chunks if c.num_tokens == 1]
    prompt = [c for c in out.chunks if c.num_tokens > 1]
    calls, prefill_rows = [], prefill_row_buckets(row_buckets)
    logprobs = [c.request.params.prompt_logprobs is not None for c in prompt]
    groups = prefill_calls([c.num_tokens for c in prompt], logprobs, prefill_rows, chunk_buckets)
    if ragged and prompt and not any(logprobs):
        groups = [list(range(len(prompt)))]
    for group in groups:
        chunks = [prompt[i] for i in group]
        end = max(c.start + c.num_tokens for c in chunks)
        if ragged and len(chunks) > 1:  # their mean length, unbucketed
            calls.append((len(chunks), -(-sum(c.num_tokens for c in chunks) // len(chunks)), end))
        else:
            calls.append((_bucket(len(chunks), prefill_rows),
                          _bucket(max(c.num_tokens for c in chunks), chunk_buckets), end))
    return StepShape(_bucket(max(len(decode), out.batch_rows), row_buckets) if decode else 0, k,
                     max((c.start + k for c in decode), default=0), tuple(calls))


def _line(lengths: list[float], seconds: list[float]) -> tuple[float, float]:
    """(a, b) of seconds = a + b * length with a, b >= 0, least squares on relative error.

    The constraint is physics, not tidiness: a call never costs less than nothing, and a
    longer context never makes it faster. An unconstrained fit of noisy times can give either
    a negative (a busy machine once gave b = -0.00055), and the simulator would run on it.
    SciPy's non-negative least squares (Lawson-Hanson) solves the constrained problem exactly."""
    x, y = np.asarray(lengths, np.float64), np.asarray(seconds, np.float64)
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"measured seconds must be positive and finite, got {y.tolist()}")
    if len(set(x.tolist())) < 2:
        return float(y.mean()), 0.0
    w = 1.0 / y
    (a, b), _ = nnls(np.stack([w, w * x], axis=1), np.ones_like(y))
    return float(a), float(b)


@dataclass
class StepCostModel:
    decode: dict[tuple[int, int], tuple[float, float]]  # (rows, steps) -> (a, b)
    prefill: dict[tuple[int, int], tuple[float, float]]  # (rows, chunk) -> (a, b)
    mixed: float  # extra seconds when an iteration runs both calls
    row_buckets: tuple[int, ...]
    chunk_buckets: tuple[int, ...]
    info: dict = field(default_factory=dict)  # what and where it was measured; fit quality
    samples: list[list] = field(default_factory=list)  # [*StepShape fields, seconds]
    decode_factor: dict[int, float] = field(default_factory=dict)  # padded rows -> factor;
    prefill_factor: float = 1.0  # 0: rows measured too rarely; missing: 1 (as profiled)
    idle_wakeup: float = 0.0  # seconds
    # quantiles of measured / predicted iteration time, mean 1: decode-only iterations, and
    # iterations with prompt chunks
    spread: tuple[float, ...] = ()
    prefill_spread: tuple[float, ...] = ()
    # the first WAKE_STEPS iterations after idle: decode-only ones, and those with prompt chunks
    wake_factor: float = 1.0
    wake_prefill_factor: float = 1.0
    wake_spread: tuple[float, ...] = ()
    wake_prefill_spread: tuple[float, ...] = ()
    # the draws' slow part: its share of the variance, and its correlation per iteration
    noise_share: float = 0.0
    noise_memory: float = 0.0

    def __post_init__(self):
        self._cache: dict[StepShape, float] = {}

    def cost(self, out: SchedulerOutput, draw: float | None = None,
             since_wake: int = WAKE_STEPS) -> float:
        """Seconds the iteration takes: the mean, or its spread's quantile at `draw` in [0, 1);
        `since_wake`: iterations since the engine woke from idle (0: the first)."""
        shape = step_shape(out, self.row_buckets, self.chunk_buckets,
                           self.info.get("ragged", False))
        d, p = self.parts(shape)
        seconds = self.decode_factor_for(shape.decode_rows) * d + self.prefill_factor * p
        woke = since_wake < WAKE_STEPS
        if woke:
            seconds *= self.wake_prefill_factor if shape.prefill else self.wake_factor
        spread = self.prefill_spread if shape.prefill else self.spread
        if woke:
            spread = (self.wake_prefill_spread if shape.prefill else self.wake_spread) or spread
        if draw is None or not spread:
            return seconds
        return seconds * spread[int(draw * len(spread))]

    def decode_factor_for(self, rows: int) -> float:
        factors = self.decode_factor
        return factors.get(rows, factors.get(0, 1.0))

    def shape_cost(self, shape: StepShape) -> float:
        """Seconds of the runner's calls alone, as profiled."""
        return sum(self.parts(shape))

    def parts(self, shape: StepShape) -> tuple[float, float]:
        """(decode, prefill) seconds of the runner's calls; prefill carries `mixed`."""
        cached = self._cache.get(shape)
        if cached is not None:
            return cached
        d = p = 0.0
        if shape.decode_rows:
            d = self._lookup(self.decode, shape.decode_rows, shape.decode_steps,
                             shape.decode_len)
        for rows, chunk, length in shape.prefill:
            p += self._lookup(self.prefill, rows, chunk, length)
        if shape.num_calls > 1:  # calls may overlap (mixed < 0), never below the longest one
            p = max(p + self.mixed * (shape.num_calls - 1), max(p, d) - d)
        if len(self._cache) < 100_000:
            self._cache[shape] = (d, p)
        return d, p

    @staticmethod
    def _lookup(table: dict, rows: int, second: int, length: int) -> float:
        if (rows, second) in table:
            a, b = table[rows, second]
            return a + b * length
        # the nearest profiled shape, scaled by rows x second (decode steps or chunk length)
        r, c = min(table, key=lambda k: (abs(np.log2(k[0] / rows)) + abs(np.log2(k[1] / second))))
        a, b = table[r, c]
        return (a + b * length) * (rows / r) * (second / c)

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], row_buckets: tuple[int, ...],
            chunk_buckets: tuple[int, ...], info: dict | None = None) -> "StepCostModel":
        """A line in L per profiled shape; `mixed` is the median excess of mixed iterations."""
        groups: dict[tuple, tuple[list, list]] = {}
        for shape, seconds in samples:
            if shape.num_calls != 1:
                continue
            if shape.decode_rows:
                key, length = ("d", shape.decode_rows, shape.decode_steps), shape.decode_len
            else:
                (rows, chunk, length), = shape.prefill
                key = ("p", rows, chunk)
            groups.setdefault(key, ([], []))[0].append(length)
            groups[key][1].append(seconds)
        decode = {k[1:]: _line(*v) for k, v in groups.items() if k[0] == "d"}
        prefill = {k[1:]: _line(*v) for k, v in groups.items() if k[0] == "p"}
        model = cls(decode, prefill, 0.0, tuple(row_buckets), tuple(chunk_buckets),
                    dict(info or {}),
                    [[s.decode_rows, s.decode_steps, s.decode_len, [list(c) for c in s.prefill],
                      t] for s, t in samples])
        several = [(s, t) for s, t in samples if s.num_calls > 1]
        if several and prefill:
            model.mixed = float(np.median([(t - model.shape_cost(s)) / (s.num_calls - 1)
                                           for s, t in several]))
            model._cache.clear()
        predicted = np.array([model.shape_cost(s) for s, _ in samples])
        seconds = np.array([t for _, t in samples])
        rel = np.abs(predicted - seconds) / seconds
        model.info |= {"num_samples": len(samples), "mean_rel_error": float(rel.mean()),
                       "max_rel_error": float(rel.max())}
        return model

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"decode": [[*k, *v] for k, v in self.decode.items()],
                "prefill": [[*k, *v] for k, v in self.prefill.items()], "mixed": self.mixed,
                "row_buckets": self.row_buckets, "chunk_buckets": self.chunk_buckets,
                "decode_factor": self.decode_factor, "prefill_factor": self.prefill_factor,
                "idle_wakeup": self.idle_wakeup, "spread": list(self.spread),
                "prefill_spread": list(self.prefill_spread), "wake_factor": self.wake_factor,
                "wake_prefill_factor": self.wake_prefill_factor,
                "wake_spread": list(self.wake_spread),
                "wake_prefill_spread": list(self.wake_prefill_spread),
                "noise_share": self.noise_share, "noise_memory": self.noise_memory,
                "info": self.info, "samples": self.samples}
        path.write_text(json.dumps(data, indent=None))

    @classmethod
    def load(cls, path: str | Path) -> "StepCostModel":
        data = json.loads(Path(path).read_text())
        table = lambda rows: {(int(r[0]), int(r[1])): (r[2], r[3]) for r in rows}  # noqa: E731
        return cls(table(data["decode"]), table(data["prefill"]), data["mixed"],
                   tuple(data["row_buckets"]), tuple(data["chunk_buckets"]), data.get("info", {}),
                   data.get("samples", []),
                   {int(k): v for k, v in data.get("decode_factor", {}).items()},
                   data.get("prefill_factor", 1.0), data.get("idle_wakeup", 0.0),
                   tuple(data.get("spread", ())), tuple(data.get("prefill_spread", ())),
                   data.get("wake_factor", 1.0), data.get("wake_prefill_factor", 1.0),
                   tuple(data.get("wake_spread", ())),
                   tuple(data.get("wake_prefill_spread", ())),
                   data.get("noise_share", 0.0), data.get("noise_memory", 0.0))


def spread_quantiles(fit: StepCostModel, rows: np.ndarray, d: np.ndarray, p: np.ndarray,
                     wall: np.ndarray, n: int = 1000) -> tuple[float, ...]:
    """n quantiles of measured / predicted iteration time (factors applied), scaled to mean 1:
    how served iterations scatter around the fit's mean."""
    factors = np.array([fit.decode_factor_for(int(b)) for b in rows])
    predicted = factors * d + fit.prefill_factor * p
    keep = predicted > 0
    if keep.sum() < 2:
        return ()
    ratio = wall[keep] / predicted[keep]
    quantiles = np.quantile(ratio, (np.arange(n) + 0.5) / n)
    return tuple(float(q) for q in quantiles / quantiles.mean())


def normal_scores(values: np.ndarray) -> np.ndarray:
    """Ranks mapped to standard normal quantiles: any distribution's values as N(0, 1)."""
    ranks = np.argsort(np.argsort(values, kind="stable"), kind="stable")
    unit = NormalDist()
    return np.array([unit.inv_cdf((r + 0.5) / len(values)) for r in ranks])


def fit_noise_memory(scores: np.ndarray, runs: np.ndarray, steps: np.ndarray,
                     lags: range = range(2, 17), min_pairs: int = 200) -> tuple[float, float]:
    """(noise_share, noise_memory) of N(0, 1) scores of consecutive iterations: `runs` and
    `steps` say which run and iteration each came from (lags count iterations within a run).
    The correlation at lag k is modelled as share x memory^k and fitted in log space. Lag 1 is
    left out: with one iteration in flight, time the host loses in one period is found in the
    next, which pulls that correlation down. Too few pairs, or no positive correlation: (0, 0),
    independent draws."""
    where = {(int(r), int(t)): i for i, (r, t) in enumerate(zip(runs, steps, strict=True))}
    ks, logs = [], []
    for k in lags:
        pairs = [(i, where[r, t + k]) for (r, t), i in where.items() if (r, t + k) in where]
        if len(pairs) < min_pairs:
            continue
        a, b = (np.array(x) for x in zip(*pairs, strict=True))
        corr = float(np.corrcoef(scores[a], scores[b])[0, 1])
        if corr > 0.01:
            ks.append(k)
            logs.append(math.log(corr))
    if len(ks) < 2:
        return 0.0, 0.0
    slope, intercept = np.polyfit(ks, logs, 1)
    memory = min(max(math.exp(slope), 0.0), 0.999)
    share = min(max(math.exp(intercept), 0.0), 0.9)
    return share, memory


def correlated_draws(rng: np.random.Generator, share: float, memory: float, n: int,
                     state: float) -> tuple[np.ndarray, float]:
    """n uniform draws in [0, 1) whose normal scores are sqrt(share) x an AR(1) part (`memory`
    per draw, carried in `state`) + sqrt(1 - share) x white noise; and the new state."""
    slow, fast = rng.standard_normal(n), rng.standard_normal(n)
    keep, fresh = memory, math.sqrt(1.0 - memory * memory)
    path = np.empty(n)
    for i in range(n):
        state = keep * state + fresh * slow[i]
        path[i] = state
    z = math.sqrt(share) * path + math.sqrt(1.0 - share) * fast
    unit = NormalDist()
    u = np.array([unit.cdf(x) for x in z])
    return np.minimum(u, np.nextafter(1.0, 0.0)), state
