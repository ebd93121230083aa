"""The response bodies and SSE chunks of /v1/completions and /v1/chat/completions, as OpenAI's
and vLLM's: choices, logprobs (with text offsets and echoed prompts), usage."""

import codecs
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from jaxserve.request import Logprob, RequestOutput
from jaxserve.server.protocol import GenerateRequest
from jaxserve.text.detokenizer import IncrementalDetokenizer
from jaxserve.text.reasoning import ReasoningStream, split
from jaxserve.text.tokenizer import token_text
from jaxserve.text.tool_parsers import ToolCallStream
from jaxserve.text.tool_parsers import parse as parse_calls
from jaxserve.text.tool_specs import ForcedCallStream, forced_calls


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


@dataclass
class _Sent:
    """What a stream already sent of one choice."""

    num_tokens: int = 0
    started: bool = False
    offsets: "_Offsets" = field(default_factory=lambda: _Offsets())
    thinking: ReasoningStream | None = None  # a reasoning parser's split of the text so far
    calls: ToolCallStream | ForcedCallStream | None = None  # the answer's tool calls so far


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
    prompt, choice i is sample i % n of prompt i // n (OpenAI's numbering). The engine's
    outputs are deltas (RequestOutputKind.DELTA): `chunk` sends each as it comes; `response`
    takes each choice's deltas added together.
    """

    def __init__(self, kind: str, request_id: str, created: int, model: str, tokenizer,
                 req: GenerateRequest, prompt_texts: list[str],
                 prompt_tokens_details: bool = False, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None):
        self.kind, self.created, self.model = kind, created, model
        self.details = prompt_tokens_details  # usage names the cached prompt tokens
        # the client's request_id names the response (as vLLM's); the engine's ids stay unique
        self.id = request_id if req.request_id is None else (
            ("chatcmpl-" if kind == "chat" else "cmpl-") + req.request_id)
        self.tokenizer = tokenizer
        self.req = req
        self.prompt_texts = prompt_texts
        # a chat's thinking apart from its answer (`reasoning_parser`: jaxserve/text/reasoning.py)
        self.reasoning = reasoning_parser if kind == "chat" else None
        # the answer's tool calls: forced ("required" or a function named: the answer is
        # them) or read by the server's tool-call parser ("auto"); None: the answer is content
        choice = req.tool_choice if kind == "chat" else None
        self.tool_parser = tool_call_parser if choice == "auto" else None
        self.forced = choice if choice not in (None, "none", "auto") else None
        self._sent = [_Sent(thinking=None if self.reasoning is None
                            else ReasoningStream(self.reasoning),
                            calls=self._call_stream()) for _ in prompt_texts]
        # chat echo (vLLM's): the reply starts with the last message's content when that
        # message has the reply's role (a continued message, or an assistant's prefill)
        last = req.messages[-1] if req.messages else {}
        self._chat_echo = (last["content"] if kind == "chat" and req.echo
                           and last.get("role") == req.role else "")

    def _call_stream(self) -> ToolCallStream | ForcedCallStream | None:
        if self.forced is not None:
            return ForcedCallStream(self.forced)
        return ToolCallStream(self.tool_parser) if self.tool_parser is not None else None

    def _calls(self, content: str | None) -> tuple[str | None, list]:
        """A finished answer's content and tool calls (as its stream gives them)."""
        if self.forced is not None:
            calls = forced_calls(content or "", self.forced)
            return (content, []) if calls is None else (None, calls)
        if self.tool_parser is not None and content:
            content, calls = parse_calls(self.tool_parser, content)
            return content, calls[:1] if not self.req.parallel_tool_calls else calls
        return content, []

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" where the model called (auto) or had to ("required"), and
        stopped by itself; a named function's call ends as any answer ("stop")."""
        if reason == "stop" and called and self.forced in (None, "required"):
            return "tool_calls"
        return reason

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The non-streaming body, with usage."""
        outputs = [self._shown(out) for out in outputs]
        choices = []
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            lps = self._logprobs(out, _Offsets(), echo=self.req.echo, index=i)
            if self.kind == "chat":
                message = {"role": self.req.role, "content": self._chat_echo + c.text}
                reasoning, content = (None, c.text) if self.reasoning is None else split(
                    self.reasoning, c.text)
                content, calls = self._calls(content)
                if self.reasoning is not None or calls:
                    message["content"] = (self._chat_echo + (content or "")) or None
                if self.reasoning is not None and self.req.include_reasoning:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                choices.append({"index": i, "message": message, "logprobs": lps,
                                "finish_reason": self._finish_reason(c.finish_reason,
                                                                     bool(calls)),
                                "stop_reason": c.stop_reason})
            else:
                text = (self.prompt_texts[i] if self.req.echo else "") + c.text
                choices.append({"index": i, "text": text, "logprobs": lps,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if self.req.prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(out)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = self._head(obj) | {"choices": choices, "usage": usage(
            [len(o.prompt_token_ids) for o in outputs],
            [len(o.outputs[0].token_ids) for o in outputs], self.req.params.n,
            [o.num_cached_tokens for o in outputs] if self.details else None)}
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

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The SSE chunks carrying `out`, a delta of choice `index` (none: nothing new): one,
        or with tool calls one a delta (a call's name, then its arguments)."""
        out = self._shown(out)
        sent, c = self._sent[index], out.outputs[0]
        text = c.text
        first = not sent.started
        if not (text or c.token_ids or out.finished or first):
            return []
        echo = first and self.req.echo and self.kind == "completion"
        lps = self._logprobs(out, sent.offsets, echo=echo, index=index)
        sent.num_tokens += len(c.token_ids)
        sent.started = True
        finish = c.finish_reason if out.finished else None
        stop_reason = c.stop_reason if out.finished else None
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        earlier = []
        if self.kind == "chat":
            if sent.calls is not None:
                deltas = self._tool_deltas(sent, text, out.finished, first)
                delta = deltas.pop() if deltas else {}
                earlier = [self._head(obj) | {"choices": [{
                    "index": index, "delta": d, "logprobs": None, "finish_reason": None,
                    "stop_reason": None}]} | ({"usage": None} if self.req.include_usage else {})
                    for d in deltas]
                if out.finished:
                    finish = self._finish_reason(finish, bool(sent.calls.calls))
            elif sent.thinking is not None:
                delta = self._thinking(sent.thinking, text, out.finished, first)
            elif text or first:
                delta = ({"role": self.req.role, "content": self._chat_echo + text} if first
                         else {"content": text})
            else:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": lps,
                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": (self.prompt_texts[index] if echo else "") + text,
                      "logprobs": lps, "finish_reason": finish, "stop_reason": stop_reason}
        body = self._head(obj) | {"choices": [choice]}
        if self.req.include_usage:  # vLLM's continuous_usage_stats: this choice's so far
            body["usage"] = (usage([len(out.prompt_token_ids)], [sent.num_tokens],
                                   cached_tokens=[out.num_cached_tokens] if self.details
                                   else None)
                             if self.req.continuous_usage else None)
        return [*earlier, body]

    def _tool_deltas(self, sent: _Sent, text: str, finished: bool,
                     first: bool) -> list[dict[str, Any]]:
        """A chat delta's text as OpenAI's deltas with tool calls: the thinking (a reasoning
        parser's), content, and each call's name with its id, then its arguments."""
        reasoning, content = "", text
        if sent.thinking is not None:
            events = sent.thinking.feed(text) + (sent.thinking.finish() if finished else [])
            reasoning = "".join(t for kind, t in events if kind == "reasoning")
            content = "".join(t for kind, t in events if kind == "content")
        events = sent.calls.feed(content) if content or first else []
        if finished and isinstance(sent.calls, ToolCallStream):
            events += sent.calls.finish()
        deltas: list[dict[str, Any]] = []
        if reasoning and self.req.include_reasoning:
            deltas.append({"reasoning_content": reasoning})
        for event in events:
            kind, *rest = event
            if kind == "content":
                if deltas and set(deltas[-1]) == {"content"}:
                    deltas[-1]["content"] += rest[0]
                else:
                    deltas.append({"content": rest[0]})
                continue
            k, call = rest
            if k > 0 and not self.req.parallel_tool_calls:
                continue  # one call asked for: the first
            if kind in ("call", "name"):
                deltas.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                               "function": {"name": call.name,
                                                            "arguments": ""}}]})
            if kind in ("call", "arguments"):
                piece = call.arguments if kind == "call" else rest[1]
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        if first:
            head = {"role": self.req.role}
            if self._chat_echo or not deltas:
                head["content"] = self._chat_echo
            deltas[:1] = [head | deltas[0]] if deltas and "content" not in head else (
                [head, *deltas])
        return deltas

    def _thinking(self, stream: ReasoningStream, text: str, finished: bool,
                  first: bool) -> dict[str, Any]:
        """A chat delta's text split by the reasoning parser: reasoning_content and content
        (each only when it has some; the first delta carries the role)."""
        events = stream.feed(text) + (stream.finish() if finished else [])
        reasoning = "".join(t for kind, t in events if kind == "reasoning")
        content = "".join(t for kind, t in events if kind == "content")
        delta: dict[str, Any] = {"role": self.req.role} if first else {}
        if first and self._chat_echo:
            content = self._chat_echo + content
        if reasoning and self.req.include_reasoning:
            delta["reasoning_content"] = reasoning
        if content or (first and not reasoning):
            delta["content"] = content
        return delta

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The final usage chunk: `outputs` are each choice's last delta (`chunk` counted the
        tokens sent)."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(
            [len(out.prompt_token_ids) for out in outputs],
            [sent.num_tokens for sent in self._sent], self.req.params.n,
            [out.num_cached_tokens for out in outputs] if self.details else None)}

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

    def _logprobs(self, out: RequestOutput, offsets: _Offsets, echo: bool = False,
                  index: int = 0) -> dict[str, Any] | None:
        """Choice `index`'s logprobs of `out`'s tokens; with `echo`, its prompt's first."""
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        ids, entries = c.token_ids, c.logprobs
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


def usage(prompt_tokens: list[int], completion_tokens: list[int], n: int = 1,
          cached_tokens: list[int] | None = None) -> dict[str, Any]:
    """Token counts of a response, per choice: n samples per prompt, prompt by prompt, and
    each prompt counts once (as in vLLM and OpenAI); `cached_tokens`, per choice, the prompt
    tokens found in the prefix cache (OpenAI's prompt_tokens_details.cached_tokens; None:
    prompt_tokens_details is null, vLLM's default)."""
    prompt = sum(prompt_tokens[::n])
    completion = sum(completion_tokens)
    details = None if cached_tokens is None else {"cached_tokens": sum(cached_tokens[::n])}
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": details}
