"""The sampler's controls and structured output over HTTP (issue 32), through `jaxserve serve`
on the demo model (tests/demo_server.py) with the official `openai` client: each control is
accepted and changes or limits the output as vLLM defines it, and each bad value is a 400 whose
`param` is the field the client sent, after which the server serves on.

The demo's tokenizer is byte-level (token id = byte, BOS 256, EOS 257), so a text's tokens are
its UTF-8 bytes. The demo model is tiny: asked for JSON whose whitespace is free (OpenAI's
response_format), it writes whitespace until max_tokens (OpenAI warns of this with any model).
Those tests bias whitespace away (`NO_SPACE`), which keeps them about the schema; the test of
disable_any_whitespace needs no bias.
"""

import json
import math
import re
from collections import Counter

import jsonschema
import pytest
from demo_server import MODEL, VOCAB, wait_idle
from served import assert_error

BOS, EOS = 256, 257
PROMPT = "Once upon a time"
PROMPT_IDS = [BOS, *PROMPT.encode()]
CHAT = [{"role": "user", "content": "Give me a JSON object"}]
NO_SPACE = {str(ord(c)): -100 for c in " \t\n\r"}

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
    "size": {"enum": ["small", "large"]}},
    "required": ["name", "ok", "size"], "additionalProperties": False}
TAGGED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
    "required": ["id", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def server(demo):
    """The demo server (conftest.py's `demo`), for conftest's `client` and `http`."""
    return demo


def complete(client, prompt=PROMPT, **body):
    """A completion; the fields OpenAI's client does not name go in its extra_body."""
    named = {k: body.pop(k) for k in ("max_tokens", "temperature", "seed", "logprobs",
                                      "logit_bias", "presence_penalty", "frequency_penalty",
                                      "n", "stream", "stop") if k in body}
    return client.completions.create(model=MODEL, prompt=prompt, **named, extra_body=body)


def chat(client, messages=CHAT, **body):
    named = {k: body.pop(k) for k in ("max_completion_tokens", "temperature", "seed",
                                      "logit_bias", "response_format", "n", "stream")
             if k in body}
    return client.chat.completions.create(model=MODEL, messages=messages, **named,
                                          extra_body=body)


def greedy_ids(client, prompt_ids, max_tokens, **body) -> list[int]:
    """The greedy output's token ids: its bytes, on the demo."""
    r = complete(client, prompt_ids, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                 **body)
    ids = list(r.choices[0].text.encode())
    assert len(ids) == r.usage.completion_tokens, r.choices[0].text  # whole UTF-8
    return ids


def serves(client) -> None:
    """A plain request succeeds: the server kept serving."""
    r = complete(client, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


# -- logit_bias, allowed_token_ids -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 1])
def test_logit_bias_of_100_makes_every_token_that_token(client, temperature):
    r = complete(client, max_tokens=8, temperature=temperature, seed=1, logit_bias={"97": 100})
    assert r.choices[0].text == "a" * 8
    r = chat(client, max_completion_tokens=6, temperature=temperature, seed=1,
             logit_bias={"98": 100})
    assert r.choices[0].message.content == "b" * 6


def test_logit_bias_of_minus_100_bans_the_token(client):
    plain = greedy_ids(client, PROMPT_IDS, 16)
    for banned in (plain[0], Counter(plain).most_common(1)[0][0]):
        out = greedy_ids(client, PROMPT_IDS, 16, logit_bias={str(banned): -100})
        assert banned not in out, bytes(out)


@pytest.mark.parametrize("path", ["completion", "chat"])
def test_allowed_token_ids_keep_every_token_in_the_set(client, path):
    allowed = "abcde "
    body = dict(temperature=1, seed=7, ignore_eos=True,
                allowed_token_ids=[ord(c) for c in allowed])
    if path == "completion":
        text = complete(client, max_tokens=24, **body).choices[0].text
    else:
        text = chat(client, max_completion_tokens=24, **body).choices[0].message.content
    assert len(text) == 24 and set(text) <= set(allowed), text
    # one id: greedy or not, every token is it
    assert complete(client, max_tokens=5, temperature=1, seed=7, ignore_eos=True,
                    allowed_token_ids=[120]).choices[0].text == "xxxxx"


# -- penalties, min_p ---------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_as_defined(client, penalty):
    """vLLM's definitions: a token's logit less presence_penalty if the output so far holds it,
    less frequency_penalty times the times it does. So under greedy each token of the penalized
    output is the token the plain model picks after the same text, given those amounts as a
    logit_bias."""
    value, n = 1.5, 12
    plain = greedy_ids(client, PROMPT_IDS, n)
    out = greedy_ids(client, PROMPT_IDS, n, **{penalty: value})
    assert len(set(plain)) < n and out != plain  # the plain output repeats itself
    for k in range(n):
        counts = Counter(out[:k])
        bias = {str(t): -value * (1 if penalty == "presence_penalty" else c)
                for t, c in counts.items()}
        assert greedy_ids(client, PROMPT_IDS + out[:k], 1, logit_bias=bias) == out[k:k + 1], k
    # negative values reward repeats: a different output again
    assert greedy_ids(client, PROMPT_IDS, n, **{penalty: -1.5}) not in (plain, out)


def test_repetition_penalty_changes_a_repeating_output(client):
    plain = greedy_ids(client, PROMPT_IDS, 24)
    assert greedy_ids(client, PROMPT_IDS, 24, repetition_penalty=1.0) == plain
    penalized = greedy_ids(client, PROMPT_IDS, 24, repetition_penalty=2.0)
    assert penalized != plain
    # prompt and output tokens are penalized alike: fewer of the output's tokens repeat ones
    # already seen than in the plain output ("the string to the string to ...")
    def repeats(ids):
        return sum(t in PROMPT_IDS + ids[:i] for i, t in enumerate(ids))
    assert repeats(penalized) < repeats(plain)


def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_likeliest(client):
    def run(**body):
        r = complete(client, max_tokens=32, temperature=1, seed=3, logprobs=1, ignore_eos=True,
                     **body)
        lp = r.choices[0].logprobs
        return [(got, max(top.values())) for got, top in zip(lp.token_logprobs, lp.top_logprobs,
                                                              strict=True)]

    min_p = 0.3
    assert any(got < best + math.log(min_p) for got, best in run())  # plain sampling does
    for got, best in run(min_p=min_p):
        assert got >= best + math.log(min_p) - 1e-4
    # min_p 1: only the likeliest token is left, so sampling is greedy
    sampled = complete(client, max_tokens=16, temperature=1, seed=3, min_p=1.0, ignore_eos=True)
    assert list(sampled.choices[0].text.encode()) == greedy_ids(client, PROMPT, 16)


# -- min_tokens, bad_words ----------------------------------------------------------------------


def test_min_tokens_hold_off_stop_tokens_and_eos(client):
    first = greedy_ids(client, PROMPT_IDS, 1)[0]
    plain = complete(client, max_tokens=10, temperature=0, stop_token_ids=[first])
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].text == ""
    held = complete(client, max_tokens=10, temperature=0, stop_token_ids=[first], min_tokens=6)
    ids = list(held.choices[0].text.encode())
    assert len(ids) >= 6 and first not in ids[:6]
    # EOS as the likeliest token: it ends the output after exactly min_tokens tokens
    eos = {str(EOS): 100}
    assert complete(client, max_tokens=10, temperature=0, logit_bias=eos).choices[0].text == ""
    for min_tokens in (1, 5):
        r = complete(client, max_tokens=10, temperature=0, logit_bias=eos, min_tokens=min_tokens)
        assert r.choices[0].finish_reason == "stop"
        assert len(r.choices[0].text.encode()) == min_tokens
        r = chat(client, max_completion_tokens=10, temperature=0, logit_bias=eos,
                 min_tokens=min_tokens)
        assert r.choices[0].finish_reason == "stop"
        assert len(r.choices[0].message.content.encode()) == min_tokens


@pytest.mark.parametrize("words", [["the"], ["string", "to"], ["t"]])
def test_bad_words_never_appear(client, words):
    plain = bytes(greedy_ids(client, PROMPT_IDS, 32)).decode()
    assert all(w in plain for w in words), plain  # "out in the string to the string to ..."
    out = bytes(greedy_ids(client, PROMPT_IDS, 32, bad_words=words)).decode()
    assert len(out) == 32 and not any(w in out for w in words), out


# -- structured output ------------------------------------------------------------------------


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "item", "schema": schema,
                                                   "strict": True}}


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("schema", [ITEM, TAGGED])
def test_response_format_json_schema(client, schema):
    r = chat(client, response_format=json_schema(schema), logit_bias=NO_SPACE,
             max_completion_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].message.content, schema)
    r = complete(client, response_format=json_schema(schema), logit_bias=NO_SPACE,
                 max_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].text, schema)
    # sampled, n = 2: each sample matches
    r = chat(client, response_format=json_schema(schema), logit_bias=NO_SPACE,
             max_completion_tokens=120, temperature=1, seed=5, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content, schema)


def test_streamed_json_schema_validates_when_joined(client):
    for path in ("chat", "completion"):
        if path == "chat":
            stream = chat(client, response_format=json_schema(ITEM), logit_bias=NO_SPACE,
                          max_completion_tokens=120, temperature=0, stream=True)
            parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason)
                     for c in stream if c.choices]
        else:
            stream = complete(client, response_format=json_schema(ITEM), logit_bias=NO_SPACE,
                              max_tokens=120, temperature=0, stream=True)
            parts = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
        assert len(parts) > 2 and parts[-1][1] == "stop"
        valid("".join(text for text, _ in parts), ITEM)


def test_json_object(client):
    for body in ({"response_format": {"type": "json_object"}},
                 {"structured_outputs": {"json_object": True}}):
        r = chat(client, logit_bias=NO_SPACE, max_completion_tokens=120, temperature=0, **body)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_disable_any_whitespace(client):
    """No whitespace between JSON's tokens, and none needed from a bias to finish."""
    r = chat(client, structured_outputs={"json": ITEM, "disable_any_whitespace": True},
             max_completion_tokens=120, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    valid(text, ITEM)
    assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', text)), text


def test_guided_json_as_text_and_object(client):
    for schema in (ITEM, json.dumps(ITEM)):
        r = complete(client, guided_json=schema, logit_bias=NO_SPACE, max_tokens=120,
                     temperature=0)
        assert r.choices[0].finish_reason == "stop"
        valid(r.choices[0].text, ITEM)


@pytest.mark.parametrize("body", [{"guided_choice": CHOICES},
                                  {"guided_choice": CHOICES, "guided_decoding_backend": "guidance"},
                                  {"structured_outputs": {"choice": CHOICES}}])
def test_choice_is_one_of_the_choices(client, body):
    r = chat(client, [{"role": "user", "content": "yes or no?"}], max_completion_tokens=20,
             temperature=0, **body)
    assert r.choices[0].message.content in CHOICES
    r = complete(client, max_tokens=20, temperature=1, seed=2, n=3, **body)
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in r.choices)


@pytest.mark.parametrize("body", [{"guided_regex": REGEX},
                                  {"structured_outputs": {"regex": REGEX}}])
def test_regex_fully_matches(client, body):
    r = complete(client, max_tokens=40, temperature=0, **body)
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, r.choices[0].text)
    stream = complete(client, max_tokens=40, temperature=1, seed=4, stream=True, **body)
    assert re.fullmatch(REGEX, "".join(c.choices[0].text for c in stream))
    r = chat(client, max_completion_tokens=40, temperature=0, **body)
    assert re.fullmatch(REGEX, r.choices[0].message.content)


@pytest.mark.parametrize("grammar", [
    'root ::= ("cat" | "dog") " " ("runs" | "sleeps")',  # GBNF
    'start: ("cat" | "dog") " " ("runs" | "sleeps")',  # Lark
])
def test_grammar(client, grammar):
    for body in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        r = complete(client, max_tokens=20, temperature=0, **body)
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"(cat|dog) (runs|sleeps)", r.choices[0].text), r.choices[0].text


def test_a_constraint_and_the_other_controls_together(client):
    """A grammar's tokens and logit_bias both hold: "maybe" biased up among the choices."""
    r = complete(client, max_tokens=20, temperature=0, guided_choice=CHOICES,
                 logit_bias={str(ord("m")): 100})
    assert r.choices[0].text == "maybe"


# -- bad input: a 400 naming the field sent; the server serves on --------------------------------


COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"
BODIES = {COMPLETIONS: {"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
          CHATS: {"model": MODEL, "messages": CHAT, "max_tokens": 4}}

# (field values, the param named): checked when the request is parsed
BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5}, "min_tokens"),  # past max_tokens 4
    ({"logit_bias": {"97": 101}}, "logit_bias"),
    ({"logit_bias": {"97": -100.5}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"97": "up"}}, "logit_bias"),
    ({"logit_bias": [97]}, "logit_bias"),
    ({"bad_words": "the"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": "abc"}, "allowed_token_ids"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": ITEM}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
     "response_format"),
    ({"response_format": {"type": "json_object", "schema": ITEM}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a+"}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a+"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " ", "guided_json": ITEM}, "guided_whitespace_pattern"),
    # more than one way of constraining: the second named
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": ITEM}, "guided_json"),
    ({"response_format": json_schema(ITEM), "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_grammar": "root ::= \"a\""},
     "guided_grammar"),
]
# checked by the engine when the request is added: against the vocabulary, or compiled
BAD_IN_THE_ENGINE = [
    ({"logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ({"logit_bias": {"99999999999999999999999": 5}}, "logit_bias"),
    ({"allowed_token_ids": [97, VOCAB]}, "allowed_token_ids"),
    ({"response_format": json_schema({"type": "objekt"})}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
     "guided_json"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
]


def _check_400(http, client, path, fields, param):
    r = http.post(path, json=BODIES[path] | fields)
    assert_error(r, 400, param)
    serves(client)


@pytest.mark.parametrize(("fields", "param"), BAD)
@pytest.mark.parametrize("path", [COMPLETIONS, CHATS])
def test_bad_value_is_400_naming_its_field(http, client, path, fields, param):
    _check_400(http, client, path, fields, param)


@pytest.mark.parametrize(("fields", "param"), BAD_IN_THE_ENGINE)
@pytest.mark.parametrize("path", [COMPLETIONS, CHATS])
def test_bad_value_the_engine_finds_is_400_naming_its_field(http, client, path, fields, param):
    _check_400(http, client, path, fields, param)
    # streamed or n > 1 alike: refused before anything is sent, nothing left running
    _check_400(http, client, path, fields | {"stream": True, "n": 2}, param)
    wait_idle(http)


def test_errors_speak_the_clients_words(http):
    """The message names the field as sent: chat's max_completion_tokens, the guided_* field,
    the schema's place inside response_format."""
    r = http.post(CHATS, json=BODIES[CHATS] | {"max_tokens": None, "max_completion_tokens": 3,
                                               "min_tokens": 4})
    assert_error(r, 400, "min_tokens", "max_completion_tokens")
    r = http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {"guided_regex": "(unclosed"})
    assert_error(r, 400, "guided_regex")
    assert r.json()["error"]["message"].startswith("guided_regex")
    r = http.post(COMPLETIONS, json=BODIES[COMPLETIONS] | {
        "response_format": json_schema({"type": "objekt"})})
    assert_error(r, 400, "response_format", "response_format.json_schema.schema")
    assert "structured_outputs" not in r.json()["error"]["message"]


def test_off_values_are_accepted(http):
    """Each control at the value that means off, or null: a plain request."""
    offs = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
            "min_p": 0, "min_tokens": 0, "logit_bias": {}, "bad_words": [],
            "response_format": {"type": "text"}, "guided_decoding_backend": "auto"}
    nulls = dict.fromkeys([*offs, "allowed_token_ids", "structured_outputs", "guided_json",
                           "guided_regex", "guided_choice", "guided_grammar",
                           "guided_whitespace_pattern"])
    for path in (COMPLETIONS, CHATS):
        body = BODIES[path] | {"temperature": 0, "max_tokens": 8}
        plain = http.post(path, json=body)
        for fields in (offs, nulls):
            r = http.post(path, json=body | fields)
            assert r.status_code == 200, r.text
            assert r.json()["choices"] == plain.json()["choices"]
