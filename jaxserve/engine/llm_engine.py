"""The engine: `LLMEngine.step()` = the engine loop's step (loop.py: schedule ->
dispatch -> read the previous step -> stops) + the step's `RequestOutput`s (outputs.py). The
offline API over it, `LLM`, is llm.py's.

Overlap: iteration t+1 is dispatched before iteration t's tokens are read, so the host's
bookkeeping runs while the device computes. Tokens sampled past a stop are discarded.
"""

import dataclasses
import gc
import itertools
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxserve.config.checks import is_int, show
from jaxserve.config.engine import EngineConfig
from jaxserve.config.gguf import gguf_file
from jaxserve.config.model import ModelConfig
from jaxserve.core.scheduler import Scheduler, make_scheduler
from jaxserve.engine.loop import RUNNER_MEMBERS, EngineCore, Runner, Step
from jaxserve.engine.loras import Adapters, UnknownLoRAError  # noqa: F401 (the server's)
from jaxserve.engine.model_files import DEMO, generation_defaults, resolve_model
from jaxserve.engine.outputs import OutputProcessor
from jaxserve.parallel import distributed
from jaxserve.parallel.runners import ReplicaLostError
from jaxserve.request import LoRARequest, Request, RequestOutput, SamplingParams
from jaxserve.structured.token_masks import TokenMask
from jaxserve.text.tokenizer import load_tokenizer, same_vocabulary

if TYPE_CHECKING:
    from jaxserve.model.lora_files import LoraAdapter
    from jaxserve.structured.grammar import GrammarCompiler

log = logging.getLogger("jaxserve")
PromptType = str | dict[str, Any]
GC_YOUNG_THRESHOLD = 20_000  # see freeze_gc


def freeze_gc() -> None:
    """Collect, then move every object alive now out of the cyclic garbage collector's sight.

    A warm engine holds about half a million Python objects (jax's caches, the model's
    wrappers, the tokenizer); a full collection walks all of them, about 280 ms on a 2-core
    CPU, and lands in some request's latency (one validation run saw a 268 ms p99 TTFT against
    40 ms in the others). The process that owns a long-lived engine calls this once the engine
    is warm (as vLLM does); objects made later are collected as usual. Frozen objects are never
    collected as cycles, so a process that builds and drops engines should not call it.

    It also raises the youngest generation's threshold (700 objects by default) to
    `GC_YOUNG_THRESHOLD`: an iteration of 256 requests makes over a thousand objects (chunks,
    samples, outputs) that live one or two iterations, and at 700 every iteration collects
    twice, walking the ones still alive (about 90 µs an iteration at 256 sequences,
    bench/host_overhead.py). At 20,000 a collection comes every dozen iterations, by when
    most of them have died of their reference counts."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), *older)


class LLMEngine:
    """Requests in, RequestOutputs out, one `step()` at a time."""

    def __init__(self, model: str | Path | None, config: EngineConfig, progress: bool = False,
                 runner: Runner | Sequence[Runner] | None = None):
        """`runner`: what runs the steps (loop.Runner), or one per data-parallel
        replica; None builds the model runners for `model` (the tests pass fake ones: no model
        is compiled then, and `model` gives only its config.json and tokenizer)."""
        self.model_path = resolve_model(model)
        self.config = config
        self.model_config = config.served_model(ModelConfig.from_hf_dir(self.model_path))
        source = Path(config.tokenizer) if config.tokenizer else self.model_path
        has_tokenizer = gguf_file(source) is not None or any(
            (source / f).is_file() for f in ("tokenizer.json", "byte_tokenizer.json"))
        if config.tokenizer and not has_tokenizer:
            raise ValueError(f"tokenizer {config.tokenizer!r}: no tokenizer.json, "
                             "byte_tokenizer.json or GGUF file there")
        self.tokenizer = load_tokenizer(source) if has_tokenizer else None
        # the model's default sampling params (generation_config.json), for requests that
        # leave them out: LLM.generate without params, the server's temperature/top_p/top_k
        self.sampling_defaults = generation_defaults(self.model_path)
        cfg = self.model_config
        log.info("model: %s (%s, %.3gM parameters, %s)", self.model_path, cfg.architecture,
                 cfg.num_params / 1e6, cfg.dtype)
        self.draft_path = self._draft_model()
        dp = config.data_parallel_size
        runners = (self._model_runners() if runner is None
                   else list(runner) if isinstance(runner, list | tuple) else [runner])
        if len(runners) != dp:
            raise ValueError(f"data_parallel_size {dp}: {len(runners)} runners given")
        for r in runners:
            missing = [name for name in RUNNER_MEMBERS if not hasattr(r, name)]
            if missing:
                raise TypeError(f"runner {type(r).__name__} lacks {', '.join(missing)} of the "
                                "engine's runner interface (loop.Runner)")
        self.runners = runners
        self.adapters = Adapters(config, self.model_config, runners,
                                 lambda: [c.scheduler for c in self.cores])
        self.max_model_len = runners[0].max_model_len
        # one processor for every replica: a request's text and stops, wherever it runs
        self.processor = OutputProcessor(self.tokenizer)
        model = getattr(runners[0], "model_config", None)
        self.sliding_window = None if model is None else model.shared_window
        # a replica: the engine loop over its own scheduler (KV pool, slots) and runner
        self.cores = [EngineCore(make_scheduler(config, r.num_pages, r.chunk_buckets[-1],
                                                sliding_window=self.sliding_window),
                                 r, processor=self.processor) for r in runners]
        self.warmup_seconds = sum(r.warmup(progress=progress) for r in runners)
        log.info("compiled every step shape in %.1f s", self.warmup_seconds)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset())
        # the stop ids beyond the tokenizer's own EOS (generation_config.json's, Llama-3's
        # <|eom_id|>): a request they end reports them as its stop_reason, as vLLM does
        own = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self.named_eos_ids = self.eos_token_ids - {own} if own is not None else frozenset()
        self._grammar_compiler: GrammarCompiler | None = None
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        # replicas on other processes that were lost, and their requests, failed: (request
        # id, the error) for the caller (the server's engine thread) to answer
        self.lost_replicas: set[int] = set()
        self.failed: list[tuple[str, BaseException]] = []
        # the step whose results the latest step() read: its prompt tokens (of requests it gave
        # their first token) plus the tokens it generated, as vLLM's iteration_tokens_total
        # counts; None when that call read no step
        self.last_step_tokens: int | None = None

    def _model_runners(self) -> list[Runner]:
        """A model runner per data-parallel replica, each on its own devices."""
        from jaxserve.parallel.sharding import replica_devices
        from jaxserve.runner.model_runner import ModelRunner  # jax: only when a model runs here

        config = self.config
        group = distributed.group()
        if group is not None and config.enable_lora:
            raise ValueError("enable_lora: LoRA adapters are served by one process (leave "
                             "num_processes 1)")
        if group is not None:  # replicas over several processes' devices: they follow
            from jaxserve.parallel.runners import LeaderRunner, RemoteRunner, check_group

            grid = check_group(config, group)
        else:
            grid = replica_devices(config.data_parallel_size, config.tensor_parallel_size)
        runners = []
        for i, devices in enumerate(grid):
            if group is not None and i > 0:  # on other processes: they build it
                runners.append(RemoteRunner(group, i, self.model_config.vocab_size))
                continue
            runner = ModelRunner(self.model_path, self.model_config, config, self.draft_path,
                                 devices)
            log.info("%sKV pool: %d pages of %d tokens = %d tokens in flight at most, "
                     "%.1f MiB (%s)", f"replica {i} on {devices}: " if len(grid) > 1 else "",
                     runner.num_pages - 1, config.page_size,
                     (runner.num_pages - 1) * config.page_size,
                     runner.num_pages * runner.kv_bytes_per_page / 2**20, runner.kv_dtype_name)
            runners.append(runner if group is None
                           else LeaderRunner(runner, group, group.replicas[0][1:]))
        return runners

    def _draft_model(self) -> Path | None:
        """The draft model's directory (speculative_config's draft_model), checked to share the
        model's vocabulary token for token; None without one."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        if spec.model is None:
            from jaxserve.demo import CHECKPOINT_DIR, demo_draft_dir

            if self.model_path != CHECKPOINT_DIR:
                raise ValueError("speculative_config.model: the draft model's directory is "
                                 "required (only the demo model has a built-in draft)")
            path = demo_draft_dir()
        else:
            path = Path(spec.model) if spec.model != DEMO else resolve_model(DEMO)
            if not path.is_dir():
                raise ValueError(f"speculative_config.model {spec.model!r} is not a local "
                                 "model directory")
        draft = ModelConfig.from_hf_dir(path)
        if draft.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has "
                             f"{draft.vocab_size} tokens, the model's {self.model_config.vocab_size}"
                             ": a draft must share the model's tokenizer")
        if self.tokenizer is not None and not same_vocabulary(
                self.tokenizer, load_tokenizer(path), draft.vocab_size):
            raise ValueError("speculative_config.model: the draft's tokenizer differs from the "
                             "model's: a draft must share the model's tokenizer")
        log.info("draft model: %s (%.3gM parameters), %d tokens proposed a step", path,
                 draft.num_params / 1e6, spec.num_speculative_tokens)
        return path

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, cap_max_tokens: bool = False,
                    lora_request: LoRARequest | None = None) -> Request:
        """Validate and queue a request; bad input is a ValueError naming the field.
        cap_max_tokens: a max_tokens past max_model_len ends the request at the limit
        (finish_reason "length", as vLLM's offline LLM does) instead of refusing it (as the
        server must). lora_request: the adapter it runs with, loaded first if new (as
        vLLM's)."""
        params = SamplingParams() if params is None else params
        if lora_request is not None:
            self.adapters.check(lora_request)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {show(params)}")
        if params.n != 1:
            raise ValueError(f"n {params.n}: a request to the engine is one sample; add n "
                             "requests with params.for_sample(i) (LLM.generate and the server "
                             "do this)")
        text, ids = self._prompt_ids(prompt)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to generate "
                             f"within max_model_len {limit}")
        if (params.max_tokens is not None and len(ids) + params.max_tokens > limit
                and not cap_max_tokens):
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len {limit}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot match; "
                             "use stop_token_ids")
        if params.prompt_logprobs is not None and not self.config.enable_prompt_logprobs:
            raise ValueError("prompt_logprobs: this engine runs with enable_prompt_logprobs=False")
        params = self._whole_vocabulary(params)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # SamplingParams checked t >= 0
            raise ValueError(f"stop_token_ids must be ids in [0, {vocab}) (the model's "
                             f"vocabulary), got {show(list(params.stop_token_ids))}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}) (the model's "
                             f"vocabulary), got {max(params.logit_bias)}")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids must be ids in [0, {vocab}) (the model's "
                             f"vocabulary), got {max(params.allowed_token_ids)}")
        max_len = limit if params.max_tokens is None else min(len(ids) + params.max_tokens,
                                                              limit)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        request_id = str(next(self._ids)) if request_id is None else request_id
        request = Request(request_id, ids, params, time.monotonic() if arrival_time is None
                          else arrival_time, seed, max_len, self.eos_token_ids, prompt=text,
                          named_eos_ids=self.named_eos_ids, lora_request=lora_request)
        if params.controlled and (params.allowed_token_ids is not None or params.bad_words
                                  or params.min_tokens or params.structured_outputs):
            request.token_mask = TokenMask(
                params, vocab, request.stop_ids, self.tokenizer,
                self.grammars if params.structured_outputs is not None else None)
        self._route(request).add_request(request)
        return request

    def _route(self, request: Request) -> Scheduler:
        """The replica to run a request: the one whose prefix cache holds the most of it, when
        that covers half its prompt or more and the replica is not busier than the least
        loaded by more than a waiting request (SGLang's cache-aware routing); else the least
        loaded, waiting requests counting 4 and running ones 1 (vLLM's data-parallel load
        score), the first of equals."""
        live = [c.scheduler for i, c in enumerate(self.cores) if i not in self.lost_replicas
                and getattr(c.runner, "lost", None) is None]
        if len(live) == 1:
            return live[0]
        loads = [4 * len(s.waiting) + len(s.running) for s in live]
        least = min(range(len(live)), key=loads.__getitem__)
        hits = [s.kv.cached_prefix_len(request) for s in live]
        best = max(range(len(live)), key=hits.__getitem__)
        if 2 * hits[best] >= len(request.prompt_ids) and loads[best] <= loads[least] + 4:
            return live[best]
        return live[least]

    @property
    def grammars(self) -> "GrammarCompiler | None":
        """The grammar compiler of structured output (made when first asked for: the first
        structured request); None without a tokenizer."""
        if self._grammar_compiler is None and self.tokenizer is not None:
            from jaxserve.structured.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    def _whole_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """`params` with logprobs / prompt_logprobs of -1 (the whole vocabulary, as vLLM) as
        the vocabulary's size, each checked against max_top_logprobs: the steps compute that
        many top logprobs (vLLM's max_logprobs), so -1 needs a max_top_logprobs of the
        vocabulary's size."""
        vocab, limit = self.model_config.vocab_size, self.config.max_top_logprobs
        whole = {}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:
                whole[name] = value = vocab
            if value is not None and value > limit:
                asked = f"-1 (the whole vocabulary, {vocab} tokens)" if name in whole else value
                raise ValueError(f"{name} {asked} exceeds max_top_logprobs {limit}"
                                 + (f"; a server with max_top_logprobs {vocab} allows -1"
                                    if name in whole else ""))
        return dataclasses.replace(params, **whole) if whole else params

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt encodes to no tokens: give it some text")
            if max(ids) >= self.model_config.vocab_size:  # an embedding lookup past the table
                raise ValueError(f"prompt: the tokenizer gave token id {max(ids)}, outside the "
                                 f"model's vocabulary of {self.model_config.vocab_size} "
                                 "(its tokenizer.json has tokens config.json does not)")
            return prompt, ids
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(
                prompt.get("prompt"), str):  # vLLM's TextPrompt
            return self._prompt_ids(prompt["prompt"])
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise ValueError("prompt must be a string, a dict with 'prompt_token_ids' or a "
                             f"dict with a 'prompt' string, got {show(prompt)}")
        ids = prompt["prompt_token_ids"]
        vocab = self.model_config.vocab_size
        if not isinstance(ids, list | tuple) or not ids or any(
                not is_int(t) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ids in [0, {vocab})")
        return prompt.get("prompt"), [int(t) for t in ids]

    def abort(self, request_id: str) -> bool:
        """Abort in any state; pages are free at once. False if unknown or already finished."""
        return any(c.scheduler.abort(request_id) is not None for c in self.cores)

    def has_unfinished_requests(self) -> bool:
        return any(c.has_unfinished_requests() for c in self.cores)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while requests hold pages."""
        return all([c.scheduler.reset_prefix_cache() for c in self.cores])

    # -- LoRA adapters (vLLM's add_lora, remove_lora, list_loras: loras.py) ------------------

    @property
    def loras(self) -> dict[str, LoRARequest]:  # the adapters requests may name, by name
        return self.adapters.loras

    @property
    def auto_load_loras(self) -> bool:  # a request naming a new adapter loads it (offline)
        return self.adapters.auto_load

    @auto_load_loras.setter
    def auto_load_loras(self, value: bool) -> None:
        self.adapters.auto_load = value

    def read_lora(self, lora: LoRARequest) -> "LoraAdapter":
        return self.adapters.read(lora)

    def add_lora(self, lora: LoRARequest, adapter: "LoraAdapter | None" = None) -> bool:
        return self.adapters.add(lora, adapter)

    def remove_lora(self, name: str) -> bool:
        return self.adapters.remove(name)

    def list_loras(self) -> dict[str, LoRARequest]:
        return dict(self.adapters.loras)

    @property
    def core(self) -> EngineCore:
        """The engine loop of an engine with one replica (data_parallel_size 1)."""
        if len(self.cores) > 1:
            raise RuntimeError(f"this engine has {len(self.cores)} data-parallel replicas: "
                               "see engine.cores")
        return self.cores[0]

    @property
    def runner(self) -> Runner:
        """The first replica's runner; every replica's is built alike."""
        return self.runners[0]

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of an engine with one replica (data_parallel_size 1)."""
        return self.core.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        """A new scheduler for the same compiled shapes (benchmarks sweep modes on one engine);
        only while no request is unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("the engine still has requests; finish them before a new "
                               "scheduler")
        self.core.scheduler = scheduler

    @property
    def max_num_seqs(self) -> int:
        """Sequences running at once, every replica's slots together."""
        return sum(c.scheduler.max_num_seqs for c in self.cores)

    @property
    def num_kv_pages(self) -> int:
        """Usable KV pages, every replica's pool together."""
        return sum(c.scheduler.kv.pool.num_usable for c in self.cores)

    def num_waiting_for_a_slot(self) -> int:
        """Waiting requests the free slots of their replicas will not take next iteration."""
        return sum(len(c.scheduler.waiting)
                   - max(0, c.scheduler.max_num_seqs - len(c.scheduler.running))
                   for c in self.cores)

    @property
    def num_steps(self) -> int:
        """Iterations dispatched, every replica's."""
        return sum(c.num_steps for c in self.cores)

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Dispatch one iteration, then read the previous one; returns the requests it advanced."""
        if len(self.cores) == 1:
            steps = [self.cores[0].step()]
        else:  # each replica dispatches its next iteration, then reads its previous one:
            # while one waits for its device, the others' devices run theirs
            steps = []
            for i, core in enumerate(self.cores):
                lost = getattr(core.runner, "lost", None)
                if i in self.lost_replicas or not core.has_unfinished_requests():
                    continue
                try:
                    if lost is not None:
                        raise ReplicaLostError(f"data-parallel replica {i} is lost: {lost}")
                    steps.append(core.step())
                except ReplicaLostError as error:
                    self._write_off(i, error)
        read = [step for step in steps if step.done is not None]
        if not read:
            self.last_step_tokens = None
            if not any(step.scheduled.chunks for step in steps):
                self._wait_for_window()
            return []
        self.last_step_tokens = sum(step.num_tokens for step in read)
        outputs = [out for step in read for out in self._process(step)]
        if self.adapters.retiring:
            self.adapters.retire()
        return outputs

    def _write_off(self, replica: int, error: ReplicaLostError) -> None:
        """A replica on other processes is lost: its requests fail (`failed`), the others
        serve on and new requests go to them."""
        core = self.cores[replica]
        self.lost_replicas.add(replica)
        core.inflight = None
        requests = list(core.scheduler.requests)
        for request_id in requests:
            core.scheduler.abort(request_id)
            self.failed.append((request_id, error))
        log.error("%s: %d requests failed; %d replicas serve on", error, len(requests),
                  len(self.cores) - len(self.lost_replicas))

    def _wait_for_window(self) -> None:
        wakes = [w for c in self.cores if (w := c.scheduler.next_wakeup()) is not None]
        if wakes:
            time.sleep(max(0.0, min(min(wakes) - time.monotonic(), 0.05)))

    def _process(self, step: Step) -> list[RequestOutput]:
        """The outputs of the requests a read iteration advanced (their stops were applied in
        the loop), as each one's output_kind asks."""
        output = self.processor.output
        return [out for request in step.touched if (out := output(request)) is not None]

    def stats(self) -> dict[str, Any]:
        """The schedulers' stats (every replica's together) and the engine's."""
        per_replica = [c.scheduler.stats() for c in self.cores]
        stats = per_replica[0] if len(per_replica) == 1 else merge_stats(per_replica)
        return stats | {
            "num_steps": self.num_steps,
            "num_compilations_after_warmup": sum(r.num_compilations_after_warmup
                                                 for r in self.runners),
            "warmup_seconds": self.warmup_seconds,
            "data_parallel_size": len(self.cores),
            # by replica: its requests running and waiting (what routing balances)
            "num_requests_per_replica": [s["num_requests_running"] + s["num_requests_waiting"]
                                         for s in per_replica],
        } | self.adapters.stats()


def merge_stats(per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """Data-parallel replicas' scheduler stats as one engine's: counts summed (lists element
    by element), the KV cache's usage over every pool, fragmentation the pools' mean."""
    merged: dict[str, Any] = {}
    for key in per_replica[0]:
        values = [s[key] for s in per_replica]
        merged[key] = ([sum(v) for v in zip(*values, strict=True)] if isinstance(values[0], list)
                       else sum(values))
    total = merged["kv_pages_total"]
    merged["kv_cache_usage"] = 1.0 - merged["kv_pages_free"] / total if total else 0.0
    merged["kv_fragmentation"] = merged["kv_fragmentation"] / len(per_replica)
    return merged
