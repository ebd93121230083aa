"""The offline API, as vLLM's: `LLM(model, **overrides).generate(prompts, sampling_params)`.

For now `generate` runs its requests as static batches (up to max_num_seqs at a time, prompts
chunked to the prefill buckets under max_num_batched_tokens, then decoding together until all
finish); the continuous-batching scheduler takes over this loop.
"""

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.page_pool import PagePool
from jaxserve.request import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from jaxserve.runner import ModelRunner, Row, RowResult, TokenLogprobs
from jaxserve.tokenizer import IncrementalDetokenizer, load_tokenizer

PromptType = str | dict[str, Any] | list[int]


@dataclass
class _Sequence:
    """One request's host state in the offline loop."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    pages: list[int]
    max_len: int  # stop at this many tokens (prompt + output)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def _logprob_dict(lp: TokenLogprobs, token: int, num_top: int) -> dict[int, Logprob]:
    out = {token: Logprob(lp.logprob, lp.rank)}
    for rank, (tid, value) in enumerate(zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top],
                                            strict=True), start=1):
        out.setdefault(int(tid), Logprob(float(value), rank))
    return out


class LLM:
    """A model loaded for offline generation. `model` is a local Hugging Face or orbax directory."""

    def __init__(self, model: str | Path, **overrides: Any):
        self.model_path = Path(model)
        if not self.model_path.is_dir():
            raise ValueError(f"model {str(model)!r} is not a local model directory")
        self.config = EngineConfig.from_overrides(**overrides)
        self.model_config = ModelConfig.from_hf_dir(self.model_path)
        has_tokenizer = any((self.model_path / f).is_file()
                            for f in ("tokenizer.json", "byte_tokenizer.json"))
        self.tokenizer = load_tokenizer(self.model_path) if has_tokenizer else None
        self.runner = ModelRunner(str(self.model_path), self.model_config, self.config)
        self.pool = PagePool(self.runner.num_pages)
        self._rng = random.Random(self.config.seed)
        self._eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self._eos |= set(self.tokenizer.eos_token_ids)

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        arrival = time.time()
        seqs = [self._new_sequence(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        for start in range(0, len(seqs), self.config.max_num_seqs):
            self._run_batch(seqs[start:start + self.config.max_num_seqs])
        return [self._output(s, arrival) for s in seqs]

    def _new_sequence(self, index: int, prompt: PromptType, params: SamplingParams) -> _Sequence:
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        else:
            ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ids in [0, {vocab})")
        limit = self.runner.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit}")
        max_len = limit if params.max_tokens is None else min(limit, len(ids) + params.max_tokens)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        return _Sequence(index, text, ids, params, seed, [], max_len)

    def _run_batch(self, batch: list[_Sequence]) -> None:
        for seq in batch:
            pages = self.pool.allocate(-(-seq.max_len // self.runner.page_size))
            if pages is None:
                raise ValueError(f"not enough KV pages for a batch of {len(batch)}: lower "
                                 "max_num_seqs or max_tokens, or raise num_pages")
            seq.pages = pages
        try:
            while any(s.finish_reason is None for s in batch):
                self._step([s for s in batch if s.finish_reason is None])
        finally:
            for seq in batch:
                self.pool.free(seq.pages)

    def _step(self, running: list[_Sequence]) -> None:
        """Prefill chunks under the token budget, else one decode step for everyone."""
        prefilling = [s for s in running if s.num_computed < len(s.prompt_ids)]
        if prefilling:
            budget, chosen = self.config.max_num_batched_tokens, []
            chunk_cap = self.config.prefill_chunk_sizes[-1]
            for seq in prefilling:
                n = min(len(seq.prompt_ids) - seq.num_computed, chunk_cap, budget)
                if n <= 0:
                    break
                chosen.append((seq, n))
                budget -= n
        else:
            chosen = [(s, 1) for s in running]
        rows = [self._row(seq, n) for seq, n in chosen]
        for (seq, n), result in zip(chosen, self.runner.execute(rows), strict=True):
            self._advance(seq, n, result)

    def _row(self, seq: _Sequence, n: int) -> Row:
        ids = seq.all_ids
        start = seq.num_computed
        targets = None
        if seq.params.prompt_logprobs is not None and start < len(seq.prompt_ids):
            targets = ids[start + 1:start + n + 1]
        p = seq.params
        return Row(ids[start:start + n], start, seq.pages, p.temperature, p.top_k, p.top_p,
                   seq.seed, targets)

    def _advance(self, seq: _Sequence, n: int, result: RowResult) -> None:
        p = seq.params
        if result.prompt_logprobs is not None:
            if seq.num_computed == 0:
                seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
            for lp, target in zip(result.prompt_logprobs, seq.prompt_ids[seq.num_computed + 1:],
                                  strict=False):
                seq.prompt_logprobs.append(_logprob_dict(lp, target, p.prompt_logprobs))
        seq.num_computed += n
        if seq.num_computed < len(seq.prompt_ids):
            return  # mid-prompt: the sampled token is not used
        token = result.token
        seq.output_ids.append(token)
        if p.logprobs is not None:
            seq.logprobs.append(_logprob_dict(result.logprobs, token, p.logprobs))
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self._eos and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.all_ids) >= seq.max_len:
            seq.finish_reason = "length"

    def _output(self, seq: _Sequence, arrival: float) -> RequestOutput:
        ids = seq.output_ids
        if seq.finish_reason == "stop" and seq.stop_reason is None and ids and ids[-1] in self._eos:
            text_ids = ids[:-1]
        else:
            text_ids = ids
        text = ""
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
            text = detok.push(text_ids) + detok.finish()
        completion = CompletionOutput(0, text, ids, seq.finish_reason, seq.stop_reason,
                                      seq.logprobs if seq.params.logprobs is not None else None)
        return RequestOutput(
            request_id=str(seq.index), prompt=seq.prompt, prompt_token_ids=seq.prompt_ids,
            outputs=[completion], finished=True,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=arrival, finished_time=time.time()),
        )

    def stats(self) -> dict[str, int]:
        return {
            "kv_pages_total": self.pool.num_usable,
            "kv_pages_free": self.pool.num_free,
            "num_compilations_after_warmup": self.runner.num_compilations,
        }
