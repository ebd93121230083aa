"""The only place that touches both worlds: host rows in, padded device arrays, packed results out.

A step is a list of rows, one per sequence: C tokens starting at a position, with the sequence's
pages. Rows are padded to a bucket (B rows x C tokens) so every shape is compiled once:

    rows:    [seq 7: 5 tokens @ 0] [seq 2: 1 token @ 40] [seq 9: 3 tokens @ 16]
    bucket:  B = 4 rows (power of two), C = smallest prefill chunk size >= 5 (or 1 if all decode)
"""

import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.model.attention import resolve_attention_impl
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.loader import load_state, state_bytes
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import make_step_fns

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class Row:
    """One sequence's share of a step."""

    token_ids: list[int]
    start: int  # position of token_ids[0]
    page_ids: list[int]  # the sequence's pages, covering start + len(token_ids) tokens
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    prompt_targets: list[int] | None = None  # next prompt tokens, for prompt logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    rank: int
    top_ids: np.ndarray  # [K] int32
    top_logprobs: np.ndarray  # [K] float32


@dataclass(frozen=True)
class RowResult:
    token: int
    logprobs: TokenLogprobs
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt target


def _unpack(packed: np.ndarray) -> TokenLogprobs:
    """[2 + 2K] int32 (logprob bits, rank, top ids, top bits) -> TokenLogprobs."""
    k = (packed.shape[-1] - 2) // 2
    return TokenLogprobs(
        logprob=float(packed[0:1].view(np.float32)[0]),
        rank=int(packed[1]),
        top_ids=packed[2:2 + k],
        top_logprobs=packed[2 + k:].view(np.float32),
    )


def _bucket(n: int, sizes: tuple[int, ...], what: str) -> int:
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")


class ModelRunner:
    """Owns the weights, the KV pages and the jitted step functions."""

    def __init__(self, model_path: str | None, model_config: ModelConfig, config: EngineConfig):
        self.model_config = model_config
        self.config = config
        self.max_model_len = config.resolve_max_model_len(model_config)
        self.dtype = _DTYPES[model_config.dtype if config.dtype == "auto" else config.dtype]
        self.backend = jax.default_backend()
        self.attention_impl = resolve_attention_impl(config.attention_impl, self.backend)
        self.graphdef, self.state = load_state(model_path, model_config, self.dtype,
                                               config.load_format, config.seed)
        self.page_size = config.page_size
        self.pages_per_seq = config.pages_per_seq(self.max_model_len)
        self.num_pages = config.num_pages or self._pages_that_fit()
        m = model_config
        self.kv = KVCache.zeros(m.num_layers, self.num_pages, self.page_size, m.num_kv_heads,
                                m.head_dim, self.dtype)
        self.fns = make_step_fns(self.graphdef, self.attention_impl, config.max_top_logprobs)
        self.row_buckets = tuple(2**i for i in range(math.ceil(math.log2(config.max_num_seqs)) + 1))
        self.chunk_buckets = (1, *config.prefill_chunk_sizes)
        self.num_compilations = 0
        self._seen_shapes: set[tuple] = set()

    def _pages_that_fit(self) -> int:
        m = self.model_config
        per_page = KVCache.bytes_per_page(m.num_layers, self.page_size, m.num_kv_heads,
                                          m.head_dim, self.dtype)
        stats = jax.devices()[0].memory_stats() if self.backend == "gpu" else None
        if stats:
            free = stats["bytes_limit"] - stats["bytes_in_use"]
        else:
            free = self.config.kv_cache_bytes_cpu
        pages = int(free * self.config.kv_cache_memory_fraction) // per_page
        if pages < 2:
            raise ValueError(f"no room for the KV cache: {free} bytes free, {per_page} per page")
        return pages

    @property
    def weight_bytes(self) -> int:
        return state_bytes(self.state)

    def execute(self, rows: list[Row]) -> list[RowResult]:
        """Run one step over `rows` and return each row's sampled token (synchronously)."""
        if not rows:
            return []
        b = _bucket(len(rows), self.row_buckets, "rows")
        c = _bucket(max(len(r.token_ids) for r in rows), self.chunk_buckets, "chunk length")
        with_prompt = any(r.prompt_targets is not None for r in rows)
        tokens, md, sm, targets = self._arrays(rows, b, c, with_prompt)
        shape_key = (b, c, with_prompt)
        if shape_key not in self._seen_shapes:
            self._seen_shapes.add(shape_key)
            self.num_compilations += 1
        if with_prompt:
            packed, prompt, self.kv = self.fns.step_with_prompt_logprobs(
                self.state, self.kv, tokens, md, sm, targets)
            packed, prompt = jax.device_get((packed, prompt))
        else:
            packed, self.kv = self.fns.step(self.state, self.kv, tokens, md, sm)
            packed, prompt = jax.device_get(packed), None
        results = []
        for i, row in enumerate(rows):
            prompt_lps = None
            if row.prompt_targets is not None:
                prompt_lps = [_unpack(prompt[i, j]) for j in range(len(row.prompt_targets))]
            results.append(RowResult(int(packed[i, 0]), _unpack(packed[i, 1:]), prompt_lps))
        return results

    def _arrays(self, rows: list[Row], b: int, c: int, with_prompt: bool):
        tokens = np.zeros((b, c), np.int32)
        positions = np.zeros((b, c), np.int32)
        query_lens = np.zeros((b,), np.int32)
        page_table = np.zeros((b, self.pages_per_seq), np.int32)
        temperature = np.zeros((b,), np.float32)
        top_k = np.full((b,), self.model_config.vocab_size, np.int32)
        top_p = np.ones((b,), np.float32)
        seeds = np.zeros((b,), np.uint32)
        targets = np.zeros((b, c), np.int32)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            if row.start + n > self.max_model_len:
                raise ValueError(f"row reaches position {row.start + n}, beyond max_model_len "
                                 f"{self.max_model_len}")
            if len(row.page_ids) * self.page_size < row.start + n:
                raise ValueError(f"row's {len(row.page_ids)} pages hold fewer than the "
                                 f"{row.start + n} tokens it reaches")
            tokens[i, :n] = row.token_ids
            positions[i] = row.start + np.arange(c)
            query_lens[i] = n
            page_table[i, :len(row.page_ids)] = row.page_ids
            temperature[i] = row.temperature
            if row.top_k is not None:
                top_k[i] = row.top_k
            top_p[i] = row.top_p
            seeds[i] = row.seed % 2**32
            if row.prompt_targets is not None:
                targets[i, :len(row.prompt_targets)] = row.prompt_targets
        seq_lens = positions[:, 0] + query_lens
        md = AttentionMetadata(positions=positions, query_lens=query_lens, seq_lens=seq_lens,
                               page_table=page_table)
        sm = SamplingMetadata(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds,
                              positions=seq_lens)
        return tokens, md, sm, targets if with_prompt else None

    def warmup(self) -> float:
        """Compile every (rows, chunk) bucket once; returns the seconds it took."""
        start = time.perf_counter()
        for b in self.row_buckets:
            for c in self.chunk_buckets:
                if b * c > max(self.config.max_num_batched_tokens, b) or c > self.max_model_len:
                    continue
                self.execute([Row(token_ids=[0] * c, start=0, page_ids=[0])] * b)
        self.num_compilations = 0
        return time.perf_counter() - start
