"""The request surface against OpenAI's and vLLM's: every field implemented, accepted as a
no-op or refused with a 400 naming it (an unknown one too); seed and stop_token_ids limits;
chat echo, continue_final_message and add_generation_prompt; logprobs of -1 (the whole
vocabulary); stream_options.continuous_usage_stats; and the bodies real clients send."""

import json
import math

import httpx
import pytest
from conftest import SERVER_ENGINE
from served import AUTH, KEEPALIVE, KEY, MODEL, PROMPT, assert_error, succeeds, uvicorn_url

from jaxserve import SamplingParams
from jaxserve.server import protocol
from jaxserve.text.tokenizer import ByteTokenizer, token_text

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
BODIES = {COMPLETIONS: {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
          CHAT: {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}}
KINDS = {COMPLETIONS: "completion", CHAT: "chat"}

# a value each refused field could ask for, which jaxserve would have to act on
REFUSED_VALUES = {
    "use_beam_search": True, "best_of": 2, "length_penalty": 0.5,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "detokenize": False,
    "guided_whitespace_pattern": " ", "structural_tag": "{}",
    "logits_processors": ["my.Processor"], "logprob_token_ids": [5],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "truncation_side": "right",
    "watermarking": True, "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 100, "stream_interval": 4, "kv_transfer_params": {"do": 1},
    "ec_transfer_params": {"do": 1}, "vllm_xargs": {"k": 1}, "mm_processor_kwargs": {"k": 1},
    "suffix": " the end", "prompt_embeds": "AAAA",
    "functions": [{"name": "f"}], "function_call": {"name": "f"}, "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
    "moderation": {"model": "x"}, "chat_template": "{{ messages }}",
    "documents": [{"title": "t"}],
    "media_io_kwargs": {"image": {}}, "return_prompt_text": True, "store": True,
    "service_tier": "priority",
}
NO_OP_VALUES = {
    "user": "user-1", "cache_salt": "salt", "session_id": "s-1", "return_token_offsets": True,
    "return_mm_kwargs": False, "routed_experts_prompt_start": 2, "metadata": {"k": "v"},
    "safety_identifier": "hash", "prompt_cache_key": "key", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
}


def _fields(table, path):
    return sorted(name for name, entry in table.items() if KINDS[path] in entry[0])


def _cases(table):
    return [(path, name) for path in (COMPLETIONS, CHAT) for name in _fields(table, path)]


def test_every_field_is_in_one_class():
    for path in (COMPLETIONS, CHAT):
        implemented = {n for n, kinds in protocol._IMPLEMENTED.items() if KINDS[path] in kinds}
        no_op, refused = set(_fields(protocol._NO_OP, path)), set(_fields(protocol._REFUSED,
                                                                           path))
        assert not (implemented & no_op or implemented & refused or no_op & refused)
    assert set(REFUSED_VALUES) == set(protocol._REFUSED)
    assert set(NO_OP_VALUES) == set(protocol._NO_OP)


# -- refused, no-op, unknown ---------------------------------------------------------------------


@pytest.mark.parametrize(("path", "name"), _cases(protocol._REFUSED))
def test_refused_field_is_400_naming_it(http, path, name):
    r = http.post(path, json=BODIES[path] | {name: REFUSED_VALUES[name]})
    assert_error(r, 400, name, "not supported")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_refused_fields_at_their_no_op_values_or_null_are_accepted(http, path):
    offs = {name: entry[1][0] for name, entry in protocol._REFUSED.items()
            if KINDS[path] in entry[0] and entry[1]}
    assert http.post(path, json=BODIES[path] | offs).status_code == 200
    nulls = dict.fromkeys(_fields(protocol._REFUSED, path))
    assert http.post(path, json=BODIES[path] | nulls).status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_no_op_fields_are_accepted_and_change_nothing(http, path):
    no_ops = {name: NO_OP_VALUES[name] for name in _fields(protocol._NO_OP, path)}
    body = BODIES[path] | {"temperature": 0, "max_tokens": 6}
    plain, r = http.post(path, json=body), http.post(path, json=body | no_ops)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize(("path", "name"), [(COMPLETIONS, "user"), (CHAT, "metadata"),
                                            (COMPLETIONS, "cache_salt"),
                                            (CHAT, "prompt_cache_retention")])
def test_no_op_field_of_the_wrong_type_is_400(http, path, name):
    assert_error(http.post(path, json=BODIES[path] | {name: 7}), 400, name)


@pytest.mark.parametrize(("path", "name", "hint"), [
    (COMPLETIONS, "temprature", None), (CHAT, "max_token", None),
    (COMPLETIONS, "messages", CHAT), (COMPLETIONS, "continue_final_message", CHAT),
    (COMPLETIONS, "metadata", CHAT), (CHAT, "prompt", COMPLETIONS), (CHAT, "suffix", COMPLETIONS),
])
def test_unknown_field_is_400_naming_it(http, path, name, hint):
    r = http.post(path, json=BODIES[path] | {name: 1})
    assert_error(r, 400, name, f"unknown field '{name}'")
    if hint is not None:
        assert hint in r.json()["error"]["message"]
    succeeds(http)


def test_unknown_field_with_a_lone_surrogate_is_400(http):
    content = json.dumps({"prompt": PROMPT, "\ud800": 1})  # ASCII: the surrogate escaped
    r = http.post(COMPLETIONS, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "\\ud800")


@pytest.mark.parametrize(("options", "ok"), [
    ({"include_usage": True, "include_obfuscation": False}, True),
    ({"include_obfuscation": True}, False), ({"include_usage": True, "chunk_size": 4}, False),
    ({"continuous_usage_stats": "yes"}, False),
])
def test_stream_options_fields(http, options, ok):
    r = http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {"stream": True,
                                                           "stream_options": options})
    if ok:
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    else:
        assert_error(r, 400, "stream_options")


# -- seed, stop_token_ids, request_id ------------------------------------------------------------


def test_seed_is_int64(http, reference):
    for seed in (2**63, -(2**63) - 1):
        assert_error(http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {"seed": seed}), 400,
                     "seed", "64-bit")
        with pytest.raises(ValueError, match=r"^seed must be a 64-bit integer"):
            SamplingParams(seed=seed)
    for seed in (-(2**63), 2**63 - 1):  # n = 3: samples seeded seed + j, wrapped into int64
        r = http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {"seed": seed, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert SamplingParams(seed=2**63 - 1).for_sample(1).seed == -(2**63)


def test_stop_token_ids_are_in_the_vocabulary(http, reference):
    vocab = reference.engine.model_config.vocab_size
    for path in (COMPLETIONS, CHAT):
        assert_error(http.post(path, json=BODIES[path] | {"stop_token_ids": [1, vocab]}), 400,
                     "stop_token_ids", f"[0, {vocab})")
        assert http.post(path, json=BODIES[path] | {"stop_token_ids": [vocab - 1]}
                         ).status_code == 200
    with pytest.raises(ValueError, match=r"^stop_token_ids must be ids in"):
        reference.generate(PROMPT, SamplingParams(stop_token_ids=[vocab]), use_tqdm=False)


def test_request_id_names_the_response(http):
    for path, prefix in ((COMPLETIONS, "cmpl-"), (CHAT, "chatcmpl-")):
        r = http.post(path, json=BODIES[path] | {"request_id": "mine-1", "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert {c["id"] for c in chunks} == {prefix + "mine-1"}
        # the same id again (even at once) is another request: the engine's ids stay unique
        assert http.post(path, json=BODIES[path] | {"request_id": "mine-1"}).json()["id"] == (
            prefix + "mine-1")
    assert_error(http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {"request_id": 5}), 400,
                 "request_id")


# -- chat: echo, continue_final_message, add_generation_prompt ----------------------------------


PREFILL = [{"role": "user", "content": "Tell me a story."},
           {"role": "assistant", "content": "Once upon a time"}]


def test_continue_final_message_leaves_the_final_message_open(http, reference):
    tokenizer = reference.get_tokenizer()
    text = tokenizer.apply_chat_template(PREFILL, False, continue_final_message=True)
    closed = tokenizer.apply_chat_template(PREFILL, False)
    assert text.endswith("assistant: Once upon a time") and closed == text + "\n"
    body = {"model": MODEL, "messages": PREFILL, "continue_final_message": True,
            "max_tokens": 12, "temperature": 0, "prompt_logprobs": 0}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    # the prompt the engine saw, token by token (prompt_logprobs name each prompt token)
    seen = [int(next(iter(d))) for d in r.json()["prompt_logprobs"][1:]]
    assert seen == tokenizer.chat_prompt_ids(text)[1:]
    want = reference.generate({"prompt_token_ids": tokenizer.chat_prompt_ids(text)},
                              SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": want[0].outputs[0].text}
    # offline: LLM.chat renders the same prompt
    out = reference.chat(PREFILL, SamplingParams(max_tokens=12, temperature=0.0), False,
                         add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt == text and out[0].outputs[0].text == message["content"]
    # with add_generation_prompt too: a 400, as vLLM's
    assert_error(http.post(CHAT, json=body | {"add_generation_prompt": True}), 400,
                 "continue_final_message")


def test_chat_template_continue_final_message_cuts_after_the_content():
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = ByteTokenizer(chat_template=chatml)
    text = tokenizer.apply_chat_template(PREFILL, False, continue_final_message=True)
    assert text == ("<|im_start|>user\nTell me a story.<|im_end|>\n"
                    "<|im_start|>assistant\nOnce upon a time")
    spaced = [*PREFILL[:1], {"role": "assistant", "content": "Once upon "}]
    assert tokenizer.apply_chat_template(spaced, False, True).endswith("\nOnce upon ")
    trimming = ByteTokenizer(chat_template=chatml.replace("m['content']", "m['content'].strip()"))
    assert trimming.apply_chat_template(spaced, False, True).endswith("\nOnce upon")
    with pytest.raises(ValueError, match="cannot both be true"):
        tokenizer.apply_chat_template(PREFILL, True, continue_final_message=True)
    dropping = ByteTokenizer(chat_template=chatml.replace("{{ m['content'] }}", ""))
    with pytest.raises(ValueError, match="continue_final_message"):
        dropping.apply_chat_template(PREFILL, False, continue_final_message=True)


def test_chat_echo_starts_the_reply_with_the_final_message(http, client):
    body = {"model": MODEL, "messages": PREFILL, "continue_final_message": True,
            "max_tokens": 10, "temperature": 0}
    plain = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post(CHAT, json=body | {"echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "Once upon a time" + plain}
    stream = client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=10,
                                            temperature=0, stream=True, extra_body={
                                                "echo": True, "continue_final_message": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content.startswith("Once upon a time")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed["content"]
    # the reply is a new assistant message after a user's: nothing to echo
    asked = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    assert (http.post(CHAT, json=asked | {"echo": True}).json()["choices"][0]["message"]
            == http.post(CHAT, json=asked).json()["choices"][0]["message"])


def test_add_generation_prompt_false_replies_in_the_final_role(http, reference):
    body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False,
            "max_tokens": 8, "temperature": 0, "echo": True}
    text = reference.get_tokenizer().apply_chat_template(MESSAGES, False)
    want = reference.generate(text, SamplingParams(max_tokens=8, temperature=0.0),
                              use_tqdm=False)[0].outputs[0].text
    message = http.post(CHAT, json=body).json()["choices"][0]["message"]
    # as vLLM's: the role is the final message's, whose content the echo repeats
    assert message == {"role": "user", "content": "Tell me a story." + want}


# -- stream_options.continuous_usage_stats -------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_stats_in_every_chunk(http, path):
    body = BODIES[path] | {"max_tokens": 6, "n": 2, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True,
                                              "continuous_usage_stats": True}}
    r = http.post(path, json=body)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    prompt_tokens = final["usage"]["prompt_tokens"]
    counts = {0: [], 1: []}
    for chunk in chunks[:-1]:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        counts[chunk["choices"][0]["index"]].append(usage["completion_tokens"])
    for running in counts.values():  # each choice's own count, up to its 6 tokens
        assert running == sorted(running) and running[-1] == 6
    # include_usage alone: usage null in the chunks, as OpenAI's
    body["stream_options"] = {"include_usage": True}
    chunks = [json.loads(line[6:]) for line in http.post(path, json=body).text.splitlines()
              if line.startswith("data: {")]
    assert all(c["usage"] is None for c in chunks[:-1])


# -- what real clients send ----------------------------------------------------------------------


def test_guidellm_bodies(http):
    """guidellm's request builders (src/guidellm/backends/openai/request_handlers.py): its
    text and chat bodies, streamed with continuous usage, read as guidellm reads them."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    completion = {"model": MODEL, "stream": True, "stream_options": options, "max_tokens": 8,
                  "stop": None, "ignore_eos": True, "prompt": PROMPT}
    chat = {"model": MODEL, "stream": True, "stream_options": options,
            "max_completion_tokens": 8, "stop": None, "ignore_eos": True,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
    for path, body in ((COMPLETIONS, completion), (CHAT, chat)):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        usage = None
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        assert usage["completion_tokens"] == 8
    readme = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    assert http.post(COMPLETIONS, json=readme).status_code == 200  # README.md's curl


# -- logprobs of -1: the whole vocabulary ------------------------------------------------------


def test_whole_vocabulary_logprobs_need_max_top_logprobs_of_the_vocabulary(http):
    for path, field, body in (
            (COMPLETIONS, "logprobs", {"logprobs": -1}),
            (COMPLETIONS, "prompt_logprobs", {"prompt_logprobs": -1}),
            (CHAT, "top_logprobs", {"logprobs": True, "top_logprobs": -1})):
        assert_error(http.post(path, json=BODIES[path] | body), 400, field,
                     "-1 (the whole vocabulary, 512 tokens) exceeds max_top_logprobs 20")
    assert_error(http.post(CHAT, json=BODIES[CHAT] | {"top_logprobs": -1}), 400, "top_logprobs",
                 "logprobs: true")


@pytest.fixture(scope="module")
def whole_vocabulary(stories_dir):
    """A server allowing logprobs of -1: max_top_logprobs of the vocabulary (as vLLM's
    max_logprobs=-1)."""
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server import ServerConfig, build_app

    config = EngineConfig.from_overrides(**SERVER_ENGINE, max_top_logprobs=512)
    engine = AsyncEngine(LLMEngine(stories_dir, config))
    with (uvicorn_url(build_app(engine, ServerConfig(api_key=KEY), MODEL)) as url,
          httpx.Client(base_url=url, headers=AUTH, timeout=60, limits=KEEPALIVE) as c):
        yield c


def _logsumexp(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def test_whole_vocabulary_logprobs(whole_vocabulary, reference):
    http = whole_vocabulary
    r = http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {"logprobs": -1, "max_tokens": 3,
                                                           "prompt_logprobs": -1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # completions name tokens by their text, and some texts are two tokens' (a byte-fallback
    # <0x20> and "▁" are both " "): every name is there
    names = {token_text(reference.get_tokenizer(), t) for t in range(512)}
    for top in choice["logprobs"]["top_logprobs"]:
        assert set(top) == names
    prompt = choice["prompt_logprobs"]  # by token id: the whole vocabulary, ranked
    assert prompt[0] is None
    for position in prompt[1:]:
        assert sorted(map(int, position)) == list(range(512))
        assert sorted(p["rank"] for p in position.values()) == list(range(1, 513))
        assert abs(_logsumexp([p["logprob"] for p in position.values()])) < 1e-3
    r = http.post(CHAT, json=BODIES[CHAT] | {"logprobs": True, "top_logprobs": -1,
                                             "max_tokens": 3})
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        lps = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(lps) == 512 and lps == sorted(lps, reverse=True)
        assert abs(_logsumexp(lps)) < 1e-3 and entry["logprob"] in lps
