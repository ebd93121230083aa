"""Prometheus metrics under vLLM's names with the `jaxserve:` prefix (DESIGN.md section 7).

Engine gauges and counters are read from `AsyncEngine.stats()` at scrape time; token counts,
time to first token and inter-token latencies are observed as the server sees each request's
outputs (so rates move while long requests run), end-to-end latency and the finish reason as it
ends. Each app has its own registry, so several servers can live in one process (the tests
start more than one).
"""

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.async_engine import AsyncEngine
from jaxserve.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector:
    """The engine's own numbers, read at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.stats()
        for name, key, doc in (
                ("num_requests_running", "num_requests_running", "Requests holding a slot."),
                ("num_requests_waiting", "num_requests_waiting", "Requests waiting for a slot."),
                ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV pages in use (1 = all)."),
        ):
            gauge = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(stats[key]))
            yield gauge
        for name, key, doc in (
                ("num_preemptions", "num_preemptions", "Requests preempted (recomputed later)."),
                ("num_compilations", "num_compilations_after_warmup",
                 "XLA compilations after warm-up (each one is a bug)."),
        ):
            counter = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(stats[key]))
            yield counter


@dataclass
class Seen:
    """What the metrics already counted of one request."""

    prompt: bool = False
    tokens: int = 0
    gaps: int = 0


class Metrics:
    """The registry behind /metrics: `progress` records a request's new output, `observe` its
    end."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to the first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "Time between two tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of admitted "
                                     "requests.", labels, registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Tokens generated.",
                                         labels, registry=r)
        self.success = Counter("jaxserve:request_success", "Ended requests by finish reason.",
                               [*labels, "finished_reason"], registry=r)

    def progress(self, seen: Seen, output: RequestOutput | None,
                 inter_token_latencies: list[float]) -> None:
        """A request's newest output: count what it adds (its prompt once, new tokens, the
        first token's latency, new inter-token gaps)."""
        name = self.model_name
        if output is not None:
            if not seen.prompt:
                seen.prompt = True
                self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
            tokens = len(output.outputs[0].token_ids)
            if tokens > seen.tokens:
                m = output.metrics
                if seen.tokens == 0 and m is not None and m.first_token_time is not None:
                    self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
                self.generation_tokens.labels(name).inc(tokens - seen.tokens)
                seen.tokens = tokens
        for gap in inter_token_latencies[seen.gaps:]:
            self.itl.labels(name).observe(gap)
        seen.gaps = max(seen.gaps, len(inter_token_latencies))

    def observe(self, seen: Seen, output: RequestOutput | None,
                inter_token_latencies: list[float], aborted: bool) -> None:
        """One request ended: finished (with its last output) or aborted (client gone, timeout).
        An aborted request's tokens and latencies count too (it is often one of the slow ones);
        only the end-to-end latency needs a finished request."""
        self.progress(seen, output, inter_token_latencies)
        name = self.model_name
        if aborted or output is None or not output.finished:
            self.success.labels(name, "abort").inc()
            return
        self.success.labels(name, output.outputs[0].finish_reason).inc()
        m = output.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
