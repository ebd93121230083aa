"""jaxserve's port of vLLM's OpenAI-server tests (vllm-project/vllm, tests/entrypoints/openai/),
run with the official `openai` client and httpx against one `jaxserve serve` subprocess on the
built-in demo model (byte-level tokenizer, served as "demo"). Same checks as vLLM's, our code;
where vLLM's model does something the demo cannot (stop on its own, end samples at different
lengths), the request gets a stop string so that the assertion keeps its meaning.

Ported (vLLM file: its cases):
- basic/test_basic.py: check_health, request_cancellation, request_wrong_content_type.
- chat_completion/test_root_path.py: the API key cases (a wrong key is 401, the right one serves).
- models (`client.models.list()`): the served name, its root and max_model_len.
- completion/test_completion.py: single_completion, no/zero/some_logprobs,
  too_many_completion_logprobs, prompt_logprobs_completion (-1, 0, 1, None),
  completion_streaming, parallel_no_streaming, parallel_streaming, completion_stream_options,
  batch_completions (n=2 by seeded sampling: beam search is not ours),
  echo_logprob_completion, and truncate_prompt_tokens (its left side: the only side we have).
- completion/test_completion_text_offset.py: streamed text offsets equal the whole response's.
- completion/test_prompt_validation.py, test_empty_prompt_list.py, test_completion_error.py:
  a missing or empty prompt, token ids outside the vocabulary, negative token ids: 400.
- chat_completion/test_chat.py: no/zero/some_logprobs_chat, too_many_chat_logprobs,
  prompt_logprobs_chat, more_than_one_prompt_logprobs_chat, single_chat_session,
  chat_streaming, chat_completion_stream_options, extra_fields_allowed (in a message),
  complex_message_content, custom_role, long_seed, response_format_text, the n parameter.
- chat_completion/test_chat_echo.py: echo with continue_final_message, prompt_logprobs of -1,
  top_logprobs of -1 (the server runs with max_top_logprobs = the vocabulary, as vLLM's with
  --max-logprobs; the limit itself is tested one past it).
- chat_completion/test_chat_stop_token_ids_validation.py: valid, out of vocabulary, negative.
- chat_completion/test_non_object_body_validation.py: a body that is no JSON object is a 400.
- basic/test_chat_template.py, as the server shows it: add_generation_prompt and
  continue_final_message change the rendered prompt (counted in usage); both true is a 400.
- test_metrics.py: metrics_exist, metrics_counts, abort_metrics_reset (`jaxserve:` for `vllm:`).
- Behaviour vLLM's server has and these files assume: stop strings, stop_token_ids and
  include_stop_str_in_output, max_tokens / max_completion_tokens and their defaults, a prompt
  too long for max_model_len, a bad model name (404; "" is the served model), invalid
  sampling parameters, seeded sampling reproduces. Unknown request fields are a 400 naming
  them: jaxserve's rule (issue 36), where vLLM ignores them with a warning.

Not ported, because jaxserve does not have the feature:
- LoRA adapters (the zephyr-lora cases, test_lora_resolvers, test_default_mm_loras).
- tools, function calling, reasoning and harmony parsing (most of test_serving_chat.py,
  test_completion_with_function_calling, tool_choice, reasoning effort, thinking budgets).
- structured outputs / guided decoding / response_format json (the structured_outputs_*,
  invalid_json_schema/regex/grammar and response_format_json_* cases), logit_bias
  (test_chat_logit_bias_validation), min_tokens, min_characters, return_token_ids,
  logprob_token_ids, truncation_side "right", beam search, prompt embeds: each is refused
  with a 400 naming it, which test_protocol_surface.py checks.
- multimodal input (vision, audio, video, image embeds; the metrics' multimodal server).
- endpoints: embeddings, score, transcription, tokenize/detokenize, /version, /load,
  /invocations, run_batch, --root-path.
- prompt_tokens_details.cached_tokens: no prefix cache yet (issue 31).
- vLLM internals tested through mocks (finish_reason "error", a sampled token missing from its
  top logprobs, _usage_prompt_tokens, hidden deprecated metrics): no such objects here; where
  the behaviour shows over HTTP it is ported above.
- test_shutdown.py: SIGTERM on `jaxserve serve` (in-flight requests finish, late ones get 503
  events, exit 0) is tested in test_cli.py and test_hostile.py.
"""

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from conftest import SERVER_ENGINE_FLAGS
from served import metrics_of

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo"
KEY = "sk-vllm-port"
VOCAB = 258  # the demo's byte vocabulary: 256 bytes, then BOS (256) and EOS (257)
MAX_MODEL_LEN = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

CHAT = [{"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is 1+1?"}]
DIALOGUE = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series."},
            {"role": "user", "content": "Where was it played?"}]
SAYING = "Here is a common saying about apple. An apple a day, keeps"


def _prompt_tokens(text: str) -> int:
    """A text prompt's tokens on the demo: BOS, then one token per UTF-8 byte."""
    return 1 + len(text.encode())


def _rendered(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The demo's chat prompt: it ships no template, so jaxserve's fallback renders it."""
    return ("".join(f"{m['role']}: {m['content']}\n" for m in messages)
            + ("assistant: " if add_generation_prompt else ""))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`jaxserve serve` (the demo model) in a subprocess on a free port, with an API key and
    the test engine's small flags; its output goes to a file (a pipe nobody reads would fill
    and stall it)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port),
             "--api-key", KEY, "--max-top-logprobs", str(VOCAB), "--enable-prompt-logprobs",
             *SERVER_ENGINE_FLAGS],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, \
                "jaxserve serve did not start:\n" + log.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield SimpleNamespace(url=url, proc=proc, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as c:
        yield c


def _bad_request(call, param: str | None) -> str:
    """`call()` raises openai's BadRequestError naming `param`; its message."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


def _wait_idle(http, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_of(http)
        if (m["jaxserve:num_requests_running"] == m["jaxserve:num_requests_waiting"] == 0
                and m["jaxserve:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, f"the engine is not idle: {m}"
        time.sleep(0.05)


# -- basic: health, models, API key, bodies, cancellation ---------------------------------------


def test_health_is_200(server):
    assert httpx.get(server.url + "/health").status_code == 200


def test_models_list_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id == MODEL and Path(models[0].root).is_dir()
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_api_key_guards_v1_only(server, client):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="abc", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_wrong_content_type_is_refused(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert info.value.status_code in (400, 415)


@pytest.mark.parametrize("body", [b"this is not valid json{{{", b'["not", "an", "object"]',
                                  b"42", b"null"])
def test_a_body_that_is_no_json_object_is_400(http, body):
    r = http.post("/v1/chat/completions", content=body,
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_cancelled_requests_leave_the_server_responsive(server, client, http):
    """Requests whose clients time out are aborted: the server answers the next one at once."""
    story = dict(model=MODEL, messages=[{"role": "user", "content": "Write a long story"}])
    start = time.monotonic()
    client.chat.completions.create(**story, max_tokens=200, extra_body={"ignore_eos": True})
    # a quarter of what one request takes alone (32 together take longer): none can finish,
    # whatever this machine's speed
    timeout = max(0.05, (time.monotonic() - start) / 4)

    async def flood() -> list[BaseException | None]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=timeout) as hasty:
            return await asyncio.gather(*(hasty.chat.completions.create(
                **story, max_tokens=200, extra_body={"ignore_eos": True}) for _ in range(32)),
                return_exceptions=True)

    results = asyncio.run(flood())
    assert all(isinstance(r, openai.APITimeoutError) for r in results), results
    _wait_idle(http)
    patient = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=5)
    assert len(patient.chat.completions.create(**story, max_tokens=10).choices) == 1


# -- completions --------------------------------------------------------------------------------


def test_single_completion(client):
    completion = client.completions.create(model=MODEL, prompt="Hello, my name is",
                                           max_tokens=5, temperature=0.0)
    assert completion.id and len(completion.choices) == 1
    choice = completion.choices[0]
    assert len(choice.text) >= 5 and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == _prompt_tokens("Hello, my name is")
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5

    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 1
    assert getattr(completion.choices[0], "prompt_logprobs", None) is None


@pytest.mark.parametrize(("logprobs", "sizes"), [(None, None), (0, (1, 1)), (5, (5, 6))])
def test_completion_logprobs(client, logprobs, sizes):
    choice = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                       temperature=0.0, logprobs=logprobs).choices[0]
    if sizes is None:
        assert choice.logprobs is None
        return
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs) == 5
    assert sizes[0] <= len(choice.logprobs.top_logprobs[0]) <= sizes[1]


def test_too_many_completion_logprobs(client):
    for stream in (False, True):
        _bad_request(lambda stream=stream: client.completions.create(
            model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, logprobs=VOCAB + 1,
            stream=stream), "logprobs")
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5)
    assert completion.choices[0].finish_reason is not None  # the server still works


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, prompt_logprobs):
    prompts = ["A robot may not injure another robot", "My name is"]
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    completion = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2,
                                           extra_body=extra)
    for prompt, choice in zip(prompts, completion.choices, strict=True):
        entries = getattr(choice, "prompt_logprobs", None)
        if prompt_logprobs is None:
            assert entries is None
            continue
        assert len(entries) == _prompt_tokens(prompt) and entries[0] is None
        for token, entry in zip(prompt.encode(), entries[1:], strict=True):
            assert str(token) in entry  # the prompt's own token, whatever its rank
            want = VOCAB if prompt_logprobs == -1 else prompt_logprobs
            assert len(entry) in (want, want + 1), entry


def test_completion_streaming(client):
    prompt = "What is an LLM?"
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                       temperature=0.0).choices[0].text
    texts, finished = [], 0
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                           temperature=0.0, stream=True):
        texts.append(chunk.choices[0].text)
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 1  # only in the last chunk
    assert chunk.choices[0].finish_reason == "length" and chunk.choices[0].text
    assert "".join(texts) == single


# the demo rarely ends a sample with EOS within 50 tokens: a stop at the line's end makes the
# samples finish at different lengths, as EOS does for vLLM's model
PARALLEL = dict(prompt="def ", max_tokens=50, n=3, temperature=1.0, seed=42, stop=["\n"])


def test_parallel_sampling_without_streaming(client):
    completion = client.completions.create(model=MODEL, logprobs=0, **PARALLEL)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.finish_reason is not None for c in completion.choices)
    assert len({len(c.logprobs.tokens) for c in completion.choices}) > 1  # ended apart
    assert len({c.text for c in completion.choices}) == 3, [c.text for c in completion.choices]


def test_parallel_sampling_streaming(client):
    texts, tokens, finished = [""] * 3, [0] * 3, 0
    for chunk in client.completions.create(model=MODEL, stream=True, logprobs=0, **PARALLEL):
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        tokens[choice.index] += len(choice.logprobs.tokens)
        finished += choice.finish_reason is not None
    assert finished == 3
    assert all(n <= PARALLEL["max_tokens"] for n in tokens) and len(set(tokens)) > 1
    assert len(set(texts)) == 3, texts


def _usage_is_sum(usage) -> bool:
    return (usage.prompt_tokens > 0 and usage.completion_tokens > 0
            and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens)


def test_completion_stream_options(client):
    def stream(options):
        return iter(client.completions.create(
            model=MODEL, prompt="What is the capital of France?", max_tokens=5,
            temperature=0.0, stream=True, stream_options=options))

    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(chunk.usage is None for chunk in stream(options))

    chunks = stream({"include_usage": True, "continuous_usage_stats": False})
    for chunk in chunks:
        assert chunk.usage is None
        if chunk.choices[0].finish_reason is not None:
            final = next(chunks)
            assert _usage_is_sum(final.usage) and final.choices == []
            break
    else:
        raise AssertionError("no chunk finished")

    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    for chunk in chunks:
        assert _usage_is_sum(chunk.usage)
        if chunk.choices[0].finish_reason is not None:
            final = next(chunks)
            assert _usage_is_sum(final.usage) and final.choices == []
            break
    else:
        raise AssertionError("no chunk finished")

    for options in ({"include_usage": None}, {"include_usage": True},
                    {"continuous_usage_stats": None}, {"continuous_usage_stats": True}):
        _bad_request(lambda options=options: client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, stream=False, stream_options=options),
            "stream_options")


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2])
def test_batch_completions(client, prompts):
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                      temperature=0.0)
    assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text

    # choice i is sample i % n of prompt i // n; sample j's seed is seed + j, so both copies of
    # the prompt draw the same two samples
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=20,
                                      temperature=1.0, seed=7)
    texts = [c.text for c in batch.choices]
    assert len(texts) == 4 and texts[0] != texts[1]
    assert texts[0] == texts[2] and texts[1] == texts[3]

    streamed = [""] * 2
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                           temperature=0.0, stream=True):
        assert len(chunk.choices) == 1
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed[0] == streamed[1]


@pytest.mark.parametrize("logprobs", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", [0, 0, 0, 0, 0]])
def test_echo_logprob_completion(client, prompt, logprobs):
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                           temperature=0.0, echo=True, logprobs=logprobs)
    prompt_text = bytes(prompt).decode() if isinstance(prompt, list) else prompt
    assert completion.choices[0].text.startswith(prompt_text)
    lps = completion.choices[0].logprobs
    assert len(lps.text_offset) > 5 and len(lps.tokens) > 5
    assert len(lps.token_logprobs) > 5 and lps.token_logprobs[0] is None
    assert len(lps.top_logprobs) > 5 and lps.top_logprobs[0] is None
    for top in lps.top_logprobs[1:]:
        assert max(logprobs, 1) <= len(top) <= logprobs + 1


def test_truncate_prompt_tokens_keeps_the_prompts_end(client):
    completion = client.completions.create(
        model=MODEL, prompt=list(b"abcdefgh"), max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 4})
    assert completion.usage.prompt_tokens == 4
    assert completion.choices[0].text.startswith("efgh")


def test_streamed_text_offsets_equal_the_whole_responses(client):
    body = dict(model=MODEL, prompt="def main(", max_tokens=40, temperature=0.0, logprobs=0,
                stop=["\n\n"])
    whole = client.completions.create(**body).choices[0].logprobs.text_offset
    streamed = [offset for chunk in client.completions.create(**body, stream=True)
                for offset in chunk.choices[0].logprobs.text_offset]
    assert streamed == whole and whole[0] == 0 and whole == sorted(whole)


@pytest.mark.parametrize("prompt", [None, [], [[]]])
def test_a_missing_or_empty_prompt_is_400(http, prompt):
    body = {"model": MODEL, "max_tokens": 5} | ({} if prompt is None else {"prompt": prompt})
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize("prompt", [[999999], [VOCAB], [-1], [[-1]], [[0], [-1]]])
def test_token_ids_outside_the_vocabulary_are_400(client, prompt):
    message = _bad_request(lambda: client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0), "prompt")
    if prompt in ([999999], [VOCAB]):
        assert str(VOCAB) in message  # names the vocabulary the ids must lie in


# -- chat ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("logprobs", "top", "want"), [(False, None, None), (True, 0, 0),
                                                        (True, 5, 5)])
def test_chat_logprobs(client, logprobs, top, want):
    choice = client.chat.completions.create(model=MODEL, messages=CHAT,
                                            max_completion_tokens=5, temperature=0.0,
                                            logprobs=logprobs, top_logprobs=top).choices[0]
    if want is None:
        assert choice.logprobs is None
        return
    assert len(choice.logprobs.content) == 5
    assert all(len(entry.top_logprobs) == want for entry in choice.logprobs.content)


def test_too_many_chat_logprobs(client):
    for stream in (True, False):
        _bad_request(lambda stream=stream: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=10, logprobs=True,
            top_logprobs=VOCAB + 1, stream=stream), "top_logprobs")
    message = client.chat.completions.create(model=MODEL, messages=CHAT,
                                             max_completion_tokens=10).choices[0].message
    assert message.content is not None  # the server still works


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, prompt_logprobs):
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    completion = client.chat.completions.create(model=MODEL, messages=DIALOGUE, max_tokens=5,
                                                extra_body=extra)
    entries = getattr(completion, "prompt_logprobs", None)
    if prompt_logprobs is None:
        assert entries is None
        return
    assert len(entries) == completion.usage.prompt_tokens and entries[0] is None
    if prompt_logprobs == -1:  # the whole vocabulary, as vLLM's with --max-logprobs vocab
        assert all(len(entry) == VOCAB for entry in entries[1:])


def test_more_than_one_prompt_logprobs_chat(client):
    """Each prompt position holds the k most likely tokens, and the prompt's own token when it
    is not among them."""
    for k in (1, 2):
        entries = client.chat.completions.create(
            model=MODEL, messages=DIALOGUE, max_tokens=5,
            extra_body={"prompt_logprobs": k}).prompt_logprobs
        token = str(_rendered(DIALOGUE).encode()[2])  # position 3: BOS, then the bytes
        assert len(entries[3]) == k + (entries[3][token]["rank"] > k), entries[3]


def test_single_chat_session(client):
    messages = list(CHAT)
    completion = client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=5, logprobs=True,
                                                top_logprobs=5)
    assert completion.id and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    prompt_tokens = _prompt_tokens(_rendered(messages))
    assert completion.usage == openai.types.CompletionUsage(
        completion_tokens=5, prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + 5)
    assert choice.message.role == "assistant" and choice.message.content
    messages += [{"role": "assistant", "content": choice.message.content},
                 {"role": "user", "content": "express your result in json"}]
    completion = client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=5)
    assert completion.choices[0].message.content is not None
    assert completion.usage.prompt_tokens == _prompt_tokens(_rendered(messages))


def test_chat_streaming(client):
    single = client.chat.completions.create(model=MODEL, messages=CHAT,
                                            max_completion_tokens=10, temperature=0.0)
    texts, finished = [], 0
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT,
                                                max_completion_tokens=10, temperature=0.0,
                                                stream=True):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant")
        if delta.content:
            texts.append(delta.content)
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 1
    assert chunk.choices[0].finish_reason == single.choices[0].finish_reason
    assert delta.content
    assert "".join(texts) == single.choices[0].message.content


def test_chat_completion_stream_options(client):
    def stream(options, **extra):
        return iter(client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0.0,
            stream=True, stream_options=options, **extra))

    assert all(chunk.usage is None for chunk in stream({"include_usage": False}))

    chunks = stream({"include_usage": True, "continuous_usage_stats": False})
    for chunk in chunks:
        assert chunk.usage is None
        if chunk.choices[0].finish_reason is not None:
            final = next(chunks)
            assert _usage_is_sum(final.usage) and final.choices == []
            break
    else:
        raise AssertionError("no chunk finished")

    for options in ({"include_usage": None}, {"include_usage": True}):
        _bad_request(lambda options=options: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=10, stream=False,
            stream_options=options), "stream_options")

    # vLLM's min_tokens=10 (not ours) becomes ignore_eos: all 10 tokens come
    last = 0
    for chunk in stream({"include_usage": True, "continuous_usage_stats": True},
                        extra_body={"ignore_eos": True}):
        usage = chunk.usage
        assert usage.prompt_tokens >= 0
        assert (last == 0 or usage.completion_tokens > last
                or (not chunk.choices and usage.completion_tokens == last))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        last = usage.completion_tokens
    assert last == 10


def test_chat_n_parameter(client):
    messages = [{"role": "user", "content": "What is the opposite of big?"}]
    completion = client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=20, temperature=0.7, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.message.content for c in completion.choices)
    assert len({c.message.content for c in completion.choices}) > 1

    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=15, temperature=0.7,
                                                n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1] and all(texts.values())

    for n, seed in ((2, 42), (1, None)):
        completion = client.chat.completions.create(model=MODEL, messages=messages,
                                                    max_completion_tokens=10, temperature=0.8,
                                                    n=n, seed=seed)
        assert [c.index for c in completion.choices] == list(range(n))
        assert all(c.message.content for c in completion.choices)


def test_long_seed(client):
    for seed in (INT64_MIN - 1, INT64_MAX + 1):
        _bad_request(lambda seed=seed: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, temperature=0, seed=seed), "seed")
    for seed in (INT64_MIN, INT64_MAX):
        assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                              seed=seed).choices


def test_extra_fields_in_a_message_are_allowed(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
        max_tokens=5, temperature=0, seed=0)
    assert completion.choices[0].message.content is not None


def test_complex_message_content_and_custom_role(client):
    """Text parts read as the string they join to, whatever the role."""
    for role in ("user", "my-custom-role"):
        contents = [client.chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": content}], max_tokens=8,
            temperature=0, seed=0).choices[0].message.content
            for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
        assert contents[0] == contents[1]


def test_response_format_text(client):
    for _ in range(2):
        completion = client.chat.completions.create(model=MODEL, messages=CHAT,
                                                    max_completion_tokens=10,
                                                    response_format={"type": "text"})
        assert completion.choices[0].message.content is not None


# the demo's model seldom emits EOS: the stop at the line's end is how it says "stop"
@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_with_continue_final_message(client, echo):
    completion = client.chat.completions.create(
        model=MODEL, stop=["\n"],
        messages=[{"role": "user", "content": "tell me a common saying"},
                  {"role": "assistant", "content": SAYING}],
        extra_body={"echo": echo, "continue_final_message": True,
                    "add_generation_prompt": False})
    assert completion.id and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and choice.message.content is not None
    assert (SAYING in choice.message.content) == echo
    if echo:
        assert choice.message.content.startswith(SAYING)


def test_top_logprobs_of_minus_one_are_the_whole_vocabulary(client):
    completion = client.chat.completions.create(model=MODEL, messages=DIALOGUE, max_tokens=1,
                                                logprobs=True, top_logprobs=-1)
    content = completion.choices[0].logprobs.content
    assert len(content) == 1 and len(content[0].top_logprobs) == VOCAB


def test_add_generation_prompt_and_continue_final_message_shape_the_prompt(client):
    messages = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": SAYING}]

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    assert prompt_tokens() == _prompt_tokens(_rendered(messages))
    assert prompt_tokens(add_generation_prompt=False) == \
        _prompt_tokens(_rendered(messages, add_generation_prompt=False))
    # the final message left open: its content ends the prompt
    assert prompt_tokens(continue_final_message=True, add_generation_prompt=False) == \
        _prompt_tokens(_rendered(messages, add_generation_prompt=False)[:-1])
    _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": True}),
        "continue_final_message")


def test_chat_stop_token_ids_validation(client):
    def create(ids):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing stop token ids"}],
            max_tokens=5, extra_body={"stop_token_ids": ids})

    assert create([VOCAB - 1]).choices[0].message.content is not None
    message = _bad_request(lambda: create([VOCAB + 1]), "stop_token_ids")
    assert str(VOCAB + 1) in message and str(VOCAB) in message
    _bad_request(lambda: create([-1]), "stop_token_ids")


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
    _bad_request(lambda: client.completions.create(model=MODEL, prompt="x" * 300, max_tokens=5),
                 "prompt")
    _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x" * 300}]), "messages")
    _bad_request(lambda: client.completions.create(model=MODEL, prompt="x" * 200,
                                                   max_tokens=100), "max_tokens")
    _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x" * 200}],
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
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT,
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
    before = _wait_idle(http)
    for _ in range(num_requests):
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
    after = metrics_of(http)
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

    assert running() == (0, 0, 0)

    async def start_then_abort() -> tuple[float, float, float]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                      max_retries=0) as aclient:
            # n=8: 24 sequences for 8 slots, so that they run (and wait) long enough to be
            # seen on a fast machine too
            tasks = [asyncio.ensure_future(aclient.completions.create(
                model=MODEL, prompt=list(b"Hello my name is Robert and I love magic"),
                max_tokens=200, n=8, extra_body={"ignore_eos": True})) for _ in range(3)]
            deadline = time.monotonic() + 10
            while (busy := await asyncio.to_thread(running))[0] == 0:
                assert time.monotonic() < deadline, "the requests never ran"
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return busy

    busy = asyncio.run(start_then_abort())
    assert busy[0] > 0 and busy[2] > 0
    deadline = time.monotonic() + 1.0  # vLLM waits a second, then asserts
    while running() != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running() == (0, 0, 0)
