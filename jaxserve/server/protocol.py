"""The OpenAI API as jaxserve speaks it: request parsing (every error names its field), the error
envelope, and the response bodies and stream chunks of /v1/completions and /v1/chat/completions.

Fields are checked by hand rather than by a schema library so that each 400 says which field is
wrong and why, in vLLM's envelope: {"error": {"message", "type", "param", "code"}}. No field is
silently ignored: each field of OpenAI's and vLLM's requests is implemented, accepted because it
changes nothing here (`_NO_OP`), or refused unless it holds its no-op value (`_REFUSED`); any
other field is a 400 naming it (vLLM ignores those, so a typo would pass unnoticed).
"""

import codecs
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from jaxserve.checks import is_finite, is_int, show
from jaxserve.request import Logprob, RequestOutput, SamplingParams
from jaxserve.tokenizer import IncrementalDetokenizer, token_text

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


class APIError(Exception):
    """An error response: HTTP status, message, the offending request field, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


# -- the fields of a request ------------------------------------------------------------------
# Each field of OpenAI's and vLLM's CompletionRequest and ChatCompletionRequest is in one class:
# implemented (parsed below), accepted because it changes nothing for jaxserve (README.md says
# why), or refused with a 400 naming it unless it holds a value that means "off". The endpoint
# kinds each field belongs to: a field of neither endpoint's schema is an unknown field.
_BOTH, _COMPLETION, _CHAT = ("completion", "chat"), ("completion",), ("chat",)

_IMPLEMENTED = {
    "model": _BOTH, "stream": _BOTH, "stream_options": _BOTH, "n": _BOTH, "max_tokens": _BOTH,
    "temperature": _BOTH, "top_p": _BOTH, "top_k": _BOTH, "seed": _BOTH, "stop": _BOTH,
    "stop_token_ids": _BOTH, "ignore_eos": _BOTH, "include_stop_str_in_output": _BOTH,
    "logprobs": _BOTH, "prompt_logprobs": _BOTH, "truncate_prompt_tokens": _BOTH,
    "add_special_tokens": _BOTH, "priority": _BOTH, "request_id": _BOTH, "echo": _BOTH,
    "slo_ms": _BOTH,  # jaxserve's own: the edf policy's time-to-first-token target
    "prompt": _COMPLETION,
    "messages": _CHAT, "max_completion_tokens": _CHAT, "top_logprobs": _CHAT,
    "add_generation_prompt": _CHAT, "continue_final_message": _CHAT,
}


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


# accepted with any value of their type: nothing jaxserve does depends on them
_NO_OP = {
    "user": (_BOTH, _is_str, "a string"),  # the end user, for the provider's abuse monitoring
    "cache_salt": (_BOTH, lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "session_id": (_BOTH, _is_str, "a string"),  # routing related requests
    "return_token_offsets": (_BOTH, _is_bool, "a boolean"),
    "return_mm_kwargs": (_BOTH, _is_bool, "a boolean"),
    "routed_experts_prompt_start": (_BOTH, lambda v: is_int(v) and v >= 0,
                                    "a non-negative integer"),
    "metadata": (_CHAT, lambda v: isinstance(v, dict), "an object"),
    "safety_identifier": (_CHAT, _is_str, "a string"),
    "prompt_cache_key": (_CHAT, _is_str, "a string"),
    "prompt_cache_retention": (_CHAT, lambda v: v in ("in_memory", "24h"),
                               '"in_memory" or "24h"'),
    "prompt_cache_options": (_CHAT, lambda v: isinstance(v, dict), "an object"),
    "parallel_tool_calls": (_CHAT, _is_bool, "a boolean"),
    "include_reasoning": (_CHAT, _is_bool, "a boolean"),
}

# not implemented: a 400 unless null or one of the values that mean "off"; () refuses any value
_REFUSED = {name: (_BOTH, off) for name, off in {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "min_p": (0,), "min_tokens": (0,), "use_beam_search": (False,),
    "best_of": (1,), "length_penalty": (1,), "bad_words": ([],), "allowed_token_ids": (),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "detokenize": (True,), "response_format": ({"type": "text"},), "structured_outputs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structural_tag": (),
    "logits_processors": (), "logprob_token_ids": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "truncation_side": ("left",), "watermarking": (False,),
    "repetition_detection": (), "thinking_token_budget": (-1,), "stream_interval": (1,),
    "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": ({},),
    "mm_processor_kwargs": ({},),
}.items()} | {name: (_COMPLETION, off) for name, off in {
    "suffix": ("",), "prompt_embeds": (),
}.items()} | {name: (_CHAT, off) for name, off in {
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"), "audio": (), "modalities": (["text"],), "prediction": (),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
    "chat_template": (), "chat_template_kwargs": ({},), "documents": ([],),
    "media_io_kwargs": ({},), "return_prompt_text": (False,), "store": (False,),
    "service_tier": ("auto", "default"),
}.items()}

_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _same(value: Any, off: Any) -> bool:
    """value == off, with a bool never equal to a number (True == 1 in Python)."""
    return value == off and isinstance(value, bool) == isinstance(off, bool)


def check_fields(body: dict[str, Any], kind: str) -> None:
    """APIError(400) naming the first field of `body` that a `kind` ("completion" or "chat")
    request must not have: an unknown one, a no-op one of the wrong type, or one jaxserve does
    not implement holding a value other than its no-op one."""
    for name, value in body.items():
        if kind in _IMPLEMENTED.get(name, ()):
            continue
        no_op, refused = _NO_OP.get(name), _REFUSED.get(name)
        if no_op is not None and kind in no_op[0]:
            _, check, what = no_op
            if value is not None and not check(value):
                raise APIError(400, f"{name} must be {what}, got {show(value)}", param=name)
        elif refused is not None and kind in refused[0]:
            if value is not None and not any(_same(value, off) for off in refused[1]):
                raise APIError(400, f"{name} is not supported by jaxserve (got {show(value)})",
                               param=name)
        else:
            other = "chat" if kind == "completion" else "completion"
            kinds = _IMPLEMENTED.get(name, ()) + (no_op or refused or ((),))[0]
            hint = f" (it is a field of {_PATHS[other]})" if other in kinds else ""
            raise APIError(400, f"unknown field {show(name)} for {_PATHS[kind]}{hint}",
                           param=_field_name(name))


def _field_name(name: str) -> str:
    """A client's field name as an error's `param`: cut short, and encodable (a lone surrogate
    is valid JSON, but no UTF-8)."""
    return name[:100].encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class GenerateRequest:
    """A parsed /v1/completions or /v1/chat/completions request."""

    model: str | None
    prompts: list[str | list[int]]  # completions: texts or token ids; chat: filled by the app
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every stream chunk carries the usage so far (vLLM's)
    request_id: str | None = None  # the client's: the response's id is made of it (as vLLM)
    echo: bool = False  # completion: the prompt first; chat: the last message's content first
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs), no output
    prompt_logprobs: bool = False  # the client asked for them by name: they go in the response
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this-many tokens
    add_special_tokens: bool | None = None  # None: completions add BOS, chats as their template
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat only
    add_generation_prompt: bool = True  # chat only
    continue_final_message: bool = False  # chat only: the model continues the final message
    role: str = "assistant"  # chat only: the response message's role
    names: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> request field


MAX_STOP = 64  # stop strings per request: each is searched for on every step
MAX_N = 128  # samples per prompt, as OpenAI allows


def _get(body: dict, name: str, check, what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(400, f"{name} must be {what}, got {show(value)}", param=name)
    return value


def parse_completion(body: dict[str, Any],
                     defaults: dict[str, Any] | None = None) -> GenerateRequest:
    """A /v1/completions body -> GenerateRequest; APIError(400) naming the field otherwise."""
    check_fields(body, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "prompt is required", param="prompt")
    logprobs = _get(body, "logprobs", is_int, "an integer")
    echo = _get(body, "echo", _is_bool, "a boolean", False)
    # echo with max_tokens 0 scores a prompt (as OpenAI's and vLLM's): one token is generated,
    # and dropped from the response
    echo_only = echo and body.get("max_tokens") == 0 and is_int(body["max_tokens"])
    # echo with logprobs reports the prompt's tokens' logprobs too (lm-eval's loglikelihood)
    prompt_lps = logprobs if echo and logprobs is not None else None
    req = _common(body if not echo_only else {**body, "max_tokens": 1}, default_max_tokens=16,
                  logprobs=logprobs, names={}, defaults=defaults, prompt_logprobs=prompt_lps)
    req.prompts = _prompts(body["prompt"])
    req.echo, req.echo_only = echo, echo_only
    return req


def parse_chat(body: dict[str, Any], defaults: dict[str, Any] | None = None) -> GenerateRequest:
    """A /v1/chat/completions body -> GenerateRequest (the app renders `messages`)."""
    check_fields(body, "chat")
    if "messages" not in body:
        raise APIError(400, "messages is required", param="messages")
    wants = _get(body, "logprobs", _is_bool, "a boolean", False)
    top = _get(body, "top_logprobs", is_int, "an integer")
    if top not in (None, 0) and not wants:  # 0 is the default: it asks for nothing (as vLLM)
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    continue_final = _get(body, "continue_final_message", _is_bool, "a boolean", False)
    # true unless the final message is continued (a new message's header would close it)
    add_prompt = _get(body, "add_generation_prompt", _is_bool, "a boolean", not continue_final)
    if continue_final and add_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                       "true: the first continues the final message, the second starts a new "
                       "one", param="continue_final_message")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # the engine's errors name the prompt, the token limit and the top logprobs by its words
    names = {"max_tokens": name, "logprobs": "top_logprobs", "prompt": "messages"}
    req = _common(body, default_max_tokens=None, logprobs=(top or 0) if wants else None,
                  names=names, defaults=defaults)
    req.messages = _messages(body["messages"])
    req.add_generation_prompt, req.continue_final_message = add_prompt, continue_final
    # as vLLM's: a new message is the assistant's; a continued one (or a template given no
    # generation prompt) keeps the final message's role
    req.role = "assistant" if add_prompt else req.messages[-1]["role"]
    req.echo = _get(body, "echo", _is_bool, "a boolean", False)
    return req


def _common(body: dict, default_max_tokens: int | None, logprobs: int | None,
            names: dict[str, str], defaults: dict[str, Any] | None = None,
            prompt_logprobs: int | None = None) -> GenerateRequest:
    """`defaults`: the model's own temperature / top_p / top_k (generation_config.json), for a
    request that leaves them out, as vLLM's server takes them. `prompt_logprobs`: what echo
    asks for when the body does not name `prompt_logprobs` itself."""
    defaults = defaults or {}
    stream = _get(body, "stream", _is_bool, "a boolean", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, f"stop must be a string or a list of strings, got {show(stop)}",
                       param="stop")
    if stop is not None and len(stop) > MAX_STOP:
        raise APIError(400, f"stop has {len(stop)} strings; at most {MAX_STOP} are allowed",
                       param="stop")
    n = _get(body, "n", is_int, "an integer", 1)
    if n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", param="n")
    named_prompt_lps = _get(body, "prompt_logprobs", is_int, "an integer")
    if named_prompt_lps is not None and stream:  # as vLLM: they come whole, in the response
        raise APIError(400, "prompt_logprobs is not supported with stream: true",
                       param="prompt_logprobs")
    truncate = _get(body, "truncate_prompt_tokens",
                    lambda v: is_int(v) and (v >= 1 or v == -1), "a positive integer or -1")
    names = {"max_tokens": "max_tokens"} | names
    kwargs = dict(
        max_tokens=_get(body, names["max_tokens"], is_int, "an integer", default_max_tokens),
        temperature=_get(body, "temperature", is_finite, "a number",
                         defaults.get("temperature", 1.0)),
        top_p=_get(body, "top_p", is_finite, "a number", defaults.get("top_p", 1.0)),
        top_k=_get(body, "top_k", is_int, "an integer", defaults.get("top_k")),
        seed=_get(body, "seed", is_int, "an integer"),
        stop=tuple(stop or ()),
        stop_token_ids=tuple(_get(body, "stop_token_ids",
                                  lambda v: isinstance(v, list) and all(map(is_int, v)),
                                  "a list of integers", [])),
        ignore_eos=_get(body, "ignore_eos", _is_bool, "a boolean", False),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output",
                                        _is_bool, "a boolean", False),
        logprobs=logprobs,
        prompt_logprobs=named_prompt_lps if named_prompt_lps is not None else prompt_logprobs,
        priority=_get(body, "priority", is_int, "an integer", 0),
        n=n,
    )
    if body.get("slo_ms") is not None:  # the edf policy's time-to-first-token target
        kwargs["slo_ms"] = _get(body, "slo_ms", is_finite, "a number")
    try:
        params = SamplingParams(**kwargs)
    except ValueError as error:
        raise client_error(error, names) from None
    return GenerateRequest(model=_get(body, "model", lambda v: isinstance(v, str), "a string"),
                           prompts=[], params=params, stream=stream, include_usage=include_usage,
                           continuous_usage=continuous_usage,
                           request_id=_get(body, "request_id", _is_text, "a non-empty string"),
                           names=names, prompt_logprobs=named_prompt_lps is not None,
                           truncate_prompt_tokens=truncate,
                           add_special_tokens=_get(body, "add_special_tokens",
                                                   _is_bool, "a boolean"))


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """stream_options -> (include_usage, continuous_usage_stats). continuous_usage_stats asks
    for the usage in every chunk, and so for the usage itself unless include_usage is false
    (vLLM's include_usage defaults to true)."""
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is None:
        return False, False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       param="stream_options")
    for key, value in options.items():
        if key not in _STREAM_OPTIONS:
            raise APIError(400, f"stream_options: unknown field {show(key)}",
                           param="stream_options")
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"stream_options.{key} must be a boolean, got {show(value)}",
                           param="stream_options")
    if options.get("include_obfuscation"):  # OpenAI's padding against a length side channel
        raise APIError(400, "stream_options.include_obfuscation is not supported by jaxserve: "
                       "its stream events carry no padding", param="stream_options")
    continuous = options.get("continuous_usage_stats") or False
    include = options.get("include_usage")
    include = continuous if include is None else include
    return include, continuous and include


def _is_text(value: Any) -> bool:
    """A non-empty string that UTF-8 can encode (JSON can carry a lone surrogate)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def param_of(error: Exception, names: dict[str, str]) -> str | None:
    """The request field a ValueError from SamplingParams or the engine is about: its first word
    (they name the field first), translated to the name the client used."""
    match = re.match(r"[a-z_]+", str(error))
    word = match.group(0) if match else None
    if word == "prompt" and "max_tokens" in str(error):  # prompt + max_tokens > max_model_len
        word = "max_tokens"
    if word == "prompt_token_ids":
        word = "prompt"
    return names.get(word, word) if word else None


def client_error(error: Exception, names: dict[str, str]) -> APIError:
    """A ValueError from SamplingParams or the engine as a 400 in the client's words: the field
    it names, and the message, with jaxserve's field names replaced by the request's (chat's
    "max_completion_tokens", "top_logprobs", "messages")."""
    message = str(error)
    for ours, theirs in names.items():
        if ours != theirs:
            message = re.sub(rf"\b{ours}\b", theirs, message)
    return APIError(400, message, param=param_of(error, names))


def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(map(is_int, p)) for p in value):
            return [list(p) for p in value]
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                   f"list of token-id lists, none of them empty; got {show(value)}",
                   param="prompt")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise APIError(400, f"messages must be a non-empty list, got {show(value)}",
                       param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'",
                           param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param="messages")
            content = "\n".join(p["text"] for p in content)  # as vLLM joins them
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        out.append({**message, "content": content})
    return out


# -- responses -------------------------------------------------------------------------------------


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


@dataclass
class _Sent:
    """What a stream already sent of one choice."""

    num_tokens: int = 0
    text_len: int = 0
    started: bool = False
    offsets: "_Offsets" = field(default_factory=lambda: _Offsets())


class _Offsets:
    """Running text_offset of logprob tokens: the characters before each token, counted from
    the tokens' bytes (a character split over several tokens counts once its last byte is in;
    special tokens, which the text leaves out, count none)."""

    def __init__(self) -> None:
        self.offset = 0
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset of a token of bytes `raw`; moves past it."""
        at = self.offset
        self.offset += len(self._chars.decode(raw))
        return at

    def prompt(self, tokenizer, ids: list[int], text: str) -> list[int]:
        """The offsets of an echoed prompt's tokens in `text`, its echo: read as the tokenizer
        decodes the prompt (a SentencePiece "▁Once" at the start is "Once"), not from each
        token's bytes; the tokens after it count from the end of `text`."""
        offsets = [0] * len(ids)
        if tokenizer is not None:
            detok, at = IncrementalDetokenizer(tokenizer), 0
            for j, token in enumerate(ids):
                offsets[j] = at
                at += len(detok.push([token]))
        self.offset = len(text)
        return offsets


class Formatter:
    """Builds the response bodies (or SSE chunks) of one request: `kind` "completion" or "chat".

    `prompt_texts[i]` is choice i's prompt text, echoed when `echo`. With n samples per
    prompt, choice i is sample i % n of prompt i // n (OpenAI's numbering).
    """

    def __init__(self, kind: str, request_id: str, created: int, model: str, tokenizer,
                 req: GenerateRequest, prompt_texts: list[str]):
        self.kind, self.created, self.model = kind, created, model
        # the client's request_id names the response (as vLLM's); the engine's ids stay unique
        self.id = request_id if req.request_id is None else (
            ("chatcmpl-" if kind == "chat" else "cmpl-") + req.request_id)
        self.tokenizer = tokenizer
        self.req = req
        self.prompt_texts = prompt_texts
        self._sent = [_Sent() for _ in prompt_texts]
        # chat echo (vLLM's): the reply starts with the last message's content when that
        # message has the reply's role (a continued message, or an assistant's prefill)
        last = req.messages[-1] if req.messages else {}
        self._chat_echo = (last["content"] if kind == "chat" and req.echo
                           and last.get("role") == req.role else "")

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The non-streaming body, with usage."""
        outputs = [self._shown(out) for out in outputs]
        choices = []
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            lps = self._logprobs(out, 0, _Offsets(), echo=self.req.echo, index=i)
            if self.kind == "chat":
                message = {"role": self.req.role, "content": self._chat_echo + c.text}
                choices.append({"index": i, "message": message, "logprobs": lps,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                text = (self.prompt_texts[i] if self.req.echo else "") + c.text
                choices.append({"index": i, "text": text, "logprobs": lps,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if self.req.prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(out)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = self._head(obj) | {"choices": choices, "usage": usage(outputs, self.req.params.n)}
        if self.req.prompt_logprobs and self.kind == "chat":  # vLLM's place for a chat's
            body["prompt_logprobs"] = self._prompt_logprobs(outputs[0])
        return body

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """`out` as the response shows it: an echo-only request's one generated token (it
        only made the engine compute the prompt's logprobs) is left out."""
        if not self.req.echo_only:
            return out
        c = out.outputs[0]
        return dataclasses.replace(out, outputs=[dataclasses.replace(
            c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
            cumulative_logprob=None if c.logprobs is None else 0.0,
            finish_reason="length" if out.finished else None, stop_reason=None)])

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id:
        {"logprob", "rank", "decoded_token"}} for the token and the top ones."""
        if out.prompt_logprobs is None:
            return None
        return [None if d is None else {
            str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                     "decoded_token": self._token(t, lp)} for t, lp in d.items()}
            for d in out.prompt_logprobs]

    def chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        """The SSE chunk carrying what `out` adds to choice `index` (None: nothing new)."""
        out = self._shown(out)
        sent, c = self._sent[index], out.outputs[0]
        text = c.text[sent.text_len:]
        new_tokens = len(c.token_ids) > sent.num_tokens
        first = not sent.started
        if not (text or new_tokens or out.finished or first):
            return None
        echo = first and self.req.echo and self.kind == "completion"
        lps = self._logprobs(out, sent.num_tokens, sent.offsets, echo=echo, index=index)
        sent.num_tokens, sent.text_len, sent.started = len(c.token_ids), len(c.text), True
        finish = c.finish_reason if out.finished else None
        stop_reason = c.stop_reason if out.finished else None
        if self.kind == "chat":
            delta = ({"role": self.req.role, "content": self._chat_echo + text} if first
                     else {"content": text})
            choice = {"index": index, "delta": delta if text or first else {}, "logprobs": lps,
                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": (self.prompt_texts[index] if echo else "") + text,
                      "logprobs": lps, "finish_reason": finish, "stop_reason": stop_reason}
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._head(obj) | {"choices": [choice]}
        if self.req.include_usage:  # vLLM's continuous_usage_stats: this choice's so far
            body["usage"] = usage([out]) if self.req.continuous_usage else None
        return body

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(
            [self._shown(out) for out in outputs], self.req.params.n)}

    # -- logprobs ----------------------------------------------------------------------------

    def _token(self, token_id: int, lp: Logprob | None = None) -> str:
        """The token's text with its leading space; a piece of a character as "bytes:\\x..",
        so that different tokens never share a name in top_logprobs. The engine's
        `decoded_token` when it named it already."""
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return token_text(self.tokenizer, token_id)

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return b""
        return self.tokenizer.token_bytes(token_id)

    def _text_bytes(self, token_id: int) -> bytes:
        """What the token adds to the response's text: nothing for a special token."""
        if self.tokenizer is not None and token_id in self.tokenizer.all_special_ids:
            return b""
        return self._bytes(token_id)

    def _logprobs(self, out: RequestOutput, start: int, offsets: _Offsets,
                  echo: bool = False, index: int = 0) -> dict[str, Any] | None:
        """Choice `index`'s logprobs of tokens from `start`; with `echo`, its prompt's first."""
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        ids = c.token_ids[start:]
        entries = c.logprobs[start:start + len(ids)]
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, d) for t, d in zip(ids, entries, strict=False)]}
        tokens, token_lps, tops, text_offsets = [], [], [], []
        if echo:  # the prompt's tokens first, with their logprobs (the first token has none)
            prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            for t, d in zip(out.prompt_token_ids, prompt_lps, strict=False):
                tokens.append(self._token(t, None if d is None else d[t]))
                token_lps.append(None if d is None else _finite(d[t].logprob))
                tops.append(None if d is None else self._top_dict(d))
            text_offsets += offsets.prompt(self.tokenizer, out.prompt_token_ids,
                                           self.prompt_texts[index])
        for t, d in zip(ids, entries, strict=False):
            tokens.append(self._token(t, d[t]))
            token_lps.append(_finite(d[t].logprob))
            tops.append(self._top_dict(d))
            text_offsets.append(offsets.advance(self._text_bytes(t)))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": text_offsets}

    def _top_dict(self, d: dict[int, Logprob]) -> dict[str, float]:
        return {self._token(t, lp): _finite(lp.logprob) for t, lp in d.items()}

    def _chat_entry(self, token_id: int, d: dict[int, Logprob]) -> dict[str, Any]:
        num_top = self.req.params.logprobs or 0  # -1: the whole vocabulary, every ranked one
        top = sorted(((t, lp) for t, lp in d.items() if lp.rank is not None
                      and (num_top == -1 or lp.rank <= num_top)), key=lambda item: item[1].rank)
        return self._chat_token(token_id, d[token_id]) | {
            "top_logprobs": [self._chat_token(t, lp) for t, lp in top]}

    def _chat_token(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        return {"token": self._token(token_id, lp), "logprob": _finite(lp.logprob),
                "bytes": list(self._bytes(token_id)) if self.tokenizer is not None else None}


def usage(outputs: list[RequestOutput], n: int = 1) -> dict[str, int]:
    """Token counts of a response: `outputs` holds n samples per prompt, prompt by prompt, and
    each prompt counts once (as in vLLM and OpenAI)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
