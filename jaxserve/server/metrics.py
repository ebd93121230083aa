"""Prometheus metrics under vLLM V1's names, labels and buckets, with the `jaxserve:` prefix
(DESIGN.md section 7).

Engine gauges and counters are read from `AsyncEngine.stats()` at scrape time. Token counters,
time to first token and inter-token latencies are observed as the server sees each request's
outputs (so rates move while long requests run). When a request ends, its finish reason is
counted and, if it finished (was not aborted), vLLM's per-request histograms are observed: the
latency phases, token counts and parameters. The engine thread reports each step's tokens
(`observe_iteration`). Each app has its own registry, so several servers can live in one process
(the tests start more than one).

A request's phases, from its `RequestMetrics` (as vLLM's, a preemption counts in the phase it
interrupts):

    arrival      first_scheduled      first_token                finished
       |--- queue ---|---- prefill ----|--------- decode ---------|
                     |---------------- inference -----------------|
       |---------------------------- e2e -------------------------|
"""

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.request_stream import RequestStream
from jaxserve.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets, as its PrometheusStatLogger has them
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # inter-token and per-request TPOT
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts (up to
    max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


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
        for name, value, doc in (
                ("num_preemptions", stats["num_preemptions"],
                 "Requests preempted (recomputed later)."),
                ("num_compilations", stats["num_compilations_after_warmup"],
                 "XLA compilations after warm-up (each one is a bug)."),
                ("prefix_cache_queries", stats.get("prefix_cache_queries", 0),
                 "Prefix cache queries, in queried tokens."),
                ("prefix_cache_hits", stats.get("prefix_cache_hits", 0),
                 "Prefix cache hits, in cached tokens."),
        ):
            counter = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(value))
            yield counter
        if self.engine.engine.config.speculative_config is not None:  # as vLLM: only then
            yield from self._spec_decode(stats)
        if "lora_running" in stats:  # vLLM's: the adapters as labels, the time as the value
            info = GaugeMetricFamily(
                "jaxserve:lora_requests_info", "LoRA adapters of running and waiting requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(stats["max_loras"]), ",".join(stats["lora_running"]),
                             ",".join(stats["lora_waiting"])], time.time())
            yield info

    def _spec_decode(self, stats):
        """vLLM's spec_decode counters: proposals, proposed and kept tokens, kept per position."""
        for name, doc in (("num_drafts", "Verification rows that proposed tokens."),
                          ("num_draft_tokens", "Tokens proposed."),
                          ("num_accepted_tokens", "Proposed tokens kept.")):
            counter = CounterMetricFamily(f"jaxserve:spec_decode_{name}", doc,
                                          labels=["model_name"])
            counter.add_metric([self.model_name], float(stats[f"spec_decode_{name}"]))
            yield counter
        counter = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens kept, by their position in the proposal.",
                                      labels=["model_name", "position"])
        for position, value in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            counter.add_metric([self.model_name, str(position)], float(value))
        yield counter


@dataclass
class Seen:
    """One sequence of a request: its max_tokens, and what the metrics already counted of it."""

    max_tokens: int | None = None  # as asked; None: up to max_model_len
    prompt: bool = False
    tokens: int = 0
    gaps: int = 0


class Metrics:
    """The registry behind /metrics: `progress` records a sequence's new output, `observe` the
    end of an HTTP request's sequences, `observe_iteration` (on the engine thread) a step."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        llm = engine.engine
        self.max_model_len = llm.max_model_len
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine, model_name))

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"jaxserve:{name}", doc, ["model_name"], buckets=buckets,
                             registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"jaxserve:{name}", doc, ["model_name"], registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens.",
                             _TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A request's decode time per token after its first.",
                              _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               _REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "First scheduled to the first token.", _REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to the last.",
                                _REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "First scheduled to the last token.", _REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(self.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens of a request.", token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens a request generated.", token_buckets)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "The most tokens generated by one of a prompt's n samples.", token_buckets)
        self.params_n = histogram("request_params_n", "The n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens",
            "The max_tokens request parameter (unset: what max_model_len leaves).", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.",
                                          _ITERATION_TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.model_name = model_name
        self.success = Counter("jaxserve:request_success", "Ended requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        for reason in _FINISH_REASONS:  # each shown from the start, as vLLM's
            self.success.labels(model_name, reason)
        # an info metric as vLLM's: a gauge at 1 whose labels are vLLM's CacheConfig fields that
        # jaxserve has (a page is vLLM's block; num_gpu_blocks counts the null page, as vLLM's)
        cache = {"block_size": llm.config.page_size, "num_gpu_blocks": llm.runner.num_pages,
                 "num_gpu_blocks_override": llm.config.num_pages,
                 "cache_dtype": llm.runner.kv_dtype_name,
                 "enable_prefix_caching": llm.config.enable_prefix_caching}
        Gauge("jaxserve:cache_config_info", "The engine's KV cache configuration.", list(cache),
              registry=r).labels(*map(str, cache.values())).set(1)

    def progress(self, seen: Seen, output: RequestOutput | None,
                 inter_token_latencies: list[float]) -> None:
        """A sequence's next output, a delta (None: none, only new gaps): count what it adds
        (its prompt once, its tokens, the first token's latency, new inter-token gaps)."""
        if output is not None:
            if not seen.prompt:
                seen.prompt = True
                self.prompt_tokens.inc(len(output.prompt_token_ids))
            new = len(output.outputs[0].token_ids)
            if new:
                m = output.metrics
                if seen.tokens == 0 and m is not None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                self.generation_tokens.inc(new)
                seen.tokens += new
        for gap in inter_token_latencies[seen.gaps:]:
            self.itl.observe(gap)
        seen.gaps = max(seen.gaps, len(inter_token_latencies))

    def observe(self, seen: list[Seen], outputs: list[RequestOutput | None],
                streams: list[RequestStream], n: int) -> None:
        """An HTTP request ended: each of its sequences (sample j of prompt i at i * n + j,
        every output of it counted by `progress`) finished, with its last output, or was
        aborted (client gone, timeout). An aborted sequence's tokens and latencies count too
        (it is often one of the slow ones), and its finish reason; the per-request histograms
        take finished sequences, and n and the most tokens generated a prompt whose n samples
        all finished (as vLLM, once per prompt)."""
        done: list[RequestOutput | None] = []
        reasons: dict[str, int] = {}  # one increment per reason: a request may hold thousands
        for counted, output, stream in zip(seen, outputs, streams, strict=True):
            if output is None and not stream.inter_token_latencies:  # gone before its first
                reasons["abort"] = reasons.get("abort", 0) + 1  # token (a mass abort's many)
                done.append(None)
                continue
            self.progress(counted, None, stream.inter_token_latencies)
            finished = stream.finished and output is not None and output.finished
            done.append(output if finished else None)
            reason = output.outputs[0].finish_reason if finished else "abort"
            reasons[reason] = reasons.get(reason, 0) + 1
            if finished:
                self._finished(counted, output)
        for reason, count in reasons.items():
            self.success.labels(self.model_name, reason).inc(count)
        for start in range(0, len(done), n):
            group = done[start:start + n]
            if group[0] is not None and all(output is not None for output in group):
                self.params_n.observe(n)
                self.max_generation_tokens.observe(max(s.tokens for s in seen[start:start + n]))

    def _finished(self, seen: Seen, output: RequestOutput) -> None:
        prompt, generated = len(output.prompt_token_ids), seen.tokens
        self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(generated)
        room = self.max_model_len - prompt  # what vLLM's server sets when max_tokens is unset
        max_tokens = room if seen.max_tokens is None else min(seen.max_tokens, room)
        if max_tokens > 0:
            self.params_max_tokens.observe(max_tokens)
        m = output.metrics
        if m is None or None in (m.first_scheduled_time, m.first_token_time, m.finished_time):
            return
        decode = m.finished_time - m.first_token_time
        self.e2e.observe(m.finished_time - m.arrival_time)
        self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        self.decode.observe(decode)
        self.inference.observe(m.finished_time - m.first_scheduled_time)
        self.tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)

    def observe_iteration(self, num_tokens: int) -> None:
        """On the engine thread (`AsyncEngine.on_iteration`), once per step whose results were
        read: as vLLM counts, the tokens it generated plus the prompt tokens of the requests it
        gave their first token (over a request: its prompt and its output)."""
        self.iteration_tokens.observe(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
