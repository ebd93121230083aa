"""vLLM's OpenAI-server tests, ported (tests/demo_server.py says which and how): the basic
endpoints, the API key, cancellation, and /v1/completions."""

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from demo_server import (
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    VOCAB,
    bad_request,
    num_prompt_tokens,
    usage_at_the_end,
    wait_idle,
)
from served import KEY


@pytest.fixture(scope="module")
def server(demo):
    """The demo server (conftest.py's `demo`), for conftest's `client` and `http`."""
    return demo


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
    before = wait_idle(http)
    start = time.monotonic()
    client.chat.completions.create(**story, max_tokens=200, extra_body={"ignore_eos": True})
    # a quarter of what 200 tokens take alone; the flood asks 900 each, 32 for 8 slots: none
    # can finish, whatever this machine's speed, unless it runs 18 times faster meanwhile
    timeout = max(0.05, (time.monotonic() - start) / 4)

    async def flood() -> list[BaseException | None]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=timeout) as hasty:
            return await asyncio.gather(*(hasty.chat.completions.create(
                **story, max_tokens=900, extra_body={"ignore_eos": True}) for _ in range(32)),
                return_exceptions=True)

    results = asyncio.run(flood())
    assert all(isinstance(r, openai.APITimeoutError) for r in results), results
    after = wait_idle(http)
    length = 'jaxserve:request_success_total{finished_reason="length"}'
    assert after[length] == before.get(length, 0) + 1  # the measured one: the flood's aborted
    patient = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert len(patient.chat.completions.create(**story, max_tokens=10).choices) == 1


# -- completions --------------------------------------------------------------------------------


def test_single_completion(client):
    completion = client.completions.create(model=MODEL, prompt="Hello, my name is",
                                           max_tokens=5, temperature=0.0)
    assert completion.id and len(completion.choices) == 1
    choice = completion.choices[0]
    assert len(choice.text) >= 5 and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == num_prompt_tokens("Hello, my name is")
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
        bad_request(lambda stream=stream: client.completions.create(
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
        assert len(entries) == num_prompt_tokens(prompt) and entries[0] is None
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


def test_completion_stream_options(client):
    def stream(options):
        return iter(client.completions.create(
            model=MODEL, prompt="What is the capital of France?", max_tokens=5,
            temperature=0.0, stream=True, stream_options=options))

    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(chunk.usage is None for chunk in stream(options))

    usage_at_the_end(stream({"include_usage": True, "continuous_usage_stats": False}), False)

    usage_at_the_end(stream({"include_usage": True, "continuous_usage_stats": True}), True)

    for options in ({"include_usage": None}, {"include_usage": True},
                    {"continuous_usage_stats": None}, {"continuous_usage_stats": True}):
        bad_request(lambda options=options: client.completions.create(
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
    message = bad_request(lambda: client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0), "prompt")
    if prompt in ([999999], [VOCAB]):
        assert str(VOCAB) in message  # names the vocabulary the ids must lie in
