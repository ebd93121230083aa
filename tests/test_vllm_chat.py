"""vLLM's OpenAI-server tests, ported (tests/demo_server.py says which and how):
/v1/chat/completions."""


import openai
import pytest
from demo_server import (
    CHAT,
    DIALOGUE,
    INT64_MAX,
    INT64_MIN,
    MODEL,
    SAYING,
    VOCAB,
    bad_request,
    num_prompt_tokens,
    rendered,
    usage_at_the_end,
)


@pytest.fixture(scope="module")
def server(demo):
    """The demo server (conftest.py's `demo`), for conftest's `client` and `http`."""
    return demo


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
        bad_request(lambda stream=stream: client.chat.completions.create(
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
        token = str(rendered(DIALOGUE).encode()[2])  # position 3: BOS, then the bytes
        assert len(entries[3]) == k + (entries[3][token]["rank"] > k), entries[3]


def test_single_chat_session(client):
    messages = list(CHAT)
    completion = client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=5, logprobs=True,
                                                top_logprobs=5)
    assert completion.id and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    prompt_tokens = num_prompt_tokens(rendered(messages))
    assert completion.usage == openai.types.CompletionUsage(
        completion_tokens=5, prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + 5)
    assert choice.message.role == "assistant" and choice.message.content
    messages += [{"role": "assistant", "content": choice.message.content},
                 {"role": "user", "content": "express your result in json"}]
    completion = client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=5)
    assert completion.choices[0].message.content is not None
    assert completion.usage.prompt_tokens == num_prompt_tokens(rendered(messages))


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

    usage_at_the_end(stream({"include_usage": True, "continuous_usage_stats": False}), False)

    for options in ({"include_usage": None}, {"include_usage": True}):
        bad_request(lambda options=options: client.chat.completions.create(
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
        bad_request(lambda seed=seed: client.chat.completions.create(
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

    def served(**extra) -> int:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    assert served() == num_prompt_tokens(rendered(messages))
    assert served(add_generation_prompt=False) == \
        num_prompt_tokens(rendered(messages, add_generation_prompt=False))
    # the final message left open: its content ends the prompt
    assert served(continue_final_message=True, add_generation_prompt=False) == \
        num_prompt_tokens(rendered(messages, add_generation_prompt=False)[:-1])
    bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": True}),
        "continue_final_message")


def test_chat_stop_token_ids_validation(client):
    def create(ids):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing stop token ids"}],
            max_tokens=5, extra_body={"stop_token_ids": ids})

    assert create([VOCAB - 1]).choices[0].message.content is not None
    message = bad_request(lambda: create([VOCAB + 1]), "stop_token_ids")
    assert str(VOCAB + 1) in message and str(VOCAB) in message
    bad_request(lambda: create([-1]), "stop_token_ids")
