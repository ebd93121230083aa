"""Workloads: when requests arrive and how long they are, generated or read from a trace.

Arrivals are a Poisson or gamma renewal process (vLLM's `--burstiness`: gamma shape; 1 is
Poisson, lower is burstier) at `rate` requests/s, optionally modulated by bursts (the rate times
`factor` over [start, start + duration)). Lengths are uniform or lognormal (ShareGPT-like: a long
right tail). A trace is JSONL, one request per line:

    {"arrival": 0.12, "prompt_len": 180, "output_len": 42, "priority": 0, "slo_ms": 500,
     "label": "chat", "prompt_ids": [...]}          (all but the first three optional)
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxserve.config.checks import is_finite, is_int


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. It produces exactly output_len tokens (ignore_eos)."""

    arrival: float  # seconds from the start
    prompt_len: int
    output_len: int
    priority: int = 0
    slo_ms: float | None = None
    label: str = ""  # a class name for per-class metrics
    prompt_ids: tuple[int, ...] | None = None  # None: synthetic ids of prompt_len tokens

    def __post_init__(self):
        if not (is_finite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"arrival must be a finite number of seconds >= 0, "
                             f"got {self.arrival!r}")
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got {self.prompt_len}, "
                             f"{self.output_len}")
        if self.prompt_ids is not None and len(self.prompt_ids) != self.prompt_len:
            raise ValueError(f"prompt_ids has {len(self.prompt_ids)} tokens, prompt_len says "
                             f"{self.prompt_len}")


@dataclass(frozen=True)
class Burst:
    """The arrival rate is multiplied by `factor` over [start, start + duration) seconds."""

    start: float
    duration: float
    factor: float = 3.0


def arrival_times(n: int, rate: float, rng: np.random.Generator | np.random.RandomState,
                  burstiness: float = 1.0,
                  bursts: tuple[Burst, ...] = ()) -> np.ndarray:
    """[n] increasing arrival times (s). Gaps are gamma(burstiness) with mean 1/rate in
    "operational time", mapped through the cumulative rate so bursts speed arrivals up."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    if rate == float("inf"):
        return np.zeros(n)
    for b in bursts:
        if not (b.start >= 0 and b.duration > 0 and b.factor > 0):
            raise ValueError(f"a burst needs start >= 0, duration > 0 and factor > 0, got {b}")
    if burstiness == float("inf"):  # the gamma's limit: evenly spaced
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    op = np.cumsum(gaps)  # arrival times were the rate constant
    if not bursts:
        return op
    # cumulative extra rate: Lambda(t) = t + sum (factor - 1) * overlap([0, t], burst); invert it
    edges = np.unique(np.concatenate([[0.0], *[[b.start, b.start + b.duration] for b in bursts]]))
    slope = np.ones(len(edges))
    for b in bursts:
        slope[(edges >= b.start) & (edges < b.start + b.duration)] *= b.factor
    cum = np.concatenate([[0.0], np.cumsum(np.diff(edges) * slope[:-1])])
    t = np.interp(op, cum, edges)
    past = op > cum[-1]  # beyond the last edge the rate is 1x again
    t[past] = edges[-1] + (op[past] - cum[-1]) / slope[-1]
    return t


def lengths(n: int, rng: np.random.Generator, dist: str, mean: float, spread: float,
            low: int = 1, high: int | None = None) -> np.ndarray:
    """[n] token counts. uniform: [mean(1 - spread), mean(1 + spread)]; lognormal: median
    `mean`, sigma `spread`. Clipped to [low, high]."""
    if dist == "uniform":
        x = rng.uniform(mean * (1 - spread), mean * (1 + spread), size=n)
    elif dist == "lognormal":
        x = rng.lognormal(np.log(mean), spread, size=n)
    else:
        raise ValueError(f"length distribution must be 'uniform' or 'lognormal', got {dist!r}")
    return np.clip(np.round(x), low, high if high is not None else np.inf).astype(int)


def synthetic(n: int, rate: float, *, seed: int = 0, burstiness: float = 1.0,
              bursts: tuple[Burst, ...] = (), dist: str = "lognormal", input_len: float = 128,
              output_len: float = 64, input_spread: float = 0.8, output_spread: float = 0.8,
              max_model_len: int | None = None) -> list[RequestSpec]:
    """n requests; prompt + output are kept within max_model_len."""
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(n, rate, rng, burstiness, bursts)
    high = None if max_model_len is None else max_model_len - 1
    prompts = lengths(n, rng, dist, input_len, input_spread, high=high)
    outputs = lengths(n, rng, dist, output_len, output_spread)
    if max_model_len is not None:
        outputs = np.maximum(1, np.minimum(outputs, max_model_len - prompts))
    return [RequestSpec(float(a), int(p), int(o))
            for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


def read_trace(path: str | Path) -> list[RequestSpec]:
    specs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row.get("prompt_ids") is not None:
                row["prompt_ids"] = tuple(row["prompt_ids"])
            specs.append(RequestSpec(**row))
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"{path}:{i}: not a request spec ({err})") from err
    return sorted(specs, key=lambda s: s.arrival)


def write_trace(path: str | Path, specs: list[RequestSpec]) -> None:
    lines = []
    for spec in specs:
        row = {k: v for k, v in asdict(spec).items() if v not in (None, "")}
        if spec.prompt_ids is not None:
            row["prompt_ids"] = list(spec.prompt_ids)
        lines.append(json.dumps(row))
    Path(path).write_text("\n".join(lines) + "\n")
