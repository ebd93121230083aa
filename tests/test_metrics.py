"""/metrics carries vLLM V1's series (names, labels, buckets) with the `jaxserve:` prefix, and
their counts move as vLLM's own metrics test expects: per request, per prompt of n samples, per
engine step. Values are asserted, never wall-clock durations."""

import itertools

import pytest
from prometheus_client.parser import text_string_to_metric_families
from served import MODEL, PROMPT, abandon_while_running, metrics_of, wait_idle

from jaxserve.server.metrics import buckets_1_2_5

REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
PHASES = ("e2e_request_latency_seconds", "request_queue_time_seconds",
          "request_prefill_time_seconds", "request_decode_time_seconds",
          "request_inference_time_seconds")


def _families(http) -> dict:
    text = http.get("/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(f"jaxserve:{name}", 0) - before.get(f"jaxserve:{name}", 0)


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_buckets_1_2_5():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)


def test_series_names_types_labels_and_buckets(http, server):
    _complete(http, max_tokens=3)
    families = _families(http)
    tokens = [float(b) for b in buckets_1_2_5(server.engine.engine.max_model_len)]
    histograms = {
        "time_to_first_token_seconds": TTFT,
        "inter_token_latency_seconds": TOKEN_LATENCY,
        "request_time_per_output_token_seconds": TOKEN_LATENCY,
        **{name: REQUEST_LATENCY for name in PHASES},
        "request_prompt_tokens": tokens,
        "request_generation_tokens": tokens,
        "request_max_num_generation_tokens": tokens,
        "request_params_max_tokens": tokens,
        "request_params_n": [1.0, 2.0, 5.0, 10.0, 20.0],
        "iteration_tokens_total": [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
                                   2048.0, 4096.0, 8192.0, 16384.0],
    }
    for name, buckets in histograms.items():
        family = families[f"jaxserve:{name}"]
        assert family.type == "histogram", name
        les = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        assert les == [*map(str, buckets), "+Inf"], name
        assert {s.labels["model_name"] for s in family.samples} == {MODEL}, name
    for name in ("prompt_tokens", "generation_tokens", "num_preemptions", "num_compilations",
                 "prefix_cache_queries", "prefix_cache_hits", "request_success"):
        family = families[f"jaxserve:{name}"]
        assert family.type == "counter", name
        assert {s.labels["model_name"] for s in family.samples} == {MODEL}, name
    reasons = {s.labels["finished_reason"] for s in families["jaxserve:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort"}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert families[f"jaxserve:{name}"].type == "gauge", name


def test_cache_config_info_and_prefix_cache_counters(http, server):
    (sample,) = _families(http)["jaxserve:cache_config_info"].samples
    runner = server.engine.engine.runner
    assert sample.value == 1
    assert sample.labels == {"block_size": "8", "num_gpu_blocks": "256",
                             "num_gpu_blocks_override": "256",
                             "cache_dtype": runner.kv_dtype_name,
                             "enable_prefix_caching": "True"}
    # the same prompt twice, one after the other: the second finds the first's full pages
    # (page_size 8: all but the page holding its last token)
    wait_idle(server)
    before = metrics_of(http)
    seen = [before]
    for _ in range(2):
        n = _complete(http, max_tokens=2, prompt="Once upon a time there was a little dog "
                      "who lived in a house by the sea with his friend the cat.")["usage"][
            "prompt_tokens"]
        seen.append(metrics_of(http))
    queries, hits = ([b[f"jaxserve:prefix_cache_{k}_total"] - a[f"jaxserve:prefix_cache_{k}_total"]
                      for a, b in itertools.pairwise(seen)] for k in ("queries", "hits"))
    assert queries == [n, n]
    assert hits[1] == (n - 1) // 8 * 8 > 0 and hits[0] in (0, hits[1])  # 0: not cached before


def _one_at_a_time(http, server, k: int, max_tokens: int) -> tuple[dict, dict, int]:
    """k requests one after another: /metrics before and after, and the prompt's tokens."""
    wait_idle(server)
    before = metrics_of(http)
    for _ in range(k):
        usage = _complete(http, max_tokens=max_tokens, ignore_eos=True)["usage"]
    # the engine thread counts an iteration's tokens after handing its outputs over, and then
    # publishes its stats: idle stats mean the last iteration is counted, a response does not
    wait_idle(server)
    return before, metrics_of(http), usage["prompt_tokens"]


def test_counts_per_request(http, server):
    """As vLLM's test_metrics_counts: each series moves by one per request, by its tokens."""
    k, max_tokens = 3, 5
    before, after, prompt = _one_at_a_time(http, server, k, max_tokens)

    def delta(name):
        return _delta(before, after, name)

    assert delta("request_prompt_tokens_count") == k
    assert delta("request_prompt_tokens_sum") == k * prompt
    assert delta("request_generation_tokens_count") == k
    assert delta("request_generation_tokens_sum") == k * max_tokens
    assert delta("request_params_max_tokens_sum") == k * max_tokens
    assert delta("request_params_max_tokens_count") == k
    assert delta("request_params_n_count") == k and delta("request_params_n_sum") == k
    assert delta("request_max_num_generation_tokens_sum") == k * max_tokens
    assert delta("prompt_tokens_total") == k * prompt
    assert delta("generation_tokens_total") == k * max_tokens
    assert delta('request_success_total{finished_reason="length"}') == k
    assert delta("time_to_first_token_seconds_count") == k
    assert delta("inter_token_latency_seconds_count") == k * (max_tokens - 1)
    for name in (*PHASES, "request_time_per_output_token_seconds"):
        assert delta(f"{name}_count") == k, name
        assert delta(f"{name}_sum") >= 0, name
    queue, prefill, decode, inference, e2e = (
        delta(f"{name}_sum") for name in ("request_queue_time_seconds",
                                          "request_prefill_time_seconds",
                                          "request_decode_time_seconds",
                                          "request_inference_time_seconds",
                                          "e2e_request_latency_seconds"))
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert e2e == pytest.approx(queue + inference, abs=1e-6)
    # each request's time per output token is its decode time over the tokens after the first
    tpot = delta("request_time_per_output_token_seconds_sum")
    assert tpot * (max_tokens - 1) == pytest.approx(decode, abs=1e-6)


def test_iteration_tokens_per_step(http, server):
    """A request alone gives one step per token: its prompt in one chunk (counted with the first
    token it gives), then a decode step per token: prompt + max_tokens over its steps, as vLLM."""
    k, max_tokens = 2, 5
    before, after, prompt = _one_at_a_time(http, server, k, max_tokens)
    assert _delta(before, after, "iteration_tokens_total_count") == k * max_tokens
    assert _delta(before, after, "iteration_tokens_total_sum") == k * (prompt + max_tokens)


def test_n_and_max_tokens_per_prompt_and_per_sample(http, server):
    """request_params_n and the most tokens generated are observed once per prompt of n
    samples; max_tokens and the per-request histograms once per sample."""
    wait_idle(server)
    before = metrics_of(http)
    _complete(http, prompt=[PROMPT, "The little dog"], n=2, max_tokens=4, ignore_eos=True)
    after = metrics_of(http)

    def delta(name):
        return _delta(before, after, name)

    assert delta("request_params_n_count") == 2 and delta("request_params_n_sum") == 4
    assert delta("request_max_num_generation_tokens_count") == 2
    assert delta("request_max_num_generation_tokens_sum") == 8
    assert delta("request_params_max_tokens_count") == 4
    assert delta("request_params_max_tokens_sum") == 16
    assert delta("request_generation_tokens_count") == 4
    assert delta("e2e_request_latency_seconds_count") == 4


def test_unset_max_tokens_counts_what_max_model_len_leaves(http, server):
    # as vLLM's server, which sets max_tokens to max_model_len - prompt when a request has none
    vocab = server.engine.engine.model_config.vocab_size
    before = metrics_of(http)
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "stop_token_ids": list(range(vocab))})  # stops at the first token
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    prompt = r.json()["usage"]["prompt_tokens"]
    after = metrics_of(http)
    assert _delta(before, after, "request_params_max_tokens_count") == 1
    assert _delta(before, after, "request_params_max_tokens_sum") == (
        server.engine.engine.max_model_len - prompt)
    assert _delta(before, after, 'request_success_total{finished_reason="stop"}') == 1
    assert _delta(before, after, "request_time_per_output_token_seconds_sum") == 0  # one token


def test_an_aborted_request_counts_as_abort_only(http, server):
    wait_idle(server)
    before = metrics_of(http)
    abandon_while_running(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 490,
                                   "ignore_eos": True})
    wait_idle(server)
    after = metrics_of(http)
    assert _delta(before, after, 'request_success_total{finished_reason="abort"}') == 1
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", *PHASES):
        assert _delta(before, after, f"{name}_count") == 0, name
