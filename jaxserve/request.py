"""What a user asks for and what they get back: SamplingParams, RequestOutput; the host state of
a request (Request) and what one iteration gave it (Samples). The shared nouns: every part of
the engine may import this module, and it imports only jaxserve.config."""

import dataclasses
import enum
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config.checks import is_finite, is_int, show


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0  # everything so far, every step (LLM.generate's default)
    DELTA = 1  # only what this step added (the server's streams)
    FINAL_ONLY = 2  # one output, the whole of it, when the request finishes


GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range, as vLLM's API takes it


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (the device keeps them per slot)


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs with (vLLM's LoRARequest): its name (what the server
    calls the model), a positive integer id, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or (
                self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got "
                             f"{self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of a
    JSON schema, any JSON object, a regex, a choice of strings or a grammar (Lark-style EBNF or
    GBNF, as llguidance reads them). Compiled once per distinct value and cached."""

    json: str | dict | None = None  # a JSON schema, as text or parsed
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    # jaxserve's: the grammar applies to the answer after the thinking this reasoning parser
    # reads (qwen3, deepseek_r1: jaxserve/text/reasoning.py), not to the thinking; the server
    # sets it from --reasoning-parser (vLLM's structured outputs do the same for its engine)
    reasoning_parser: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or any(
                    not isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings, "
                                 f"got {show(self.choice)}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {show(value)}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its "
                             f"text), got {show(self.json)}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a boolean, "
                             f"got {show(self.json_object)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean, "
                             f"got {show(self.disable_any_whitespace)}")
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            raise ValueError("structured_outputs.reasoning_parser must be a parser's name, "
                             f"got {show(self.reasoning_parser)}")  # TokenMask checks which
        if len(self.kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar and json_object, got {', '.join(self.kinds) or 'none'}")

    @property
    def kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)
                is not None] + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        """Which one it sets: "json", "regex", "choice", "grammar" or "json_object"."""
        return self.kinds[0]


@dataclass(frozen=True)
class SamplingParams:
    """How to generate, as vLLM's SamplingParams. temperature 0 means greedy."""

    max_tokens: int | None = 16  # None: up to max_model_len
    # no stop (EOS, stop_token_ids, stop strings) ends the output before this many tokens: the
    # sampler masks EOS and the stop ids until then, the host ignores stop strings
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None (or -1/0 as in vLLM's API): no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before
    ignore_eos: bool = False
    # top logprobs per generated token; 0: the sampled one only; -1: the whole vocabulary
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # 0: the logprob of each prompt token; -1 as logprobs
    priority: int = 0  # lower first; the priority policy treats <= 0 as realtime, > 0 as batch
    slo_ms: float | None = None  # time-to-first-token target; the edf policy's deadline
    n: int = 1  # samples per prompt (LLM.generate and the server run n requests: `for_sample`)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The controls below (vLLM's definitions) run in the sampler only for the rows that ask.
    presence_penalty: float = 0.0  # [-2, 2]: minus this from each token the output holds
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    # > 0: a token of the prompt or the output has its logit divided by this if positive,
    # multiplied if negative
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p times the likeliest one
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    bad_words: tuple[str, ...] = ()  # never generated (a word's last token masked after the rest)
    allowed_token_ids: tuple[int, ...] | None = None  # only these are generated
    structured_outputs: StructuredOutputsParams | None = None
    # whether any of the controls above is on: the row samples through the controlled head
    controlled: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        stop = () if self.stop is None else self.stop
        stop = (stop,) if isinstance(stop, str) else stop
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {show(self.stop)}")
        if not isinstance(stop_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of integers, got {show(stop_ids)}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        if is_int(self.top_k) and self.top_k in (-1, 0):
            object.__setattr__(self, "top_k", None)
        if self.max_tokens is not None and not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be a positive integer, got {show(self.max_tokens)}")
        if not (is_int(self.min_tokens) and 0 <= self.min_tokens
                <= (self.min_tokens if self.max_tokens is None else self.max_tokens)):
            raise ValueError("min_tokens must be an integer from 0 to max_tokens, "
                             f"got {show(self.min_tokens)}")
        if not (is_finite(self.temperature) and self.temperature >= 0.0):
            raise ValueError("temperature must be a finite number >= 0, "
                             f"got {show(self.temperature)}")
        if not (is_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {show(self.top_p)}")
        if self.top_k is not None and not (is_int(self.top_k) and self.top_k >= 1):
            raise ValueError("top_k must be a positive integer, -1 or None, "
                             f"got {show(self.top_k)}")
        if self.slo_ms is not None and not (is_finite(self.slo_ms) and self.slo_ms > 0):
            raise ValueError(f"slo_ms must be a positive finite number or None, "
                             f"got {show(self.slo_ms)}")
        if not (is_int(self.n) and self.n >= 1):
            raise ValueError(f"n must be a positive integer, got {show(self.n)}")
        if self.seed is not None and not (is_int(self.seed)
                                          and INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be a 64-bit integer, in [-2**63, 2**63 - 1], "
                             f"got {show(self.seed)}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {show(self.output_kind)}")
        if not is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {show(self.priority)}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {show(getattr(self, name))}")
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (as vLLM)
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= -1):
                raise ValueError(f"{name} must be a non-negative integer or -1 (the whole "
                                 f"vocabulary), got {show(value)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {show(self.stop)}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers, "
                             f"got {show(self.stop_token_ids)}")
        self._check_controls()
        object.__setattr__(self, "controlled", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_p or self.logit_bias or self.min_tokens or self.bad_words
            or self.allowed_token_ids is not None or self.structured_outputs is not None))

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (is_finite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2], got {show(value)}")
        if not (is_finite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError("repetition_penalty must be a finite number > 0, "
                             f"got {show(self.repetition_penalty)}")
        if not (is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1], got {show(self.min_p)}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {show(bias)}")
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias holds {len(bias)} tokens, past the "
                                 f"{MAX_LOGIT_BIAS} a request may bias")
            checked = {}
            for key, value in bias.items():
                token = int(key) if isinstance(key, str) and key.isdigit() else key
                if not is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative "
                                     f"integers), got {show(key)}")
                if not (is_finite(value) and -100.0 <= value <= 100.0):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got "
                                     f"{show(value)} for token {token}")
                checked[int(token)] = float(value)
            object.__setattr__(self, "logit_bias", checked or None)
        words = self.bad_words
        words = () if words is None else (words,) if isinstance(words, str) else words
        if not isinstance(words, list | tuple) or any(
                not isinstance(w, str) or not w for w in words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {show(words)}")
        object.__setattr__(self, "bad_words", tuple(words))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list | tuple) or not allowed or any(
                    not is_int(t) or t < 0 for t in allowed):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {show(allowed)}")
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in allowed))
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, "
                             f"got {show(self.structured_outputs)}")

    @property
    def greedy(self) -> bool:
        """temperature below GREEDY_BELOW samples greedily (as vLLM's: dividing by it would
        only turn exact ties into coin flips)."""
        return self.temperature < GREEDY_BELOW

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of n: one sample each, the seed (if any) + index, so the
        samples differ and a seeded request still reproduces all of them (wrapped into int64:
        the device folds a seed modulo 2**64 anyway)."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return dataclasses.replace(self, n=1, seed=seed)


@dataclass(slots=True)
class Logprob:
    """A token's log-probability under the model, with its rank among the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample's text and tokens: all of them so far, or (`RequestOutputKind.DELTA`) what
    one step added. A cumulative output's lists are the request's own, which grow as it runs:
    copy them to keep a snapshot."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # the sum of the logprobs of every token so far


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    last_preempted_time: float | None = None  # when it last went back to the waiting queue


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was scheduled

    def add(self, later: "RequestOutput") -> None:
        """Append a later delta of the same request to this one, in place (vLLM's
        `RequestOutput.add` with aggregate): a reader that fell behind gets one output for
        the steps it missed. Both must be deltas, and this one the reader's alone."""
        for mine, new in zip(self.outputs, later.outputs, strict=True):
            mine.text += new.text
            mine.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(new.logprobs)
            mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.metrics = later.metrics


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, nothing computed (or preempted: everything to recompute)
    RUNNING = "running"  # holds a slot and pages
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str):
        # a member's own attribute, read per request per step (a property costs 15x as much)
        self.finished = value not in ("waiting", "running")


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED}
# The allowed transitions, in one place. RUNNING -> WAITING is a preemption.
_TRANSITIONS = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, *_FINISHED},
    RequestStatus.RUNNING: {RequestStatus.WAITING, *_FINISHED},
}


class Request:
    """A request's host state. Tokens are counted as vLLM V1 does: computed vs total.

    `num_computed_tokens` counts tokens whose K/V a dispatched step writes; `num_pending` counts
    tokens sampled by dispatched steps that the host has not read yet (they feed the next step on
    the device). A decoding request has total - computed == 1: its newest token is the next input.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 arrival_time: float, seed: int, max_len: int, eos_token_ids: frozenset[int],
                 prompt: str | None = None, named_eos_ids: frozenset[int] = frozenset(),
                 lora_request: LoRARequest | None = None):
        """named_eos_ids: those of eos_token_ids that end a request with themselves as the stop
        reason, as stop_token_ids do (the model's generation_config.json stop ids beside the
        tokenizer's EOS, as vLLM reports them). lora_request: the adapter it runs with (None:
        the base model)."""
        self.request_id = request_id
        self.lora_request = lora_request
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.max_len = max_len  # prompt + output tokens at most
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        # the tokenizer's own EOS reports no stop reason even when stop_token_ids names it (vLLM
        # checks EOS first)
        own_eos = frozenset() if params.ignore_eos else eos_token_ids - named_eos_ids
        self.named_stop_ids = (frozenset(params.stop_token_ids) - own_eos) | (
            frozenset() if params.ignore_eos else named_eos_ids & eos_token_ids
        )
        self.output_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.pages: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_state = None  # what the output processor keeps of it (engine/outputs.py)
        # what it may sample next (token_masks.TokenMask), when its params restrict it
        self.token_mask = None
        # prompt tokens found in the prefix cache when it was first scheduled (None: not yet)
        self.num_cached_tokens: int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def lora_name(self) -> str | None:  # its adapter's name; None: the base model
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        """Tokens that exist or will once pending ones are read: prompt + output + pending."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop], without building the whole list (a long context's would cost
        every step)."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def num_to_compute(self) -> int:
        """1 for a decoding request; more while (re)computing the prompt or after a preemption."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def remaining_tokens(self) -> int:
        """Output tokens it may still produce."""
        return self.max_len - self.num_tokens

    def set_status(self, new: RequestStatus) -> None:
        if new not in _TRANSITIONS.get(self.status, ()):
            raise ValueError(f"request {self.request_id}: {self.status.value} -> {new.value} "
                             "is not an allowed transition")
        self.status = new


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled (or prompt) token's logprob and rank, and the top-K ids and logprobs."""

    logprob: float
    rank: int
    top_ids: np.ndarray  # [K] int32
    top_logprobs: np.ndarray  # [K] float32


@dataclass(slots=True)
class Samples:
    """What one request got from one iteration."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None  # when the request asked for logprobs
    prompt_start: int = 0  # prompt_logprobs[j] is for the prompt token at prompt_start + 1 + j
    prompt_logprobs: list[TokenLogprobs] | None = None
