"""The OpenAI-compatible HTTP server, as vLLM's: routes, SSE streaming, API key, errors, serving.

    POST /v1/completions, /v1/chat/completions    GET /v1/models, /health, /metrics
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter (with --enable-lora)

A request's body is read within its limits (`body.read_json`), parsed on the event loop and
tokenized in a worker thread (a long prompt would stall every stream), then handed to the
`AsyncEngine`; the loop only ever awaits (it never waits on the device). A client that goes
away, streaming or not, while it is tokenized, queued or served, aborts its request: its pages
are free before the engine's next step. Every error is an `APIError` in vLLM's envelope, and
touches no other request. `serve` runs it under uvicorn with the connection guards of
`connections.py`, and stops within its grace period whatever the engine does.
"""

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    RequestTimeoutError,
)
from jaxserve.engine.llm_engine import LLMEngine, UnknownLoRAError
from jaxserve.engine.request_stream import RequestStream
from jaxserve.parallel import distributed
from jaxserve.request import LoRARequest, RequestOutput
from jaxserve.server import protocol
from jaxserve.server.body import SafeJSONResponse, read_json
from jaxserve.server.config import ServerConfig
from jaxserve.server.connections import ConcurrencyLimit, uvicorn_config
from jaxserve.server.fields import APIError
from jaxserve.server.metrics import CONTENT_TYPE, Metrics, Seen
from jaxserve.server.middleware import AccessLog, APIKey
from jaxserve.server.protocol import GenerateRequest
from jaxserve.server.responses import Formatter
from jaxserve.server.streams import follow, merge, sse_event, until_disconnect

log = logging.getLogger("jaxserve.server")


def _api_error(error: Exception, req: GenerateRequest | None = None) -> APIError:
    """An engine-side exception as the response it deserves."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFullError):
        return APIError(429, str(error), headers={"Retry-After": str(error.retry_after_s)})
    if isinstance(error, EngineDeadError | EngineStoppedError):
        return APIError(503, str(error))
    if isinstance(error, RequestTimeoutError):
        return APIError(504, str(error))
    if isinstance(error, UnknownLoRAError):  # unloaded between the check and the add
        return APIError(404, f"the model does not exist: {error}", param="model")
    if isinstance(error, ValueError):
        return protocol.client_error(error, req.names if req else {})
    raise error


_ENGINE_ERRORS = (QueueFullError, EngineDeadError, EngineStoppedError, RequestTimeoutError,
                  ValueError)  # what adding a request may raise (ValueError: bad input)
_STREAM_ERRORS = (EngineDeadError, EngineStoppedError, RequestTimeoutError)  # what ends a stream


def _handler(fn):
    """Route errors into the envelope: APIError as itself, anything unexpected as a 500."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as error:
            return _error_response(request, error)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            _info(request)["error"] = "client disconnected"
            return Response(status_code=499)  # nginx's "client closed request": for the log
        except Exception as error:
            log.exception("error serving %s", request.url.path)
            return _error_response(request, APIError(500, f"internal error: {error!r}"))

    return endpoint


def _error_response(request: Request, error: APIError) -> JSONResponse:
    _info(request)["error"] = error.message
    return SafeJSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _info(request: Request) -> dict[str, Any]:
    """What the access log line says about this request besides method, path and status."""
    return request.scope.setdefault("jaxserve", {})


class _API:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_name: str):
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        # the model's temperature / top_p / top_k, for requests that leave them out (as vLLM);
        # not its max_new_tokens, which could overflow a long prompt that sent no max_tokens
        self._sampling_defaults = {k: v for k, v in engine.engine.sampling_defaults.items()
                                   if k != "max_tokens"}
        self.metrics = Metrics(engine, model_name)
        engine.on_iteration = self.metrics.observe_iteration
        self.created = int(time.time())
        self._stall_logged = False
        self._lora_ids = 0  # the last id a loaded adapter took

    # -- routes --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_completion(await read_json(request, self.config.max_body_bytes,
                                                       self.config.body_timeout_s), self._sampling_defaults)
        req.lora_request = self._check_model(req.model)
        self._check_prompt_logprobs(req)
        self._check_num_seqs(req, len(req.prompts))
        return await self._generate(request, "completion", req, self._completion_prompts)

    def _completion_prompts(self, req: protocol.GenerateRequest,
                            cancelled: threading.Event) -> tuple[list[dict], list[str]]:
        """The engine prompts of a completion request, and the texts echo shows."""
        prompts, texts = [], []
        for p in req.prompts:
            if cancelled.is_set():  # the client went away: stop tokenizing for nobody
                raise _Disconnected
            if isinstance(p, str):
                ids = self._encode(p, "prompt", req.add_special_tokens is not False)
            else:
                ids, p = p, None
            kept = self._truncate(ids, req)
            if p is not None and len(kept) == len(ids):
                prompts.append({"prompt_token_ids": kept, "prompt": p})
                texts.append(p)
            else:  # token ids, or a text truncated: the echo is what the engine was given
                prompts.append({"prompt_token_ids": kept})
                texts.append(self._decode(kept) if self.tokenizer and req.echo else "")
        return prompts, texts

    async def chat(self, request: Request) -> Response:
        req = protocol.parse_chat(await read_json(request, self.config.max_body_bytes,
                                                       self.config.body_timeout_s), self._sampling_defaults)
        req.lora_request = self._check_model(req.model)
        self._check_prompt_logprobs(req)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template; use "
                           "/v1/completions with token ids", param="messages")
        self._check_num_seqs(req, 1)
        structured = req.params.structured_outputs
        if structured is not None and self.config.reasoning_parser is not None:
            # the constraint (a forced call's too) is the answer's, after the thinking
            req.params = dataclasses.replace(req.params, structured_outputs=dataclasses.replace(
                structured, reasoning_parser=self.config.reasoning_parser))
        if req.tool_choice == "auto" and not self.config.enable_auto_tool_choice:
            raise APIError(400, 'tool_choice "auto" (the default when tools are sent) needs a '
                           "server started with --enable-auto-tool-choice and --tool-call-parser;"
                           ' send tool_choice "none", "required" or a function to call',
                           param="tool_choice")
        return await self._generate(request, "chat", req, self._chat_prompts)

    def _chat_prompts(self, req: protocol.GenerateRequest,
                      cancelled: threading.Event) -> tuple[list[dict], list[str]]:
        prompt = self._chat_prompt(req)
        return [prompt], [prompt.get("prompt", "")]

    def _chat_prompt(self, req: protocol.GenerateRequest) -> dict:
        try:
            text = self.tokenizer.apply_chat_template(
                req.messages, req.add_generation_prompt, req.continue_final_message,
                tools=req.tools, template_kwargs=req.template_kwargs)
        except ValueError as error:
            param = ("chat_template_kwargs" if str(error).startswith("chat_template_kwargs")
                     else "messages")
            raise APIError(400, str(error), param=param) from None
        except Exception as error:  # the model's own template, fed what the client sent
            raise APIError(400, f"messages: the model's chat template failed on them: {error!r}",
                           param="messages") from None
        ids = (self.tokenizer.chat_prompt_ids(text) if req.add_special_tokens is None
               else self.tokenizer.encode(text, req.add_special_tokens))
        kept = self._truncate(ids, req)
        return {"prompt_token_ids": kept} | ({"prompt": text} if len(kept) == len(ids) else {})

    def _truncate(self, ids: list[int], req: protocol.GenerateRequest) -> list[int]:
        """truncate_prompt_tokens: the prompt's last k tokens (-1: as many as max_model_len)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        return ids[-(self.engine.engine.max_model_len if k == -1 else k):]

    def _check_num_seqs(self, req: protocol.GenerateRequest, num_prompts: int) -> None:
        """Prompts x n is what a request queues: bounded before any prompt is tokenized."""
        n, limit = req.params.n, self.config.max_seqs_per_request
        if num_prompts * n > limit:
            raise APIError(400, f"{num_prompts} prompts x n {n} = {num_prompts * n} sequences, "
                           f"more than one request may ask for ({limit}, "
                           "max_seqs_per_request)", param="n" if n > 1 else "prompt")

    def _check_prompt_logprobs(self, req: protocol.GenerateRequest) -> None:
        """The prompt's logprobs, asked for by name or by echo with logprobs, need an engine
        that compiled the steps computing them."""
        if req.params.prompt_logprobs is None or self.engine.engine.config.enable_prompt_logprobs:
            return
        param, what = (("prompt_logprobs", "prompt_logprobs") if req.prompt_logprobs else
                       ("echo", "echo with logprobs (it reports the prompt's logprobs)"))
        raise APIError(400, f"{what}: this server computes no prompt logprobs "
                       "(enable_prompt_logprobs=False)", param=param)

    async def models(self, request: Request) -> Response:
        engine = self.engine.engine
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "jaxserve", "root": str(engine.model_path), "parent": None,
                "max_model_len": engine.max_model_len}
        adapters = [card | {"id": lora.lora_name, "root": lora.lora_path,
                            "parent": self.model_name}
                    for lora in list(engine.loras.values())]  # (a copy: the engine's thread)
        return SafeJSONResponse({"object": "list", "data": [card, *adapters]})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: {"lora_name", "lora_path"}; the adapter is read and checked, then requests
        may name it as their model. Requests in flight are not disturbed."""
        body = await self._lora_body(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        if name == self.model_name or name in self.engine.engine.loras:
            raise APIError(400, f"the LoRA adapter {name!r} has already been loaded",
                           param="lora_name")
        # ids from the event loop's own count: two loads at once never take the same one
        ids = [lora.lora_int_id for lora in list(self.engine.engine.loras.values())]
        self._lora_ids = max([self._lora_ids, *ids]) + 1
        lora = LoRARequest(name, self._lora_ids, path)
        try:
            await self.engine.add_lora(lora)
        except ValueError as error:
            raise APIError(400, str(error), param="lora_path") from None
        log.info("LoRA adapter %s loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: {"lora_name"}; new requests cannot name it, those in flight finish."""
        name = (await self._lora_body(request, ("lora_name",)))["lora_name"]
        if not await self.engine.remove_lora(name):
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", param="lora_name")
        log.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _lora_body(self, request: Request, fields: tuple[str, ...]) -> dict:
        if not self.engine.engine.config.enable_lora:
            raise APIError(400, "this server runs without LoRA adapters (start it with "
                           "--enable-lora)")
        body = await read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name]:
                raise APIError(400, f"{name} must be a non-empty string", param=name)
        return body

    async def health(self, request: Request) -> Response:
        if self.engine.error is not None:
            raise APIError(503, f"the engine is dead: {self.engine.error!r}")
        if not self.engine.is_running:
            raise APIError(503, "the server is shutting down")
        stalled = self.engine.stalled_for()
        if stalled is None:
            self._stall_logged = False
            return SafeJSONResponse({"status": "ok"})
        stats = self.engine.stats()
        message = (f"the engine made no progress for {stalled:.0f} s while work waits "
                   f"(stall_timeout_s {self.engine.stall_timeout_s:g}; last seen: "
                   f"{stats['num_requests_running']} running, "
                   f"{stats['num_requests_waiting']} waiting)")
        if not self._stall_logged:  # once per stall, however often it is probed
            self._stall_logged = True
            log.error("health: %s", message)
        raise APIError(503, message)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # -- helpers -------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model)."""
        if not model or model == self.model_name:  # none or "": the served model, as vLLM
            return None
        lora = self.engine.engine.loras.get(model)
        if lora is None:
            adapters = "".join(f", `{n}`" for n in list(self.engine.engine.loras))
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`{adapters}", param="model")
        return lora

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send prompt token ids", param=param)
        return self.tokenizer.encode(text, add_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        """Prompt token ids as text for echo (the engine checks them against the vocabulary
        when the request is added; a tokenizer may refuse an id before that)."""
        try:
            return self.tokenizer.decode(ids)
        except Exception as error:
            raise APIError(400, f"prompt token ids cannot be decoded for echo: {error}",
                           param="prompt") from None

    async def _generate(self, request: Request, kind: str, req: GenerateRequest,
                        prepare) -> Response:
        """`prepare(req, cancelled)` -> (engine prompts, echo texts) runs in a worker thread
        (tokenizing a long prompt would stall every stream); a client that disconnects while
        it runs or while its requests are queued stops that work (`cancelled` is set)."""
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        info = _info(request)
        info["id"] = request_id
        arrival = time.monotonic()
        n = req.params.n  # choice i: sample i % n of prompt i // n
        cancelled = threading.Event()

        async def admit() -> tuple[list[str], list[RequestStream]]:
            prompts, texts = await asyncio.to_thread(prepare, req, cancelled)
            # all together: they start in one engine iteration, or none of them does
            streams = await self.engine.add_requests(
                [(f"{request_id}-{i * n + j}", prompt, req.params.for_sample(j))
                 for i, prompt in enumerate(prompts) for j in range(n)], arrival,
                req.lora_request)
            return [text for text in texts for _ in range(n)], streams

        admitting = asyncio.ensure_future(admit())
        try:
            admitted = await until_disconnect(request, admitting)
        except _ENGINE_ERRORS as error:
            raise _api_error(error, req) from None
        finally:
            cancelled.set()  # the thread is done by now, unless the client went away
        if not admitted:
            info["error"] = "client disconnected"
            return Response(status_code=499)  # nginx's "client closed request": for the log only
        texts, streams = admitting.result()
        model = self.model_name if req.lora_request is None else req.lora_request.lora_name
        fmt = Formatter(kind, request_id, int(time.time()), model,
                        self.tokenizer, req, texts,
                        prompt_tokens_details=self.config.enable_prompt_tokens_details,
                        reasoning_parser=self.config.reasoning_parser,
                        tool_call_parser=self.config.tool_call_parser)
        if req.stream:
            return StreamingResponse(self._sse(streams, fmt, info), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        last: list[RequestOutput | None] = [None] * len(streams)
        seen = [Seen(req.params.max_tokens) for _ in streams]

        def progress(i: int, out: RequestOutput) -> None:  # a delta: gather the choice's
            self.metrics.progress(seen[i], out, streams[i].inter_token_latencies)
            if last[i] is None:
                last[i] = out
            else:
                last[i].add(out)

        try:
            done = await until_disconnect(request, follow(streams, progress))
        except _STREAM_ERRORS as error:
            raise _api_error(error, req) from None
        finally:
            self.engine.abort_streams(streams)
            self._ended(streams, last, info, n, seen)
        if not done:
            info["error"] = "client disconnected"
            return Response(status_code=499)  # nginx's "client closed request": for the log only
        return SafeJSONResponse(fmt.response(last))

    async def _sse(self, streams: list[RequestStream], fmt: Formatter,
                   info: dict) -> AsyncIterator[str]:
        last: list[RequestOutput | None] = [None] * len(streams)
        seen = [Seen(fmt.req.params.max_tokens) for _ in streams]
        try:
            try:
                async with contextlib.aclosing(merge(streams)) as updates:
                    async for i, out in updates:
                        last[i] = out
                        self.metrics.progress(seen[i], out, streams[i].inter_token_latencies)
                        for chunk in fmt.chunks(i, out):
                            yield sse_event(chunk)
                if fmt.req.include_usage:
                    yield sse_event(fmt.usage_chunk(last))
            except _STREAM_ERRORS as error:
                api_error = _api_error(error, fmt.req)
                info["error"] = api_error.message
                yield sse_event(api_error.body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: the task is cancelled at an await
            self.engine.abort_streams(streams)
            self._ended(streams, last, info, fmt.req.params.n, seen)

    def _ended(self, streams: list[RequestStream], last: list[RequestOutput | None],
               info: dict, n: int, seen: list[Seen]) -> None:
        self.metrics.observe(seen, last, streams, n)
        outs = [o for o in last if o is not None]
        info["prompt_tokens"] = sum(len(o.prompt_token_ids) for o in last[::n] if o is not None)
        info["completion_tokens"] = sum(s.tokens for s in seen)
        finishes = collections.Counter(o.outputs[0].finish_reason if s.finished and o else "abort"
                                       for s, o in zip(streams, last, strict=True))
        info["finish"] = ",".join(reason if count == 1 else f"{reason}x{count}"
                                  for reason, count in finishes.items())
        first = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
                 if o.metrics is not None and o.metrics.first_token_time is not None]
        if first:
            info["ttft"] = f"{max(first):.3f}s"


class _Disconnected(Exception):
    """The client went away while its prompts were being prepared."""


async def _http_error(request: Request, error: HTTPException) -> Response:
    return _error_response(request, APIError(error.status_code, str(error.detail)))


def load_lora_modules(engine: LLMEngine, config: ServerConfig) -> None:
    """lora_modules loaded before serving (a bad one fails the start, naming it); from then
    on a request naming an adapter not loaded is a 404, never a load."""
    engine.auto_load_loras = False
    for lora in config.lora_requests():
        try:
            engine.add_lora(lora)
        except ValueError as error:
            raise ValueError(f"lora_modules {lora.lora_name}={lora.lora_path}: {error}") from None


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str) -> Starlette:
    """The Starlette app over a running AsyncEngine; the app's shutdown stops the engine."""
    engine.engine.auto_load_loras = False
    api = _API(engine, config, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown()  # uvicorn already gave in-flight requests shutdown_grace_s

    routes = [
        Route("/v1/completions", _handler(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _handler(api.chat), methods=["POST"]),
        Route("/v1/models", _handler(api.models), methods=["GET"]),
        Route("/v1/load_lora_adapter", _handler(api.load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", _handler(api.unload_lora_adapter), methods=["POST"]),
        Route("/health", _handler(api.health), methods=["GET"]),
        Route("/metrics", _handler(api.prometheus), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error},
                     middleware=[Middleware(AccessLog),
                                 Middleware(ConcurrencyLimit, limit=config.max_concurrent_requests),
                                 Middleware(APIKey, key=config.api_key)])


def bind(config: ServerConfig) -> socket.socket:
    """The server's listening socket. `jaxserve serve` binds it before the model loads (as
    vLLM does), so a port in use fails at once, not after minutes of compiling."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    return socket.create_server((config.host, config.port), family=family)


def serve(engine: LLMEngine, config: ServerConfig, model_name: str,
          sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM or SIGINT: then stop accepting, give in-flight requests
    `shutdown_grace_s`, abort the rest (a stream gets a 503 error event and [DONE], a request
    a 503), stop the engine, and return 0. If the engine dies, clients get 503s and this
    returns 1, so that a supervisor restarts the server. `sock`: bound already (`bind`).

    The stop takes the grace period and a few seconds whatever the engine does: if its thread
    is stuck in a step, the requests it holds are failed from the event loop one second past
    the grace period, and the process ends without waiting for the thread."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # the engine's grace starts now and ends before uvicorn's (which then cancels
            # handlers outright): requests still running at its end get the engine's 503s,
            # from the engine thread or, if that is stuck, from this timer
            if async_engine.is_running:
                stats = async_engine.stats()
                log.info("stopping: %d running and %d waiting requests have %g s to finish "
                         "(shutdown_grace_s)", stats["num_requests_running"],
                         stats["num_requests_waiting"], config.shutdown_grace_s)
                timer = threading.Timer(config.shutdown_grace_s + 1.0, async_engine.fail_live,
                                        [EngineStoppedError("the engine did not stop within "
                                                            "the shutdown grace period")])
                timer.daemon = True
                timer.start()
            async_engine.begin_shutdown(config.shutdown_grace_s)
            super().handle_exit(sig, frame)

    load_lora_modules(engine, config)
    async_engine = AsyncEngine(engine, max_waiting_requests=config.max_waiting_requests,
                               request_timeout_s=config.request_timeout_s,
                               stall_timeout_s=config.stall_timeout_s)
    group = distributed.group()
    if group is not None:  # a lost process fails the requests, then ends this one
        group.fail_requests = lambda error: async_engine.fail_live(EngineDeadError(str(error)))
    name = config.served_model_name or model_name
    app = build_app(async_engine, config, name)
    sock = bind(config) if sock is None else sock
    host = f"[{config.host}]" if sock.family == socket.AF_INET6 else config.host
    print(f"jaxserve: serving {name!r} at http://{host}:{sock.getsockname()[1]}/v1 "
          "(Ctrl+C to stop)", flush=True)
    uv_config = uvicorn_config(app, header_timeout_s=config.header_timeout_s,
                               max_connections=config.max_connections,
                               timeout_graceful_shutdown=config.shutdown_grace_s + 5)
    # uvicorn handles SIGINT/SIGTERM while it runs, then re-raises the signal to the handler it
    # found: these absorb it, so a graceful stop exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = Server(uv_config)
    async_engine.on_death = lambda error: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    code = 0 if async_engine.error is None else 1
    if async_engine.thread_alive:  # stuck in a step: exit without waiting on it at exit
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
