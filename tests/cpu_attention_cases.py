"""The CPU attention tests' cases (test_cpu_attention.py, test_cpu_attention_bf16.py and
test_cpu_attention_fp8.py): random pools, page tables and queries; prompt chunks as the runner
builds them, padded and packed; pools with the pages an engine has freed poisoned."""

import jax.numpy as jnp
import numpy as np


def _case(rng, slots, kv_heads, group, head_dim, page_size, pages_per_seq, num_pages,
          dtype=jnp.float32):
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    table = rng.permutation(num_pages - 1)[:slots * pages_per_seq].reshape(slots, -1) + 1
    q = jnp.asarray(rng.standard_normal((slots, kv_heads * group, head_dim)), dtype)
    return q, k, v, jnp.asarray(table, jnp.int32)


def _chunks(rng, starts, query_lens, chunk):
    """positions and seq_lens of prompt chunks as the runner builds them: row b's queries at
    starts[b] + 0 .. chunk-1, the first query_lens[b] real (the rest padding)."""
    starts, query_lens = np.asarray(starts), np.asarray(query_lens)
    positions = starts[:, None] + np.arange(chunk)[None]
    return jnp.asarray(positions, jnp.int32), jnp.asarray(starts + query_lens, jnp.int32)


def _packed(q, positions, query_lens, tokens):
    """The padded rows' real queries one after another, then padding to `tokens`."""
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    take = [(b, c) for b, n in enumerate(query_lens) for c in range(n)]
    pad = tokens - len(take)
    qp = jnp.concatenate([jnp.stack([q[b, c] for b, c in take]),
                          jnp.full((pad, *q.shape[2:]), 7.0, q.dtype)])
    pp = np.array([positions[b, c] for b, c in take] + [0] * pad, np.int32)
    return qp, jnp.asarray(pp), jnp.asarray(starts), take


def _free_before(pools, table, first_keys, page_size, stale=jnp.nan):
    """The pools and table as an engine leaves them once it has freed each row's pages that lie
    wholly before first_keys[b]: those pages, and the null page 0, hold `stale` (NaN), and
    every other such table entry points at page 0. A kernel that read any of them would
    give NaN (a NaN key's weight, or a zero weight times a NaN value)."""
    table = np.array(table)
    freed = [(b, j) for b, first in enumerate(first_keys) for j in range(first // page_size)]
    pages = np.array([0] + [table[b, j] for b, j in freed])
    for b, j in freed[::2]:
        table[b, j] = 0
    return [x.at[pages].set(stale) for x in pools], jnp.asarray(table)
