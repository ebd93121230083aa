"""A serving run's result dict with `vllm bench serve --save-result`'s keys, and its printout.

The per-request arithmetic (TTFT, TPOT, ITL, E2EL, goodput) is the simulator's
(`jaxserve.sim.metrics`), so simulated and measured runs are computed alike. This adds what a
real run has besides: failed requests, the per-request lists (`--save-detailed`), the peaks,
and vLLM's choice of which metrics and percentiles to keep.
"""

import numpy as np

from jaxserve.sim.metrics import LATENCIES, RequestRecord, compute_metrics

HEADERS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}


def parse_percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LATENCIES]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; known: {', '.join(LATENCIES)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {text!r}")
    return values


def peak_output_rate(records: list[RequestRecord]) -> tuple[float, int]:
    """(most output tokens in any one-second bucket, most requests in flight at once: each from
    its send to its last token, a departure before an arrival at the same instant)."""
    done = [r for r in records if r.times]
    if not done:
        return 0.0, 0
    start = min(r.arrival for r in done)
    buckets = int(np.ceil(max(r.times[-1] for r in done) - start)) + 1
    tokens = np.zeros(buckets)
    for r in done:
        for t, n in zip(r.times, r.counts, strict=True):
            tokens[int(t - start)] += n
    events = sorted([(r.arrival, 1) for r in done] + [(r.times[-1], -1) for r in done])
    active = np.cumsum([step for _, step in events])
    return float(tokens.max()), int(active.max())


def detailed(records: list[RequestRecord], errors: list[str | None]) -> dict:
    """The per-request lists `vllm bench serve --save-detailed` saves (failed: 0 and "")."""
    ok = [e is None and bool(r.times) for r, e in zip(records, errors, strict=True)]
    return {"input_lens": [r.prompt_len for r in records],
            "output_lens": [r.output_len if good else 0 for r, good in zip(records, ok,
                                                                           strict=True)],
            "ttfts": [r.ttft if r.times else 0.0 for r in records],
            "itls": [r.itls for r in records],
            "start_times": [r.arrival for r in records],
            "latencies": [r.e2el if good else 0.0 for r, good in zip(records, ok, strict=True)],
            "errors": [e or "" for e in errors]}


def serving_result(records: list[RequestRecord], errors: list[str | None], duration: float,
                   goodput: dict[str, float] | None = None,
                   percentile_metrics: list[str] = ("ttft", "tpot", "itl"),
                   percentiles: list[float] = (99,)) -> dict:
    """vLLM's result keys. records[i] and errors[i] describe request i; a request with an error
    is failed and left out of every latency."""
    ok = [r for r, e in zip(records, errors, strict=True) if e is None and r.times]
    full = compute_metrics(ok, duration, goodput or None, tuple(percentiles))
    peak, peak_requests = peak_output_rate(ok)
    result = {
        "duration": full["duration"], "completed": full["completed"],
        "failed": len(records) - full["completed"],
        "total_input_tokens": full["total_input_tokens"],
        "total_output_tokens": full["total_output_tokens"],
        "request_throughput": full["request_throughput"],
        "request_goodput": full.get("request_goodput") if goodput else None,
        "output_throughput": full["output_throughput"],
        "total_token_throughput": full["total_token_throughput"],
        "max_output_tokens_per_s": peak, "max_concurrent_requests": peak_requests,
    }
    for name in percentile_metrics:
        result |= {k: v for k, v in full.items() if k.endswith(f"_{name}_ms")}
    return result


def format_result(result: dict, percentile_metrics: list[str], title: str = "Serving Benchmark Result",
                  extra: dict[str, object] | None = None) -> str:
    """vLLM's printout of a serving result."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float)
                     else f"{label:<40} {value!s:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    for label, value in (extra or {}).items():
        row(label, value)
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name in percentile_metrics:
        short, header = HEADERS[name]
        lines.append(f"{header:-^50}")
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for key in (k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")):
            row(f"P{key[1:-len(name) - 4]} {short} (ms):", result[key])
    lines.append("=" * 50)
    return "\n".join(lines)


def percentile_keys(result: dict, name: str) -> list[str]:
    """The pNN_<name>_ms keys of a result, in increasing percentile order."""
    keys = [k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")]
    return sorted(keys, key=lambda k: float(k[1:-len(name) - 4]))
