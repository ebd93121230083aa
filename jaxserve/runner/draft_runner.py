"""The draft model of speculative decoding (method "draft_model"): a smaller model that shares
the target's tokenizer proposes each verification row's k tokens on the device, in one jitted
call; the target's verification reads them there (with the distributions they were drawn from,
for the rejection sampling), never the host.

Its KV pool is its own (its layers, its heads), indexed by the target's page ids: a request's
draft K/V sits at the same (page, offset) as its target K/V, so the target's page tables serve
both and there is no second allocator. How far a request's draft K/V is valid:

    a proposal at start s feeds the row's unfed tokens up to its newest (at s), then its own
        drafts d1 .. dk at s+1 .. s+k (the target's row holds those positions too)
    the verification keeps a drafts: the target's K/V is valid below s + a + 1, and so is the
        draft's, up to what it fed: min(fed, next start)
    a new request, or one preempted since: nothing; its first proposal catches up over prompt
        and output (prefill calls of the draft, one row each, in the target's chunk buckets)
"""

import jax
import numpy as np

from jaxserve.config.model import ModelConfig
from jaxserve.core.buckets import bucket
from jaxserve.core.scheduler_output import ScheduledChunk
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.llama import rope_tables, stack_layers
from jaxserve.model.loader import load_state
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import make_step_fns
from jaxserve.request import Request


class DraftRunner:
    """The draft's weights, KV pool and jitted calls; `propose` for the target's runner."""

    def __init__(self, path, model_config: ModelConfig, *, dtype, backend, kv_dtype_name: str,
                 num_pages: int, page_size: int, max_model_len: int, chunk_buckets, k: int,
                 placement):
        if model_config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                             f"{model_config.max_position_embeddings} is shorter than the "
                             f"target's max_model_len {max_model_len}")
        self.model_config, self.k = model_config, k
        self.page_size, self.chunk_buckets = page_size, chunk_buckets
        graphdef, state = load_state(path, model_config, dtype)
        graphdef, state = backend.ops.pack_weights(graphdef, state)
        if backend.ops.scan_layers and model_config.uniform_layers:
            graphdef, state = stack_layers(graphdef, state, consume=True)
        self.state = state
        self.weights = (jax.tree.leaves(state),
                        jax.device_put(rope_tables(model_config, max_model_len, dtype), placement))
        m = model_config
        self.kv = jax.device_put(backend.attention.zeros(
            m.num_layers, num_pages, page_size, m.num_kv_heads, m.head_dim, kv_dtype_name),
            placement)
        self.fns = make_step_fns(graphdef, jax.tree.structure(state), backend, 0, 2)
        # per request: (its preemptions, positions fed) as of its latest proposal
        self._fed: dict[Request, tuple[int, int]] = {}
        self._warmed_catch_up = False

    def propose(self, chunks: list[ScheduledChunk], page_table: np.ndarray,
                sm: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
        """The k proposals of each verification row and their distributions, on the device:
        (drafts [B, k], q [B, k, V]). `page_table` [B, pages]: the rows' pages (B: the call's
        row bucket), `sm` their sampling arrays (positions: the first proposal's)."""
        b = len(page_table)
        tokens = np.zeros((b, 2), np.int32)
        starts = np.zeros((b,), np.int32)  # where each row's draft chunk begins
        lens = np.zeros((b,), np.int32)
        for i, chunk in enumerate(chunks):
            request, start = chunk.request, chunk.start
            preemptions, fed = self._fed.get(request, (None, 0))
            computed = min(fed, start) if preemptions == request.metrics.num_preemptions else 0
            if computed < start - 1:  # all but the newest two, one prefill call at a time
                self._catch_up(request, computed, start - 1, page_table[i:i + 1])
                computed = start - 1
            starts[i], lens[i] = computed, start + 1 - computed
            tokens[i, :lens[i]] = request.token_ids(computed, start + 1)
            self._fed[request] = (request.metrics.num_preemptions, start + 1 + self.k)
        for request in [r for r in self._fed if r.status.finished]:
            del self._fed[request]
        md = AttentionMetadata(positions=starts[:, None] + np.arange(2, dtype=np.int32),
                               query_lens=lens, seq_lens=starts + lens, page_table=page_table)
        drafts, q, self.kv = self.fns.draft(self.weights, self.kv, tokens, md, sm, steps=self.k)
        return drafts, q

    def _catch_up(self, request: Request, start: int, stop: int, page_table: np.ndarray):
        """Feed the request's tokens [start, stop) to the draft: prefill calls of one row."""
        longest = self.chunk_buckets[-1]
        for at in range(start, stop, longest):
            n = min(longest, stop - at)
            c = bucket(n, self.chunk_buckets, "draft catch-up")
            tokens = np.zeros((1, c), np.int32)
            tokens[0, :n] = request.token_ids(at, at + n)
            md = AttentionMetadata(positions=at + np.arange(c, dtype=np.int32)[None],
                                   query_lens=np.array([n], np.int32),
                                   seq_lens=np.array([at + n], np.int32), page_table=page_table)
            _, self.kv = self.fns.prefill_hidden(self.weights, self.kv, tokens, md)

    def warm(self, b: int, page_table: np.ndarray, sm: SamplingMetadata):
        """Compile the proposal call for b rows (and, once, the catch-up calls); -> as propose."""
        zeros = np.zeros((b,), np.int32)
        md = AttentionMetadata(positions=np.zeros((b, 2), np.int32), query_lens=zeros,
                               seq_lens=zeros, page_table=page_table)
        drafts, q, self.kv = self.fns.draft(self.weights, self.kv, np.zeros((b, 2), np.int32),
                                            md, sm, steps=self.k)
        if not self._warmed_catch_up:
            for c in self.chunk_buckets:
                md = AttentionMetadata(positions=np.zeros((1, c), np.int32),
                                       query_lens=np.zeros((1,), np.int32),
                                       seq_lens=np.zeros((1,), np.int32),
                                       page_table=page_table[:1])
                _, self.kv = self.fns.prefill_hidden(self.weights, self.kv,
                                                     np.zeros((1, c), np.int32), md)
            self._warmed_catch_up = True
        return drafts, q
