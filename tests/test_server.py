"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1, driven by the official
`openai` client and by httpx: outputs equal to `LLM.generate`, every error path (each followed by
a request that succeeds), disconnects and a bounded load test (the CLI: test_cli.py)."""

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from conftest import SERVER_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.server import ServerConfig, build_app

MODEL = "stories"
KEY = "sk-jaxserve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"
BODY_LIMIT = 64 << 10


@contextlib.contextmanager
def _uvicorn(app):
    """uvicorn in a thread on a free port of 127.0.0.1; yields the base URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                           lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def reference(stories_dir):
    # Built before the server's engine: the runner counts compilations process-wide, and the
    # server must show none after its own warm-up.
    return LLM(stories_dir, **SERVER_ENGINE)


@pytest.fixture(scope="module")
def server(stories_dir, reference):
    engine = AsyncEngine(LLMEngine(stories_dir, EngineConfig.from_overrides(**SERVER_ENGINE)))
    app = build_app(engine, ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT), MODEL)
    with _uvicorn(app) as url:
        yield SimpleNamespace(url=url, engine=engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def _greedy(reference, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return reference.generate(prompt, params)[0].outputs[0]


def _metrics(http) -> dict[str, float]:
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
    return values


def _succeeds(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def _assert_error(r, status, param=None, text=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    if text is not None:
        assert text in error["message"]


def _wait_idle(server, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if not stats["num_requests_running"] and not stats["num_requests_waiting"]:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {server.engine.stats()}")


# -- the openai client -------------------------------------------------------------------------


def test_completion_equals_llm_generate_with_usage(client, reference):
    want = _greedy(reference, PROMPT, 24)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    prompt_tokens = len(reference.get_tokenizer().encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens, 24, prompt_tokens + 24)


def test_completion_stream_with_usage(client, reference):
    want = _greedy(reference, PROMPT, 40)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_llm_generate_streaming_or_not(client, reference):
    messages = [{"role": "user", "content": "Tell me a story."}]
    template = reference.get_tokenizer().apply_chat_template(messages)
    want = _greedy(reference, template, 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens == len(reference.get_tokenizer().encode(template))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_are_honoured(client, reference):
    full = _greedy(reference, PROMPT, 30).text
    stop = full.split()[4]  # a word from the middle of the greedy text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_prompt_lists_token_ids_echo_and_logprobs(client, reference):
    prompts = [PROMPT, "The little dog"]
    want = [_greedy(reference, p, 8).text for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert r.usage.completion_tokens == 16
    ids = [reference.get_tokenizer().encode(p) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == want[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                  echo=True, logprobs=2)
    for choice, prompt, text in zip(sorted(r.choices, key=lambda c: c.index), prompts, want,
                                    strict=True):
        assert choice.text.endswith(text) and choice.text.startswith(prompt)
        generated = choice.logprobs.token_logprobs[-8:]
        assert len(generated) == 8 and all(lp <= 0 for lp in generated)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_logprob_tokens_spell_the_text_streamed_or_not(http):
    """Each token carries its leading space, so the tokens join into the text; offsets point
    into it, the same streamed as not; chat's bytes rebuild the content."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    lps = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens, text = lps["logprobs"]["tokens"], lps["text"]
    assert "".join(tokens) == text
    assert lps["logprobs"]["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for top, token in zip(lps["logprobs"]["top_logprobs"], tokens, strict=True):
        assert len(top) >= 3 and token in top  # distinct tokens keep distinct names
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lps["logprobs"]["text_offset"]
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert bytes(b for t in content for b in t["bytes"]).decode() == chat["message"]["content"]


def test_n_samples_per_prompt_numbered_as_openai(client, reference):
    # choice i is sample i % n of prompt i // n, the request seeded seed + i % n; the usage
    # counts each prompt once
    prompts = [PROMPT, "The little dog"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=1.0,
                                  seed=3, n=2)
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    completion_tokens = 0
    for choice in choices:
        prompt, sample = divmod(choice.index, 2)
        want = reference.generate(prompts[prompt], SamplingParams(
            max_tokens=6, temperature=1.0, seed=3 + sample))[0].outputs[0]
        assert choice.text == want.text
        completion_tokens += len(want.token_ids)
    tokenizer = reference.get_tokenizer()
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == completion_tokens
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0, n=3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1 and texts[0]


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "num_compilations_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total",
                 "generation_tokens_total"):
        assert f"jaxserve:{name}" in r.text


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
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty"),
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
], ids=lambda x: x if isinstance(x, str) else None)
def test_invalid_field_is_400_naming_it(http, path, body, param):
    content = json.dumps(body)  # ASCII: a lone surrogate travels escaped, as JSON allows
    _assert_error(http.post(path, content=content, headers={"Content-Type": "application/json"}),
                  400, param)
    _succeeds(http)


def test_invalid_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"prompt": "Once',
                  headers={"Content-Type": "application/json"})
    _assert_error(r, 400, None, "JSON")
    _assert_error(http.post("/v1/completions", json=[1, 2]), 400, None, "object")
    r = http.post("/v1/completions", content=b"[" * 20_000,  # nested past Python's recursion
                  headers={"Content-Type": "application/json"})
    _assert_error(r, 400, None, "JSON")
    _succeeds(http)


def test_errors_speak_the_clients_field_names(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "max_completion_tokens": 0})
    _assert_error(r, 400, "max_completion_tokens", "max_completion_tokens must be")
    _succeeds(http)


def test_a_failing_chat_template_is_400_messages(server, http, monkeypatch):
    def broken(messages, add_generation_prompt=True):  # as a template's tojson of Undefined
        raise TypeError("Object of type Undefined is not JSON serializable")

    monkeypatch.setattr(server.engine.engine.tokenizer, "apply_chat_template", broken)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    _assert_error(r, 400, "messages", "chat template")
    _succeeds(http)


def test_top_k_past_the_vocabulary_is_no_cut(http):
    """top_k 2**31 does not fit the step's int32 array; it means no cut, and the engine lives."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    plain = http.post("/v1/completions", json=body)
    huge = http.post("/v1/completions", json=body | {"top_k": 2**31})
    assert plain.status_code == huge.status_code == 200, huge.text
    assert huge.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    _succeeds(http)


def test_prompt_plus_max_tokens_over_max_model_len_is_400_with_the_numbers(http, client):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 600})
    _assert_error(r, 400, "max_tokens", "max_tokens (600) exceeds max_model_len 512")
    with pytest.raises(openai.BadRequestError) as err:  # as the openai client sees it
        client.chat.completions.create(model=MODEL, max_tokens=600,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 400 and "512" in str(err.value)
    _succeeds(http)


def test_unknown_model_is_404(http):
    _assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT}),
                  404, "model", "gpt-9")
    _assert_error(http.get("/v1/nothing"), 404)
    _succeeds(http)


def test_api_key_is_401_when_missing_or_wrong_and_open_paths_stay_open(server, http):
    body = {"prompt": PROMPT, "max_tokens": 4}
    _assert_error(httpx.post(server.url + "/v1/completions", json=body), 401)
    _assert_error(httpx.post(server.url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}x"}), 401)
    _assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    _succeeds(http)


def test_body_over_limit_is_413(http):
    _assert_error(http.post("/v1/completions", json={"prompt": "a" * (BODY_LIMIT + 1)}), 413)
    _succeeds(http)


def test_full_waiting_queue_is_429_with_retry_after(server, http):
    server.engine.max_waiting_requests = 0  # any request would have to wait
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        _assert_error(r, 429)
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        server.engine.max_waiting_requests = None
    _succeeds(http)


def test_request_timeout_is_504_and_frees_the_request(server, http):
    server.engine.request_timeout_s = 0.05
    try:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 490,
                                               "ignore_eos": True})
        _assert_error(r, 504, None, "request_timeout_s")
    finally:
        server.engine.request_timeout_s = None
    stats = _wait_idle(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    _succeeds(http)


class _BrokenEngine:
    """Just enough of an LLMEngine for AsyncEngine and the app: its first step raises."""

    tokenizer = None
    max_model_len = 64
    model_path = "broken"
    num_steps = 0
    scheduler = SimpleNamespace(waiting=[])

    def __init__(self):
        self.pending = False

    def stats(self):
        return dict(num_requests_running=0, num_requests_waiting=0, kv_cache_usage=0.0,
                    num_preemptions=0, num_compilations_after_warmup=0)

    def add_request(self, *args):
        self.pending = True

    def abort(self, request_id):
        return False

    def has_unfinished_requests(self):
        return self.pending

    def step(self):
        raise RuntimeError("device lost")


def test_dead_engine_is_503_and_touches_no_other_server(http):
    engine = AsyncEngine(_BrokenEngine())
    with _uvicorn(build_app(engine, ServerConfig(), "broken")) as url:
        assert httpx.get(url + "/health").status_code == 200
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        _assert_error(httpx.post(url + "/v1/completions", json=body), 503, None, "dead")
        _assert_error(httpx.get(url + "/health"), 503, None, "device lost")
        _assert_error(httpx.post(url + "/v1/completions", json=body | {"stream": True}), 503)
    _succeeds(http)


# -- disconnects and load ----------------------------------------------------------------------


def test_abort_of_a_non_string_id_is_refused_and_the_engine_lives(server, http):
    with pytest.raises(ValueError, match="request_id must be a string"):
        server.engine.abort(5)
    _succeeds(http)


def test_non_streaming_client_disconnect_aborts(server, http):
    aborted = _metrics(http).get('jaxserve:request_success_total{finished_reason="abort"}', 0)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 490,
                                           "ignore_eos": True}, timeout=0.05)
    stats = _wait_idle(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    after = _metrics(http)['jaxserve:request_success_total{finished_reason="abort"}']
    assert after == aborted + 1
    _succeeds(http)


async def _load(url: str, num_requests: int, drop_every: int):
    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as c:
        async def one(i: int):
            drop = i % drop_every == 0
            max_tokens = 400 if drop else 4 + i % 13
            body = {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0 if i % 2 else 1.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, max_tokens, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if drop and chunk["choices"] and not chunk["choices"][0]["finish_reason"]:
                        return 200, max_tokens, "dropped"  # leaving closes the connection
                    if chunk.get("usage"):
                        return 200, max_tokens, chunk["usage"]["completion_tokens"]
            return r.status_code, max_tokens, None

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def test_load_256_streams_32_dropped(server, http):
    aborted = _metrics(http).get('jaxserve:request_success_total{finished_reason="abort"}', 0)
    results = asyncio.run(_load(server.url, 256, drop_every=8))
    assert all(status == 200 for status, _, _ in results), results
    dropped = [got for _, _, got in results if got == "dropped"]
    assert len(dropped) == 32
    assert all(got == max_tokens for _, max_tokens, got in results if got != "dropped")
    stats = _wait_idle(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    metrics = _metrics(http)
    assert metrics["jaxserve:num_requests_running"] == 0
    assert metrics["jaxserve:num_requests_waiting"] == 0
    assert metrics["jaxserve:kv_cache_usage_perc"] == 0
    assert metrics["jaxserve:num_compilations_total"] == 0
    assert metrics['jaxserve:request_success_total{finished_reason="abort"}'] == aborted + 32
    _succeeds(http)
