"""Every error path of the server: status, envelope and the field it names, each followed by a
request that succeeds."""

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fake_engine import BrokenEngine
from served import (
    AUTH,
    BODY_LIMIT,
    KEY,
    MODEL,
    PROMPT,
    assert_error,
    held,
    succeeds,
    uvicorn_url,
    wait_idle,
)

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server import ServerConfig, build_app, protocol

# -- errors: status and envelope, then a request that succeeds ---------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": "two"}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1000}, "logprobs"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [999999]]}, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 10**400}, "temperature"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),  # a lone surrogate: valid JSON
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/completions", {"prompt": [99999], "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["x"] * 65}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "n": 129}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT * 200}]},
     "messages"),
    # vLLM's sampler controls and structured output out of their ranges (test_server_sampling.py
    # has the rest), and a field jaxserve does not implement: refused, never silently ignored
    ("/v1/completions", {"prompt": PROMPT, "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "guided_json": 5}, "guided_json"),
    ("/v1/completions", {"prompt": PROMPT, "skip_special_tokens": False}, "skip_special_tokens"),
    # tools sent without a tool_choice mean "auto" (vLLM's), which this server (no
    # --enable-auto-tool-choice) cannot read calls for
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "include_stop_str_in_output": 1},
     "include_stop_str_in_output"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_invalid_field_is_400_naming_it(http, path, body, param):
    content = json.dumps(body)  # ASCII: a lone surrogate travels escaped, as JSON allows
    assert_error(http.post(path, content=content, headers={"Content-Type": "application/json"}),
                  400, param)
    succeeds(http)


def test_invalid_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"prompt": "Once',
                  headers={"Content-Type": "application/json"})
    assert_error(r, 400, None, "JSON")
    assert_error(http.post("/v1/completions", json=[1, 2]), 400, None, "object")
    r = http.post("/v1/completions", content=b"[" * 20_000,  # nested past Python's recursion
                  headers={"Content-Type": "application/json"})
    assert_error(r, 400, None, "JSON")
    succeeds(http)


def test_errors_speak_the_clients_field_names(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "max_completion_tokens": 0})
    assert_error(r, 400, "max_completion_tokens", "max_completion_tokens must be")
    succeeds(http)


def test_a_failing_chat_template_is_400_messages(server, http, monkeypatch):
    def broken(messages, add_generation_prompt=True):  # as a template's tojson of Undefined
        raise TypeError("Object of type Undefined is not JSON serializable")

    monkeypatch.setattr(server.engine.engine.tokenizer, "apply_chat_template", broken)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert_error(r, 400, "messages", "chat template")
    succeeds(http)


def test_top_k_past_the_vocabulary_is_no_cut(http):
    """top_k 2**31 does not fit the step's int32 array; it means no cut, and the engine lives."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    plain = http.post("/v1/completions", json=body)
    huge = http.post("/v1/completions", json=body | {"top_k": 2**31})
    assert plain.status_code == huge.status_code == 200, huge.text
    assert huge.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    succeeds(http)


def test_prompt_plus_max_tokens_over_max_model_len_is_400_with_the_numbers(http, client):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 600})
    assert_error(r, 400, "max_tokens", "max_tokens (600) exceeds max_model_len 512")
    with pytest.raises(openai.BadRequestError) as err:  # as the openai client sees it
        client.chat.completions.create(model=MODEL, max_tokens=600,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 400 and "512" in str(err.value)
    succeeds(http)


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT}),
                  404, "model", "gpt-9")
    assert_error(http.get("/v1/nothing"), 404)
    succeeds(http)


def test_api_key_is_401_when_missing_or_wrong_and_open_paths_stay_open(server, http):
    body = {"prompt": PROMPT, "max_tokens": 4}
    assert_error(httpx.post(server.url + "/v1/completions", json=body), 401)
    assert_error(httpx.post(server.url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}x"}), 401)
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    succeeds(http)


def test_body_over_limit_is_413(http):
    assert_error(http.post("/v1/completions", json={"prompt": "a" * (BODY_LIMIT + 1)}), 413)
    succeeds(http)


def test_full_waiting_queue_is_429_with_retry_after(server, http):
    """max_waiting_requests counts the requests that would wait for a slot: with the limit 0 a
    free slot still takes a request at once, and with every slot busy one more is a 429."""
    limit, server.engine.max_waiting_requests = server.engine.max_waiting_requests, 0
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    try:
        succeeds(http)
        with ThreadPoolExecutor(8) as pool:
            # held: none of the 8 advances before all 8 came, nor finishes before the 9th's
            # answer, however the machine staggers them
            with held(server, 8):
                busy = [pool.submit(httpx.post, server.url + "/v1/completions", json=body,
                                    headers=AUTH, timeout=60) for _ in range(8)]
                deadline = time.monotonic() + 60
                while server.engine.stats()["num_requests_running"] < 8:
                    assert time.monotonic() < deadline, server.engine.stats()
                    time.sleep(0.002)
                r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                assert_error(r, 429)
                assert int(r.headers["Retry-After"]) >= 1
            assert [f.result().status_code for f in busy] == [200] * 8
    finally:
        server.engine.max_waiting_requests = limit
    succeeds(http)


def test_more_samples_than_the_server_ever_admits_is_400_not_429(server, http):
    """n x prompts past max_num_seqs + max_waiting_requests could never start together: a 429
    would be retried for ever."""
    limit, server.engine.max_waiting_requests = server.engine.max_waiting_requests, 2
    try:
        assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                        "n": 11}), 400, "n", "max_num_seqs")
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 10})
        assert r.status_code == 200 and len(r.json()["choices"]) == 10
    finally:
        server.engine.max_waiting_requests = limit
    succeeds(http)


def test_echo_logprobs_without_prompt_logprobs_is_400(server, http, monkeypatch):
    engine = server.engine.engine
    monkeypatch.setattr(engine, "config",
                        dataclasses.replace(engine.config, enable_prompt_logprobs=False))
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1}
    assert_error(http.post("/v1/completions", json=body), 400, "echo", "enable_prompt_logprobs")
    assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 0}),
                 400, "prompt_logprobs")
    r = http.post("/v1/completions", json={**body, "logprobs": None})  # echo alone is fine
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(PROMPT)


def test_chat_text_parts_join_with_new_lines():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    req = protocol.parse_chat({"messages": [{"role": "user", "content": parts}]})
    assert req.messages[0]["content"] == "Hello\nworld"


def test_request_timeout_is_504_and_frees_the_request(server, http):
    server.engine.request_timeout_s = 0.05
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 490,
                                               "ignore_eos": True})
        assert_error(r, 504, None, "request_timeout_s")
    finally:
        server.engine.request_timeout_s = None
    stats = wait_idle(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    succeeds(http)


def test_dead_engine_is_503_and_touches_no_other_server(http):
    """Every client of a dead engine gets a 503, its gauges read zero, and `on_death` hears of
    it (`serve` then exits 1, for a supervisor to restart it)."""
    engine = AsyncEngine(BrokenEngine())
    deaths = []
    engine.on_death = deaths.append
    with uvicorn_url(build_app(engine, ServerConfig(), "broken")) as url:
        assert httpx.get(url + "/health").status_code == 200
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        assert_error(httpx.post(url + "/v1/completions", json=body), 503, None, "dead")
        assert_error(httpx.get(url + "/health"), 503, None, "device lost")
        assert_error(httpx.post(url + "/v1/completions", json=body | {"stream": True}), 503)
    deadline = time.monotonic() + 60  # the engine thread hears of it last, after every client
    while not deaths:
        assert time.monotonic() < deadline, "on_death was not called"
        time.sleep(0.01)
    assert [str(e) for e in deaths] == ["device lost"]
    assert engine.stats()["num_requests_running"] == 0
    succeeds(http)


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 5}
    left_out = protocol.parse_completion({"model": "m", "prompt": "x"}, defaults).params
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 5)
    given = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "temperature": 0, "top_p": 0.5, "top_k": -1}, defaults).params
    assert (given.temperature, given.top_p, given.top_k) == (0, 0.5, None)
    plain = protocol.parse_completion({"model": "m", "prompt": "x"}).params
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, None)
