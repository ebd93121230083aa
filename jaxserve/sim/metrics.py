"""The metrics `vllm bench serve` reports, from per-request token arrival times.

Keys follow `vllm bench serve --save-result`: request_throughput, output_throughput,
total_token_throughput, request_goodput, and mean_/median_/std_/pNN_ {ttft, tpot, itl, e2el}_ms.
TTFT counts from the request's arrival; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL is the gap
between successive deliveries (several tokens may arrive together, as from multi-step decode).
"""

from dataclasses import dataclass, field

import numpy as np

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    arrival: float  # seconds, on the clock of `times`
    prompt_len: int
    label: str = ""
    slo_ms: float | None = None  # a TTFT target of its own, used by goodput
    times: list[float] = field(default_factory=list)  # when each delivery of tokens arrived
    counts: list[int] = field(default_factory=list)  # how many tokens each delivery held

    def deliver(self, time: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.times.append(time)
            self.counts.append(num_tokens)

    @property
    def output_len(self) -> int:
        return sum(self.counts)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.times).tolist()


def percentile_key(p: float) -> str:
    """A percentile's name in result keys, as vLLM writes it: p99, p99.9, p99.99999."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def _summary(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    ms = np.asarray(values_s, np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a request met every target (a record's own slo_ms overrides the TTFT one)."""
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    targets = dict(slos_ms)
    if record.slo_ms is not None:
        targets["ttft"] = record.slo_ms
    return all(values[k] * 1000.0 <= v for k, v in targets.items())


def idle_arrivals(records: list[RequestRecord]) -> list[bool]:
    """Per record (in arrival order): whether every earlier request had finished when it
    arrived, so that it met an idle engine."""
    idle, finish = [], float("-inf")
    for record in records:
        idle.append(record.arrival > finish)
        finish = max(finish, record.arrival + record.e2el)
    return idle


def compute_metrics(records: list[RequestRecord], duration: float,
                    slos_ms: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    """Benchmark metrics over the completed records; duration is the run's wall (or virtual)
    time, from its start to the last token."""
    done = [r for r in records if r.times]
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    metrics = {
        "duration": duration, "completed": len(done),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    if slos_ms or any(r.slo_ms is not None for r in done):
        metrics["request_goodput"] = sum(is_good(r, slos_ms or {}) for r in done) / duration
    metrics |= _summary("ttft", [r.ttft for r in done], percentiles)
    metrics |= _summary("tpot", [r.tpot for r in done if r.tpot is not None], percentiles)
    metrics |= _summary("itl", [x for r in done for x in r.itls], percentiles)
    metrics |= _summary("e2el", [r.e2el for r in done], percentiles)
    return metrics


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """vLLM's `--goodput ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"goodput targets are ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
        if not slos[name] >= 0:
            raise ValueError(f"goodput target {item!r} must be non-negative")
    return slos


def format_table(rows: dict[str, dict], columns: list[str]) -> str:
    """A plain text table: one row per name, a column per metric key."""
    widths = [max(12, len(c)) for c in columns]
    name_width = max([8, *(len(n) for n in rows)])
    lines = ["  ".join([" " * name_width, *(c.rjust(w) for c, w in zip(columns, widths,
                                                                         strict=True))])]
    for name, values in rows.items():
        cells = [_cell(values.get(c)).rjust(w) for c, w in zip(columns, widths, strict=True)]
        lines.append("  ".join([name.ljust(name_width), *cells]))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)
