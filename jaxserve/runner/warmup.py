"""Start-up: every step shape the engine can use compiled before the first request (a compile
while serving is a bug, counted in /metrics). Each shape is dispatched once on padding rows,
through the same jitted functions serving uses, so the persistent compilation cache and jit's
own cache both hold them. A mixin of ModelRunner (model_runner.py), whose state it uses.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.buckets import prefill_shapes
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import pack_decode_rows
from jaxserve.runner.inflight import Inflight, PrefillCall
from jaxserve.runner.sampler_controls import Head


class Warmup:
    """ModelRunner's warm-up (a mixin: the state is the runner's)."""

    def warmup(self, progress: bool = False) -> float:
        """Compile every bucket the engine can use; returns the seconds it took."""
        from tqdm import tqdm

        start = time.perf_counter()
        prefill = prefill_shapes(self.chunk_buckets, self.prefill_row_buckets,
                                 self.config.max_num_batched_tokens)
        shapes = [("decode", b, 1, k) for b in self.row_buckets
                  for k in sorted({1, self.config.decode_steps})]
        if self.ragged:  # the model per token bucket, the head per row bucket
            shapes += [("ragged", 1, t, 1) for t in self.token_buckets]
            shapes += [("ragged", b, self.token_buckets[0], 1)
                       for b in self.prefill_row_buckets[1:]]
        else:
            shapes += [("prefill", b, c, 1) for b, c in prefill]
        if self.config.enable_prompt_logprobs:  # one row: see core.buckets.prefill_calls
            shapes += [("prompt", 1, c, 1) for c in self.chunk_buckets]
        # controlled calls: the model without its head, then the head per row bucket
        shapes += [("decode_hidden", b, 1, 1) for b in self.row_buckets]
        if not self.ragged:
            shapes += [("prefill_hidden", b, c, 1) for b, c in prefill]
        shapes += [("head", b, 1, 1)
                   for b in sorted(set(self.row_buckets) | set(self.prefill_row_buckets))]
        shapes += [("verify", b, w, 1) for b in self.row_buckets for w in self.verify_widths]
        with self._counting():
            for kind, b, c, steps in tqdm(shapes, desc="compiling", disable=not progress):
                self._warm(kind, b, c, steps)
            if self.loras is not None and not self.compile_only:  # an adapter's slot writes
                self.loras.warm(self.weights[0])
        jax.block_until_ready(self.kv)
        self._compiles_at_warmup = self.num_compilations
        return time.perf_counter() - start

    def _warm(self, kind: str, b: int, c: int, steps: int) -> None:
        if kind == "ragged":  # a call of c tokens and no rows: every token padding
            self._dispatch_ragged([], [], c, self._zeros, rows=b)
            return
        if kind == "head":  # a controlled call's sampling, its b rows all padding
            slots = np.zeros((b,), np.int32)
            last = self._put(jnp.zeros((self.carry_size, self.model_config.hidden_size),
                                       self.dtype), self.placement)  # committed
            self.finish(Inflight(heads=[Head([], last, self._sampling(slots, slots), slots, 1,
                                             np.full((b,), self.carry_size, np.int32),
                                             PrefillCall([], None))]))
            self._carries = (self._zeros, self._zeros)
            if b == self.row_buckets[0]:  # and the write of a slot's state, once
                self.controls.warm(self.fns)
            return
        md = AttentionMetadata(positions=np.zeros((b, c), np.int32), query_lens=np.zeros((b,), np.int32),
                               seq_lens=np.zeros((b,), np.int32),
                               page_table=np.zeros((b, self.pages_per_seq), np.int32),
                               lora_slots=None if self.loras is None else np.zeros((b,), np.int32))
        sm = SamplingMetadata(np.zeros((b,), np.float32), np.ones((b,), np.int32),
                              np.ones((b,), np.float32), np.zeros((b,), np.uint32),
                              np.zeros((b,), np.int32), np.zeros((b,), bool))
        tokens = np.zeros((b, c), np.int32)
        if kind == "verify":
            drafts, probs = np.zeros((b, c - 1), np.int32), None
            if self.draft is not None:  # on the device, as they come when serving
                drafts, probs = self.draft.warm(b, md.page_table, sm)
            _, self.kv = self.fns.verify(self.weights, self.kv, tokens[:, 0], drafts,
                                         np.zeros((b,), np.int32), md, sm, probs)
        elif kind == "decode_hidden":
            src = np.full((b,), -1, np.int32)
            _, self.kv = self.fns.decode_hidden(self.weights, self.kv, tokens[:, 0], src,
                                                self._zeros, self._zeros, md)
        elif kind == "prefill_hidden":
            _, self.kv = self.fns.prefill_hidden(self.weights, self.kv, tokens, md)
        elif kind == "decode":
            rows = pack_decode_rows(tokens[:, 0], np.full((b,), -1, np.int32), md, sm)
            _, _, self.kv = self.fns.decode(self.weights, self.kv, rows, self._zeros,
                                            self._zeros, steps=steps)
        elif kind == "prefill":
            _, _, self.kv = self.fns.prefill(self.weights, self.kv, tokens, md, sm, self._zeros,
                                             np.zeros((b,), np.int32))
        else:
            *_, self.kv = self.fns.prefill_with_prompt_logprobs(
                self.weights, self.kv, tokens, md, sm, self._zeros, np.zeros((b,), np.int32),
                tokens)
