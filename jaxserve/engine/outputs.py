"""The way out, once: a step's sampled tokens -> stops -> text deltas -> `RequestOutput`s.

`OutputProcessor.update` runs inside the engine loop (`EngineCore`), so the engine, the
simulator and the tests' fake runner share it. Per request it walks the step's new tokens one
at a time and applies every stop in one place:

    token in stop_ids (EOS, stop_token_ids)        -> "stop", reason: the id (None for EOS)
    prompt + output reach max_len (max_tokens or max_model_len)  -> "length"
    the text completes a stop string               -> "stop", reason: the string

and no stop but the length before min_tokens tokens (vLLM's counting: a stop token may be
the min_tokens-th, a stop string must end past it).

A token past a stop is never appended (a multi-step decode samples several per step), so the
output never depends on how tokens were grouped into steps. The scheduler learns only that a
request finished, and how (`Scheduler.finish`, which frees its pages).

`output(request)` then builds the request's `RequestOutput` for the step, as its params'
`output_kind` asks: DELTA (the text, ids and logprobs this step added), CUMULATIVE (all so
far: the lists are the request's own, not copies) or FINAL_ONLY (once, when it finishes).
While a stop string may still match, the text that could begin it is held back.

Per token, the host's cost does not grow with the output's length: nothing is copied whole
per step; the text searched for stop strings is what is held back plus the new token's.
"""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from jaxserve.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
)
from jaxserve.text.detokenizer import make_detokenizer
from jaxserve.text.tokenizer import BaseTokenizer, token_text

if TYPE_CHECKING:
    from jaxserve.core.scheduler import Scheduler
    from jaxserve.core.scheduler_output import SchedulerOutput
    from jaxserve.request import Samples, TokenLogprobs

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


def logprob_dict(lp: "TokenLogprobs", token: int, num_top: int,
                 name: Callable[[int], str] | None = None) -> dict[int, Logprob]:
    """The token's logprob and the top `num_top`, each with its text when `name` gives it."""
    def entry(tid: int, value: float, rank: int | None) -> Logprob:
        return Logprob(value, rank, None if name is None else name(tid))

    out = {token: entry(token, lp.logprob, lp.rank)}
    for rank, (tid, value) in enumerate(zip(lp.top_ids[:num_top].tolist(),
                                            lp.top_logprobs[:num_top].tolist(), strict=True), 1):
        if tid not in out:
            out[tid] = entry(tid, value, rank)
    return out


class _State:
    """What the processor keeps of one request (on `Request.output_state`)."""

    __slots__ = ("context", "detok", "held", "limit", "logprob_sum", "logprobs", "num_sent",
                 "parts", "plain", "prompt_logprobs", "prompt_sent", "stops", "text",
                 "tokens_only")

    def __init__(self, request: Request, tokenizer: BaseTokenizer | None):
        self.detok = None if tokenizer is None else make_detokenizer(tokenizer,
                                                                     request.prompt_ids)
        # what _advance reads per token, once: the output's length limit, the stop strings it
        # searches (none without text), and whether it keeps only ids (no text, logprobs or
        # token mask to follow)
        self.limit = request.max_len - len(request.prompt_ids)
        self.stops = request.params.stop if self.detok is not None else ()
        self.tokens_only = (self.detok is None and request.token_mask is None
                            and request.params.logprobs is None)
        # no stop strings, token mask or logprobs: a token that ends nothing only extends the
        # ids and the text
        self.plain = (not self.stops and request.token_mask is None
                      and request.params.logprobs is None)
        self.held = ""  # text decoded, not handed out yet (it may begin a stop string)
        self.context = ""  # the last text handed out, where a stop string kept in may begin
        self.text = ""  # all text handed out (CUMULATIVE)
        self.parts: list[str] = []  # the text released so far, in pieces (FINAL_ONLY)
        self.num_sent = 0  # output ids handed out (DELTA)
        # logprobs of the kept tokens: all of them, or (DELTA) those not handed out yet
        self.logprobs: list[dict[int, Logprob]] = []
        self.logprob_sum = 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if request.params.prompt_logprobs is None else [None] * len(request.prompt_ids))
        self.prompt_sent = False


class OutputProcessor:
    """Stops, text and outputs of every request; `tokenizer` None: ids only (no stop strings)."""

    def __init__(self, tokenizer: BaseTokenizer | None = None):
        self.tokenizer = tokenizer
        self._name = None if tokenizer is None else (lambda t: token_text(tokenizer, t))

    # -- in the engine loop --------------------------------------------------------------------

    @staticmethod
    def feed_masks(done: "SchedulerOutput", results: Mapping[str, "Samples"]) -> None:
        """Give the token masks of a read iteration's requests (structured/token_masks.py) their new
        tokens, before `update`: the engine loop then makes their next masks at once. A
        request with a mask samples one token a step and keeps it (a stop ends it there)."""
        for chunk in done.chunks:
            request = chunk.request
            if request.token_mask is None or not chunk.num_samples or request.status.finished:
                continue
            samples = results.get(request.request_id)
            if samples is not None:
                request.token_mask.accept(samples.tokens)

    def update(self, scheduler: "Scheduler", done: "SchedulerOutput",
               results: Mapping[str, "Samples"]) -> tuple[list[Request], int]:
        """Take a read iteration's samples: append the tokens each request keeps, apply the
        stops, finish the requests they end. Returns the requests given tokens, and the tokens
        the iteration processed as vLLM's iteration_tokens_total counts them: those kept, and
        the prompts of requests given their first. Samples of requests that finished (or were
        aborted) while their step was in flight are dropped."""
        touched, num_tokens = [], 0
        for chunk in done.chunks:
            request = chunk.request
            if request.status.finished:
                continue
            samples = results.get(request.request_id)
            if samples is None:
                continue
            state = request.output_state
            if state is None:
                state = request.output_state = _State(request, self.tokenizer)
            if samples.prompt_logprobs is not None:
                self._prompt_logprobs(request, state, samples)
            tokens = samples.tokens
            if chunk.num_samples and tokens:
                out = request.output_ids
                if not out:  # its first: the prompt counts too
                    request.metrics.first_token_time = scheduler.clock()
                    num_tokens += len(request.prompt_ids)
                kept = len(out) + 1
                if state.plain and len(tokens) == 1 and kept < state.limit and not (
                        tokens[0] in request.stop_ids and kept >= request.params.min_tokens):
                    # one token that ends nothing (most rows of most steps): what _advance
                    # does with it, inline (per request per step); every stop is _advance's
                    out.append(tokens[0])
                    if state.detok is not None:
                        state.held += state.detok.push(tokens)
                    num_tokens += 1
                else:
                    num_tokens += self._advance(scheduler, request, state, samples)
                touched.append(request)
        return touched, num_tokens

    def _advance(self, scheduler: "Scheduler", request: Request, state: _State,
                 samples: "Samples") -> int:
        """Append the tokens the request keeps, apply the stops; returns how many it kept."""
        params, out, limit, stops = request.params, request.output_ids, state.limit, state.stops
        start = len(out)
        status, reason = None, None
        for token in samples.tokens:
            out.append(token)
            if token in request.stop_ids and len(out) >= params.min_tokens:
                status = RequestStatus.FINISHED_STOPPED
                reason = token if token in request.named_stop_ids else None
            elif len(out) >= limit:
                status = RequestStatus.FINISHED_LENGTH
            if stops:  # token by token: the first to complete a stop string ends the output
                text_ids = [] if status is RequestStatus.FINISHED_STOPPED and not (
                    params.include_stop_str_in_output) else [token]
                hit = self._push(state, params, text_ids, final=False,
                                 search=len(out) > params.min_tokens)
                if hit is not None:
                    status, reason = RequestStatus.FINISHED_STOPPED, hit
                    break
            if status is not None:
                break
        if not state.tokens_only:  # text, a token mask or logprobs to follow
            status, reason = self._follow(request, state, samples, start, status, reason)
        if status is not None:
            scheduler.finish(request, status, reason)
        return len(out) - start

    def _follow(self, request: Request, state: _State, samples: "Samples", start: int,
                status: RequestStatus | None, reason: int | str | None):
        """The rest of `_advance` for the tokens from `start`: the text of a request without
        stop strings, what the detokenizer held, the token mask's verdict, the logprobs.
        Returns the (maybe changed) status and stop reason."""
        params, out = request.params, request.output_ids
        if state.detok is not None and not state.stops:
            new = out[start:]
            if status is RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
                new = new[:-1]  # EOS or a stop token ended it: not text
            state.held += state.detok.push(new)
        if status is not None and state.detok is not None and not isinstance(reason, str):
            # what the detokenizer held back (an unfinished character) is text now, and may
            # complete a stop string too
            hit = self._push(state, params, [], final=True,
                             search=len(out) > params.min_tokens)
            if hit is not None:
                status, reason = RequestStatus.FINISHED_STOPPED, hit
        if request.token_mask is not None and request.token_mask.rejected and status is None:
            # the grammar refused a token (a mask the sampler could not keep: every token
            # masked): the output cannot match any more
            status = RequestStatus.FINISHED_ABORTED
        if params.logprobs is not None and samples.logprobs is not None:
            for token, lp in zip(out[start:], samples.logprobs, strict=False):
                entry = logprob_dict(lp, token, params.logprobs, self._name)
                state.logprobs.append(entry)
                state.logprob_sum += entry[token].logprob
        return status, reason

    def _push(self, state: _State, params, ids: list[int], final: bool,
              search: bool = True) -> str | None:
        """Detokenize `ids` (with `final`, flush what the detokenizer holds) and look (if
        `search`: min_tokens are out, as vLLM counts them) for a stop string in what they add;
        on a hit, cut the text there and return the string.
        Text the detokenizer holds back (an unfinished character, a byte run) counts where it
        would complete one: a stop found there ends the ids, which makes it final."""
        stops = params.stop
        before = len(state.context) + len(state.held)
        state.held += state.detok.finish() if final else state.detok.push(ids)
        if not (stops and search):
            return None
        text = state.context + state.held + ("" if final else state.detok.peek())
        if len(text) == before:
            return None
        # a hit must end in the text just added: one that ended before it was not a stop
        # then (min_tokens not reached), and is not one now
        hits = [(i, s) for s in stops if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        end = index + (len(stop) if params.include_stop_str_in_output else 0)
        state.held = text[len(state.context):max(end, len(state.context))]
        return stop

    def _prompt_logprobs(self, request: Request, state: _State, samples: "Samples") -> None:
        num_top = request.params.prompt_logprobs
        for j, lp in enumerate(samples.prompt_logprobs):
            pos = samples.prompt_start + 1 + j
            state.prompt_logprobs[pos] = logprob_dict(lp, request.prompt_ids[pos], num_top,
                                                      self._name)

    # -- outputs -------------------------------------------------------------------------------

    def output(self, request: Request) -> RequestOutput | None:
        """The request's output for the step that just advanced it (None: FINAL_ONLY and not
        finished yet)."""
        state, params = request.output_state, request.params
        finished = request.status.finished
        kind = params.output_kind
        text = self._release(state, params, finished) if state.held else ""
        if kind is FINAL_ONLY:
            state.parts.append(text)
            if not finished:
                return None
            text, state.parts = "".join(state.parts), []
        wants = params.logprobs is not None
        logprobs = state.logprobs if wants else None
        prompt_logprobs = (state.prompt_logprobs if params.prompt_logprobs is not None
                           else None)
        if kind is DELTA:
            token_ids = request.output_ids[state.num_sent:]
            state.num_sent = len(request.output_ids)
            if wants:
                state.logprobs = []
            if state.prompt_sent:
                prompt_logprobs = None
            state.prompt_sent = True
        else:  # CUMULATIVE, or FINAL_ONLY's one output
            state.text += text
            text, token_ids = state.text, request.output_ids
        # positional: keywords cost as much again, per request per step
        # (index, text, token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob)
        completion = CompletionOutput(
            0, text, token_ids, request.status.value if finished else None,
            request.stop_reason, logprobs, state.logprob_sum if wants else None)
        if finished:  # nothing reads it again: let it go with the output
            request.output_state = None
        # (request_id, prompt, prompt_token_ids, outputs, finished, prompt_logprobs, metrics,
        # num_cached_tokens)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_ids, [completion], finished,
            prompt_logprobs, request.metrics, request.num_cached_tokens or 0)

    @staticmethod
    def _release(state: _State, params, finished: bool) -> str:
        """Hand out the held text but what could still begin a stop string (all of it once
        finished, or when the stop string is kept in the text anyway)."""
        if not params.stop:  # (most requests: all of it)
            text, state.held = state.held, ""
            return text
        keep = 0
        if params.stop and not finished and not params.include_stop_str_in_output:
            keep = max(map(len, params.stop)) - 1
        n = len(state.held) - keep
        if n <= 0:
            return ""
        text, state.held = state.held[:n], state.held[n:]
        if params.stop and params.include_stop_str_in_output:
            state.context = (state.context + text)[-max(map(len, params.stop)):]
        return text
