"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1, driven by the official
`openai` client and by httpx: outputs equal to `LLM.generate`, disconnects and a bounded load
test (every error path: test_server_errors.py; the CLI: test_cli.py)."""

import asyncio
import json

import httpx
import pytest
from served import (
    AUTH,
    MODEL,
    PROMPT,
    abandon_while_running,
    metrics_of,
    succeeds,
    wait_idle,
)

from jaxserve import SamplingParams


def _greedy(reference, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return reference.generate(prompt, params)[0].outputs[0]


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
    # offline, LLM.chat renders the same prompt (one conversation or a list of them)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    one, = reference.chat(messages, params)
    assert one.outputs[0].text == want.text and one.prompt == template
    pair = reference.chat([messages, [{"role": "user", "content": "Hi"}]], params)
    assert len(pair) == 2 and pair[0].outputs[0].text == want.text
    # tools and the template's own variables reach the template, as the server's do
    tools = [{"type": "function", "function": {"name": "tell", "parameters": {
        "type": "object", "properties": {"story": {"type": "string"}}}}}]
    offered, = reference.chat(messages, params, tools=tools,
                              chat_template_kwargs={"enable_thinking": False})
    assert offered.prompt == f"tools: {json.dumps(tools)}\n" + template
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        reference.chat(messages, params, tools=[{"type": "function", "function": {
            "name": "tell", "parameters": {"type": 5}}}])


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


def test_echo_with_logprobs_scores_the_prompt(http, reference):
    """lm-eval's loglikelihood call: echo + logprobs (+ max_tokens 0) gives each prompt token's
    logprob (the first has none), equal to LLM.generate's prompt_logprobs, with offsets that
    point into the echoed text; max_tokens 0 generates nothing, streamed or not."""
    out = reference.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0,
                                                    prompt_logprobs=1), use_tqdm=False)[0]
    want = [None] + [d[t].logprob for t, d in zip(out.prompt_token_ids[1:],
                                                   out.prompt_logprobs[1:], strict=True)]
    for max_tokens in (0, 3):
        body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                "temperature": 0}
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        lps = choice["logprobs"]
        n = len(out.prompt_token_ids)
        assert lps["token_logprobs"][:n] == pytest.approx(want)
        assert lps["top_logprobs"][0] is None and all(len(t) >= 1 for t in lps["top_logprobs"][1:])
        assert len(lps["tokens"]) == n + max_tokens
        text, offsets = choice["text"], lps["text_offset"]
        assert text.startswith(PROMPT) and len(offsets) == n + max_tokens
        # each prompt token starts where the echoed prompt spells it (the BOS spells nothing;
        # "Once", a SentencePiece "▁Once", starts at 0, not 1)
        ends = [*offsets[1:n], len(PROMPT)]
        assert offsets[:2] == [0, 0]
        spelled = [text[a:b] for a, b in zip(offsets[1:n], ends[1:], strict=True)]
        assert spelled == [lps["tokens"][1].lstrip(), *lps["tokens"][2:n]]
        if max_tokens:
            assert offsets[n] == len(PROMPT) and choice["finish_reason"] == "length"
        else:
            assert text == PROMPT and choice["finish_reason"] == "length"
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    r = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0})
    assert r.json()["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_truncation_and_stop_string_kept(http, reference):
    """vLLM's extra fields: prompt_logprobs (in each choice, and at the top of a chat),
    truncate_prompt_tokens (the prompt's last k tokens), include_stop_str_in_output."""
    ids = reference.get_tokenizer().encode(PROMPT + " there was a little girl")
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 0})
    plps = r.json()["choices"][0]["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    assert all(list(d) == [str(t)] for d, t in zip(plps[1:], ids[1:], strict=True))
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1})
    assert chat.json()["prompt_logprobs"][0] is None
    want = _greedy(reference, {"prompt_token_ids": ids[-5:]}, 6)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0,
                                           "truncate_prompt_tokens": 5, "echo": True}).json()
    assert r["usage"]["prompt_tokens"] == 5
    assert r["choices"][0]["text"] == reference.get_tokenizer().decode(ids[-5:]) + want.text
    full = _greedy(reference, PROMPT, 24).text
    stop = full.split()[3]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                           "stop": [stop], "include_stop_str_in_output": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[:full.index(stop) + len(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_token_counts_move_while_a_request_runs(http):
    """The generation-token counter and TTFT count as tokens stream, not when a request ends."""
    before = metrics_of(http)
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: {"):
                received += len(json.loads(line[6:])["choices"][0]["text"]) > 0
            if received >= 3:
                break
        during = metrics_of(http)
        assert during["jaxserve:generation_tokens_total"] >= (
            before.get("jaxserve:generation_tokens_total", 0) + 3)
        assert during["jaxserve:time_to_first_token_seconds_count"] == (
            before.get("jaxserve:time_to_first_token_seconds_count", 0) + 1)
        for _ in lines:
            pass
    after = metrics_of(http)
    assert after["jaxserve:generation_tokens_total"] == (
        before.get("jaxserve:generation_tokens_total", 0) + 40)


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


# -- disconnects and load ----------------------------------------------------------------------


def test_abort_of_a_non_string_id_is_refused_and_the_engine_lives(server, http):
    with pytest.raises(ValueError, match="request_id must be a string"):
        server.engine.abort(5)
    succeeds(http)


def test_non_streaming_client_disconnect_aborts(server, http):
    aborted = metrics_of(http).get('jaxserve:request_success_total{finished_reason="abort"}', 0)
    abandon_while_running(server, {"prompt": PROMPT, "max_tokens": 490, "ignore_eos": True})
    stats = wait_idle(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    after = metrics_of(http)['jaxserve:request_success_total{finished_reason="abort"}']
    assert after == aborted + 1
    succeeds(http)


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
    aborted = metrics_of(http).get('jaxserve:request_success_total{finished_reason="abort"}', 0)
    results = asyncio.run(_load(server.url, 256, drop_every=8))
    assert all(status == 200 for status, _, _ in results), results
    dropped = [got for _, _, got in results if got == "dropped"]
    assert len(dropped) == 32
    assert all(got == max_tokens for _, max_tokens, got in results if got != "dropped")
    stats = wait_idle(server)
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    metrics = metrics_of(http)
    assert metrics["jaxserve:num_requests_running"] == 0
    assert metrics["jaxserve:num_requests_waiting"] == 0
    assert metrics["jaxserve:kv_cache_usage_perc"] == 0
    assert metrics["jaxserve:num_compilations_total"] == 0
    assert metrics['jaxserve:request_success_total{finished_reason="abort"}'] == aborted + 32
    succeeds(http)
