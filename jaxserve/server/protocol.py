"""The OpenAI API as jaxserve speaks it: request parsing, every error naming its field. The
error envelope and the field checks are fields.py's, the response bodies and stream chunks
responses.py's; the fields that constrain the output (response_format, structured_outputs,
guided_*) are structured.py's.

Fields are checked by hand rather than by a schema library so that each 400 says which field is
wrong and why, in vLLM's envelope: {"error": {"message", "type", "param", "code"}}. No field is
silently ignored: each field of OpenAI's and vLLM's requests is implemented, accepted because it
changes nothing here (`_NO_OP`), or refused unless it holds its no-op value (`_REFUSED`); any
other field is a 400 naming it (vLLM ignores those, so a typo would pass unnoticed).
"""

import re
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config.checks import is_finite, is_int, show
from jaxserve.request import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.server.fields import APIError, get_field, is_bool, is_str, is_text, same
from jaxserve.server.structured import parse_structured
from jaxserve.text.tool_specs import check_tool_choice, check_tools, forced_schema

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
    # the sampler's controls and structured output (issue 32)
    "presence_penalty": _BOTH, "frequency_penalty": _BOTH, "repetition_penalty": _BOTH,
    "logit_bias": _BOTH, "min_p": _BOTH, "min_tokens": _BOTH, "bad_words": _BOTH,
    "allowed_token_ids": _BOTH, "response_format": _BOTH, "structured_outputs": _BOTH,
    "guided_json": _BOTH, "guided_regex": _BOTH, "guided_choice": _BOTH, "guided_grammar": _BOTH,
    "guided_decoding_backend": _BOTH,
    "prompt": _COMPLETION,
    "messages": _CHAT, "max_completion_tokens": _CHAT, "top_logprobs": _CHAT,
    "include_reasoning": _CHAT, "tools": _CHAT, "tool_choice": _CHAT,
    "parallel_tool_calls": _CHAT, "chat_template_kwargs": _CHAT,
    "add_generation_prompt": _CHAT, "continue_final_message": _CHAT,
}


# accepted with any value of their type: nothing jaxserve does depends on them
_NO_OP = {
    "user": (_BOTH, is_str, "a string"),  # the end user, for the provider's abuse monitoring
    "cache_salt": (_BOTH, lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "session_id": (_BOTH, is_str, "a string"),  # routing related requests
    "return_token_offsets": (_BOTH, is_bool, "a boolean"),
    "return_mm_kwargs": (_BOTH, is_bool, "a boolean"),
    "routed_experts_prompt_start": (_BOTH, lambda v: is_int(v) and v >= 0,
                                    "a non-negative integer"),
    "metadata": (_CHAT, lambda v: isinstance(v, dict), "an object"),
    "safety_identifier": (_CHAT, is_str, "a string"),
    "prompt_cache_key": (_CHAT, is_str, "a string"),
    "prompt_cache_retention": (_CHAT, lambda v: v in ("in_memory", "24h"),
                               '"in_memory" or "24h"'),
    "prompt_cache_options": (_CHAT, lambda v: isinstance(v, dict), "an object"),
}

# not implemented: a 400 unless null or one of the values that mean "off"; () refuses any value
_REFUSED = {name: (_BOTH, off) for name, off in {
    "use_beam_search": (False,), "best_of": (1,), "length_penalty": (1,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "detokenize": (True,), "guided_whitespace_pattern": (), "structural_tag": (),
    "logits_processors": (), "logprob_token_ids": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "truncation_side": ("left",), "watermarking": (False,),
    "repetition_detection": (), "thinking_token_budget": (-1,), "stream_interval": (1,),
    "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": ({},),
    "mm_processor_kwargs": ({},),
}.items()} | {name: (_COMPLETION, off) for name, off in {
    "suffix": ("",), "prompt_embeds": (),
}.items()} | {name: (_CHAT, off) for name, off in {
    "functions": ([],),
    "function_call": ("none", "auto"), "audio": (), "modalities": (["text"],), "prediction": (),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
    "chat_template": (), "documents": ([],),
    "media_io_kwargs": ({},), "return_prompt_text": (False,), "store": (False,),
    "service_tier": ("auto", "default"),
}.items()}

_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


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
            if value is not None and not any(same(value, off) for off in refused[1]):
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
    include_reasoning: bool = True  # chat only: reasoning_content shown (a reasoning parser's)
    tools: list[dict] | None = None  # chat only: OpenAI's function tools (text/tool_specs.py)
    # chat only: "none", "auto", "required" or the function named; None: no tools
    tool_choice: str | None = None
    parallel_tool_calls: bool = True  # chat only: false: at most one call
    template_kwargs: dict[str, Any] | None = None  # chat only: chat_template_kwargs
    names: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> request field
    lora_request: Any = None  # the LoRA adapter its model names (set by the app); None: base


MAX_STOP = 64  # stop strings per request: each is searched for on every step
MAX_N = 128  # samples per prompt, as OpenAI allows


def parse_completion(body: dict[str, Any],
                     defaults: dict[str, Any] | None = None) -> GenerateRequest:
    """A /v1/completions body -> GenerateRequest; APIError(400) naming the field otherwise."""
    check_fields(body, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "prompt is required", param="prompt")
    logprobs = get_field(body, "logprobs", is_int, "an integer")
    echo = get_field(body, "echo", is_bool, "a boolean", False)
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
    wants = get_field(body, "logprobs", is_bool, "a boolean", False)
    top = get_field(body, "top_logprobs", is_int, "an integer")
    if top not in (None, 0) and not wants:  # 0 is the default: it asks for nothing (as vLLM)
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    continue_final = get_field(body, "continue_final_message", is_bool, "a boolean", False)
    # true unless the final message is continued (a new message's header would close it)
    add_prompt = get_field(body, "add_generation_prompt", is_bool, "a boolean", not continue_final)
    if continue_final and add_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                       "true: the first continues the final message, the second starts a new "
                       "one", param="continue_final_message")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # the engine's errors name the prompt, the token limit and the top logprobs by its words
    names = {"max_tokens": name, "logprobs": "top_logprobs", "prompt": "messages"}
    tools, choice, parallel = _tools(body)
    forced = forced_schema(tools, choice, parallel) if tools else None
    if forced is not None:  # a forced call: its schema constrains the answer
        used = parse_structured(body)[0]
        if used is not None:
            raise APIError(400, f"tool_choice {show(body['tool_choice'])} constrains the answer "
                           "to calls; it cannot also be constrained by response_format or "
                           "structured_outputs", param="tool_choice")
        body = {**body, "structured_outputs": {"json": forced}}
        names |= {"structured_outputs": "tools", "structured_outputs.json": "tools"}
    req = _common(body, default_max_tokens=None, logprobs=(top or 0) if wants else None,
                  names=names, defaults=defaults)
    req.tools, req.tool_choice, req.parallel_tool_calls = tools, choice, parallel
    req.template_kwargs = get_field(body, "chat_template_kwargs", lambda v: isinstance(v, dict),
                                    "an object")
    req.messages = _messages(body["messages"])
    req.add_generation_prompt, req.continue_final_message = add_prompt, continue_final
    # as vLLM's: a new message is the assistant's; a continued one (or a template given no
    # generation prompt) keeps the final message's role
    req.role = "assistant" if add_prompt else req.messages[-1]["role"]
    req.echo = get_field(body, "echo", is_bool, "a boolean", False)
    req.include_reasoning = get_field(body, "include_reasoning", is_bool, "a boolean", True)
    return req


def _tools(body: dict) -> tuple[list[dict] | None, str | None, bool]:
    """(tools, tool_choice, parallel_tool_calls): the tools checked, the choice as a mode or
    the function named ("auto" where tools come without one, as vLLM's; "none" where no tools
    come), each error a 400 naming its field."""
    tools = body.get("tools")
    try:
        tools = check_tools(tools) or None if tools is not None else None
    except ValueError as error:
        raise APIError(400, str(error), param="tools") from None
    try:
        choice = check_tool_choice(body.get("tool_choice"), tools)
    except ValueError as error:
        raise APIError(400, str(error), param="tool_choice") from None
    if choice is None:
        choice = "auto" if tools else "none"
    return tools, choice, get_field(body, "parallel_tool_calls", is_bool, "a boolean", True)


def _common(body: dict, default_max_tokens: int | None, logprobs: int | None,
            names: dict[str, str], defaults: dict[str, Any] | None = None,
            prompt_logprobs: int | None = None) -> GenerateRequest:
    """`defaults`: the model's own temperature / top_p / top_k (generation_config.json), for a
    request that leaves them out, as vLLM's server takes them. `prompt_logprobs`: what echo
    asks for when the body does not name `prompt_logprobs` itself."""
    defaults = defaults or {}
    stream = get_field(body, "stream", is_bool, "a boolean", False)
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
    n = get_field(body, "n", is_int, "an integer", 1)
    if n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", param="n")
    named_prompt_lps = get_field(body, "prompt_logprobs", is_int, "an integer")
    if named_prompt_lps is not None and stream:  # as vLLM: they come whole, in the response
        raise APIError(400, "prompt_logprobs is not supported with stream: true",
                       param="prompt_logprobs")
    truncate = get_field(body, "truncate_prompt_tokens",
                    lambda v: is_int(v) and (v >= 1 or v == -1), "a positive integer or -1")
    names = {"max_tokens": "max_tokens"} | names
    kwargs = dict(
        max_tokens=get_field(body, names["max_tokens"], is_int, "an integer", default_max_tokens),
        temperature=get_field(body, "temperature", is_finite, "a number",
                         defaults.get("temperature", 1.0)),
        top_p=get_field(body, "top_p", is_finite, "a number", defaults.get("top_p", 1.0)),
        top_k=get_field(body, "top_k", is_int, "an integer", defaults.get("top_k")),
        seed=get_field(body, "seed", is_int, "an integer"),
        stop=tuple(stop or ()),
        stop_token_ids=tuple(get_field(body, "stop_token_ids", _is_ids, "a list of integers", [])),
        ignore_eos=get_field(body, "ignore_eos", is_bool, "a boolean", False),
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output",
                                        is_bool, "a boolean", False),
        logprobs=logprobs,
        prompt_logprobs=named_prompt_lps if named_prompt_lps is not None else prompt_logprobs,
        priority=get_field(body, "priority", is_int, "an integer", 0),
        n=n,
        output_kind=RequestOutputKind.DELTA,  # the server streams and gathers deltas
    )
    if body.get("slo_ms") is not None:  # the edf policy's time-to-first-token target
        kwargs["slo_ms"] = get_field(body, "slo_ms", is_finite, "a number")
    kwargs |= _controls(body, defaults)

    structured, constraint_names = parse_structured(body)
    names = names | constraint_names
    try:
        if structured is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        params = SamplingParams(**kwargs)
    except ValueError as error:
        raise client_error(error, names) from None
    return GenerateRequest(model=get_field(body, "model", lambda v: isinstance(v, str), "a string"),
                           prompts=[], params=params, stream=stream, include_usage=include_usage,
                           continuous_usage=continuous_usage,
                           request_id=get_field(body, "request_id", is_text, "a non-empty string"),
                           names=names, prompt_logprobs=named_prompt_lps is not None,
                           truncate_prompt_tokens=truncate,
                           add_special_tokens=get_field(body, "add_special_tokens",
                                                   is_bool, "a boolean"))


def is_strs(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(map(is_int, value))


def _controls(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """The sampler's controls as SamplingParams keywords (it checks their ranges). As vLLM's
    server, repetition_penalty and min_p default to the model's own when it has them."""
    number = (is_finite, "a number")
    return dict(
        presence_penalty=get_field(body, "presence_penalty", *number, 0.0),
        frequency_penalty=get_field(body, "frequency_penalty", *number, 0.0),
        repetition_penalty=get_field(body, "repetition_penalty", *number,
                                defaults.get("repetition_penalty", 1.0)),
        min_p=get_field(body, "min_p", *number, defaults.get("min_p", 0.0)),
        min_tokens=get_field(body, "min_tokens", is_int, "an integer", 0),
        logit_bias=_logit_bias(body),
        bad_words=get_field(body, "bad_words", is_strs, "a list of strings", []),
        allowed_token_ids=get_field(body, "allowed_token_ids", _is_ids, "a list of integers"),
    )


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias, {"50256": -100}: JSON's keys are strings, the sampler's token ids."""
    bias = get_field(body, "logit_bias", lambda v: isinstance(v, dict),
                "an object mapping token ids to numbers")
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]+", key):
            raise APIError(400, f"logit_bias keys must be token ids (strings of digits), got "
                           f"{show(key)}", param="logit_bias")
        if not is_finite(value):
            raise APIError(400, f"logit_bias values must be numbers, got {show(value)} for "
                           f"token {key}", param="logit_bias")
        out[int(key)] = value
    return out


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """stream_options -> (include_usage, continuous_usage_stats). continuous_usage_stats asks
    for the usage in every chunk, and so for the usage itself unless include_usage is false
    (vLLM's include_usage defaults to true)."""
    options = get_field(body, "stream_options", lambda v: isinstance(v, dict), "an object")
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
    # the longest first: "structured_outputs.json" before "structured_outputs"
    for ours in sorted(names, key=len, reverse=True):
        if ours != names[ours]:
            message = re.sub(rf"\b{re.escape(ours)}\b", lambda _, new=names[ours]: new, message)
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
