"""vLLM's OpenAI-server tests, ported (tests/demo_server.py says which and how): sampling
parameters, request errors and /metrics."""

import asyncio
import time

import openai
import pytest
from demo_server import (
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    bad_request,
    wait_idle,
)
from served import KEY, metrics_of


@pytest.fixture(scope="module")
def server(demo):
    """The demo server (conftest.py's `demo`), for conftest's `client` and `http`."""
    return demo


# -- sampling parameters and request errors ----------------------------------------------------


def _greedy(client, **body) -> str:
    return client.completions.create(model=MODEL, prompt="def main(", max_tokens=40,
                                     temperature=0.0, **body).choices[0].text


def test_stop_strings(client):
    full = _greedy(client)
    stop = full[20:26]
    at = full.find(stop)
    for include, text in ((False, full[:at]), (True, full[:at + len(stop)])):
        choice = client.completions.create(
            model=MODEL, prompt="def main(", max_tokens=40, temperature=0.0, stop=[stop],
            extra_body={"include_stop_str_in_output": include}).choices[0]
        assert (choice.text, choice.finish_reason, choice.stop_reason) == (text, "stop", stop)


def test_stop_token_ids(client):
    full = _greedy(client)
    stop = full[12]  # a byte: its token id is its value
    at = full.find(stop)
    for include, text in ((False, full[:at]), (True, full[:at + 1])):
        completion = client.completions.create(
            model=MODEL, prompt="def main(", max_tokens=40, temperature=0.0,
            extra_body={"stop_token_ids": [ord(stop)], "include_stop_str_in_output": include})
        choice = completion.choices[0]
        assert (choice.text, choice.finish_reason, choice.stop_reason) == \
            (text, "stop", ord(stop))
        assert completion.usage.completion_tokens == at + 1  # the stop token is generated


def test_max_tokens_and_max_completion_tokens(client):
    def chat_tokens(**limits) -> int:
        return client.chat.completions.create(
            model=MODEL, messages=CHAT, extra_body={"ignore_eos": True},
            **limits).usage.completion_tokens

    assert chat_tokens(max_tokens=3) == 3
    assert chat_tokens(max_completion_tokens=4) == 4
    assert chat_tokens(max_tokens=3, max_completion_tokens=4) == 4  # the newer name wins
    # unset: completions generate 16 tokens, chats up to max_model_len
    assert client.completions.create(model=MODEL, prompt="x", extra_body={"ignore_eos": True}
                                     ).usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=CHAT,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.total_tokens == MAX_MODEL_LEN


def test_a_prompt_too_long_for_the_model_is_400(client):
    long, near = "x" * (MAX_MODEL_LEN + 44), "x" * (MAX_MODEL_LEN - 56)
    bad_request(lambda: client.completions.create(model=MODEL, prompt=long, max_tokens=5),
                "prompt")
    bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long}]), "messages")
    bad_request(lambda: client.completions.create(model=MODEL, prompt=near,
                                                   max_tokens=100), "max_tokens")
    bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": near}],
        max_completion_tokens=100), "max_completion_tokens")


def test_model_names(client, http):
    for name in (MODEL, ""):  # "" is the served model, as vLLM's
        completion = client.completions.create(model=name, prompt="x", max_tokens=2)
        assert completion.model == MODEL
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model" and info.value.body["code"] == 404


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("n", 0),
    ("max_tokens", 0), ("max_tokens", -1), ("logprobs", -2), ("seed", "7"),
    ("stop", [1]), ("stream", "yes"),
])
def test_invalid_sampling_parameters_are_400(http, field, value):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_chat_top_logprobs_needs_logprobs(client):
    bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT,
                                                        max_tokens=2, top_logprobs=2),
                 "top_logprobs")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_400_naming_them(http, path):
    body = {"model": MODEL, "max_tokens": 2, "no_such_field": 1}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field", r.text


def test_a_seed_reproduces_sampling(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="def ", max_tokens=30,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


# -- metrics ------------------------------------------------------------------------------------

# vLLM's EXPECTED_METRICS_V1 less its hidden deprecated ones, with jaxserve's prefix
EXPECTED_METRICS = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions_total",
    "prompt_tokens_total", "generation_tokens_total", "iteration_tokens_total",
    "cache_config_info", "request_success_total",
    *(f"{name}_{suffix}" for name in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n",
        "request_params_max_tokens", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds")
      for suffix in ("sum", "bucket", "count")),
]


def test_metrics_exist(client, http):
    client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5,
                              temperature=0.0)
    r = http.get("/metrics")
    assert r.status_code == 200
    missing = [name for name in EXPECTED_METRICS if f"jaxserve:{name}" not in r.text]
    assert not missing


def test_metrics_counts(client, http):
    prompt_ids = list(b"Hello my name is Robert and I")  # one prefill chunk (32 tokens)
    num_requests, max_tokens, p = 10, 10, len(prompt_ids)
    before = wait_idle(http)
    for _ in range(num_requests):
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
    # the engine thread counts an iteration's tokens after handing its outputs over, and then
    # publishes its stats: idle means the last iteration is counted, a response does not
    after = wait_idle(http)
    expected = {
        "time_to_first_token_seconds_count": num_requests,
        "inter_token_latency_seconds_count": num_requests * (max_tokens - 1),
        "e2e_request_latency_seconds_count": num_requests,
        "request_queue_time_seconds_count": num_requests,
        "request_inference_time_seconds_count": num_requests,
        "request_prefill_time_seconds_count": num_requests,
        "request_decode_time_seconds_count": num_requests,
        "request_prompt_tokens_sum": num_requests * p,
        "request_prompt_tokens_count": num_requests,
        "request_generation_tokens_sum": num_requests * max_tokens,
        "request_generation_tokens_count": num_requests,
        "request_params_n_count": num_requests,
        "request_params_max_tokens_sum": num_requests * max_tokens,
        "request_params_max_tokens_count": num_requests,
        # vLLM's step counts a prompt's tokens and the first token it gives, then one per step
        "iteration_tokens_total_sum": num_requests * (p + max_tokens),
        "iteration_tokens_total_count": num_requests * max_tokens,
        "prompt_tokens_total": num_requests * p,
        "generation_tokens_total": num_requests * max_tokens,
        'request_success_total{finished_reason="length"}': num_requests,
    }
    got = {name: after[f"jaxserve:{name}"] - before[f"jaxserve:{name}"] for name in expected}
    assert got == expected


def test_abort_metrics_reset(server, http):
    def running() -> tuple[float, float, float]:
        m = metrics_of(http)
        return (m["jaxserve:num_requests_running"], m["jaxserve:num_requests_waiting"],
                m["jaxserve:kv_cache_usage_perc"])

    before = wait_idle(http)  # vLLM asserts 0 at once; an earlier test's aborts take their time

    async def start_then_abort() -> tuple[float, float, float]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                      max_retries=0) as aclient:
            # n=8: 24 sequences for 8 slots, so that they run (and wait) long enough to be
            # seen on a fast machine too
            tasks = [asyncio.ensure_future(aclient.completions.create(
                model=MODEL, prompt=list(b"Hello my name is Robert and I love magic"),
                max_tokens=200, n=8, extra_body={"ignore_eos": True})) for _ in range(3)]
            deadline = time.monotonic() + 60
            while (busy := await asyncio.to_thread(running))[0] == 0:
                assert time.monotonic() < deadline, "the requests never ran"
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return busy

    busy = asyncio.run(start_then_abort())
    assert busy[0] > 0 and busy[2] > 0
    # vLLM waits a second, then asserts; here the wait is a hang's bound, and the aborts are
    # checked by their count: 24 sequences of 200 tokens for 8 slots, cancelled as soon as
    # they run, cannot all have finished (which would zero the gauges without an abort)
    after = wait_idle(http)
    assert running() == (0, 0, 0)
    abort = 'jaxserve:request_success_total{finished_reason="abort"}'
    assert after.get(abort, 0) > before.get(abort, 0)
