"""The TPU backend's attention: JAX's own Pallas TPU kernel, `ragged_paged_attention`
(pallas_kernels/tpu_attention.py), in its own pool layout. Its linear layers and reductions
are XLA's (`base.Ops`).

The kernel reads K and V from one pool, interleaved over the head axis; the backend keeps its
cache in that layout (adapting ours to it per step would copy the pool every layer), one pool
for all layers like the others:

    pools = (kv,)   kv: [num_layers * num_pages, page_size, 2 * num_kv_heads, head_dim]

Each head's K and V sit side by side, so tensor parallelism splits the pool over its head axis
as it splits the others' (sharding.kv_spec): each shard holds its heads' K and V.

The kernel is ragged by nature: the runner packs prompt chunks (and a mixed iteration's decode
rows) into one call (`ragged_calls`), as on the CPU backend.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.backends.base import Attention
from jaxserve.model.kv_cache import AttentionMetadata, KVCache, RaggedMetadata
from pallas_kernels import tpu_attention


def _lanes(x: jax.Array, width: int) -> jax.Array:  # [..., head_dim] zero-padded to width
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


@dataclass(frozen=True)
class TpuAttention(Attention):
    """A head_dim the kernel does not take (not a multiple of its 128 lanes: SmolLM2's and
    Llama-3.2-1B's 64) is padded with zeros to whole lanes (tpu_attention.lane_padded): the
    pool holds the padded heads (twice the KV bytes at 64), queries, keys and values are
    padded as they arrive and the outputs cut back, the scores and outputs unchanged."""

    name = "tpu"
    ragged_calls = True
    interpret: bool = False  # run through the Pallas interpreter (the CPU; slow)

    def pool_head_dim(self, head_dim: int) -> int:
        return tpu_attention.lane_padded(head_dim)

    def zeros(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype: str) -> KVCache:
        pool = tpu_attention.kv_pages_zeros(num_layers * num_pages, page_size, num_kv_heads,
                                            self.pool_head_dim(head_dim),
                                            self.pool_dtype(dtype))
        return KVCache(pools=(pool,), num_pages=num_pages)

    def write(self, kv: KVCache, k: jax.Array, v: jax.Array,
              index: tuple[jax.Array, jax.Array]) -> KVCache:
        (pool,) = kv.pools
        page, offset = index
        width = pool.shape[-1]
        pool = tpu_attention.write_kv(pool, _lanes(k.astype(pool.dtype), width),
                                      _lanes(v.astype(pool.dtype), width), page, offset)
        return KVCache(pools=(pool,), num_pages=kv.num_pages)

    def padded(self, q: jax.Array, kv: KVCache, md: AttentionMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        out = tpu_attention.padded_attention(_lanes(q, kv.pools[0].shape[-1]), kv.pools[0],
                                             md.page_table, md.positions, md.query_lens,
                                             md.seq_lens, scale, interpret=self.interpret,
                                             sliding_window=sliding_window, soft_cap=soft_cap)
        return out[..., :q.shape[-1]]

    def ragged(self, q: jax.Array, kv: KVCache, md: RaggedMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        rows = md.page_table.shape[0]  # the metadata's rows past the call's are empty
        out = tpu_attention.ragged_attention(_lanes(q[0], kv.pools[0].shape[-1]), kv.pools[0],
                                             md.page_table, md.query_starts, md.seq_lens,
                                             jnp.int32(rows), scale, interpret=self.interpret,
                                             sliding_window=sliding_window, soft_cap=soft_cap)
        return out[None, ..., :q.shape[-1]]
