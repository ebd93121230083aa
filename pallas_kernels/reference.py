"""Pure-jnp paged attention: the reference every kernel is tested against, and the CPU path.

Token j of a sequence lives in page ``page_table[b, j // page_size]`` at offset ``j % page_size``:

    page_table[b] = [7, 3, 9, 0, 0]          page_size = 4, seq_len = 10
    tokens 0..3 -> page 7, 4..7 -> page 3, 8..9 -> page 9 (offsets 0, 1); the rest is never read

Two options every attention function in this package takes, static values, as Hugging Face
transformers (and JAX's TPU kernel) compute them:

    sliding_window w: the query at position p sees the keys j with p - w < j <= p (w keys,
        itself included); None: all of them (causal).
    soft_cap c: the scaled score s = scale * q.k becomes c * tanh(s / c) before masking and
        softmax (Gemma 2); None: s as it is.

    p = 9, w = 4:   keys 0 1 2 3 4 5 [6 7 8 9] 10 ..
    the walks (not this reference) skip the pages that lie wholly left of key p - w + 1
"""

import numbers

import jax
import jax.numpy as jnp

# a pool of 8-bit floats (kv_cache_dtype="fp8"): half a 16-bit pool's bytes, each key and value
# widened to the queries' dtype as it loads (exactly: e4m3's values are bfloat16's and float16's)
FP8_POOL = jnp.dtype(jnp.float8_e4m3fn)


def widen(x: jax.Array, dtype) -> jax.Array:
    """A block of the pool in `dtype` when the pool holds 8-bit floats; else as it is."""
    return x.astype(dtype) if x.dtype == FP8_POOL else x

# Finite stand-in for -inf: a row with no valid key (an empty slot) stays NaN-free.
_MASKED = -1e30


def check_options(sliding_window: int | None, soft_cap: float | None) -> None:
    """sliding_window a positive int, soft_cap a positive number, either None; ValueError
    naming the value otherwise (they are static: a traced value cannot take these)."""
    if sliding_window is not None and (
        not isinstance(sliding_window, numbers.Integral) or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window is {sliding_window!r}, expected a positive int or None")
    if soft_cap is not None and (
        not isinstance(soft_cap, numbers.Real) or isinstance(soft_cap, bool)
        or not 0 < soft_cap < float("inf")
    ):
        raise ValueError(f"soft_cap is {soft_cap!r}, expected a positive number or None")


def cap_scores(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """``soft_cap * tanh(scores / soft_cap)``; scores as they are for None. The kernels keep
    their logits in base 2: they pass the cap in base 2 too (soft_cap * log2(e)), which is the
    same function of the same scores."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def prefill_attention_ref(
    q: jax.Array,  # [B, C, num_heads, head_dim]   a chunk of C queries per sequence
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, pages_per_seq] int32
    positions: jax.Array,  # [B, C] int32   absolute position of each query
    seq_lens: jax.Array,  # [B] int32   keys valid in the pages (chunk included)
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, C, num_heads, head_dim]
    """Causal attention of a chunk of queries over its sequence's pages.

    Query ``(b, c)`` attends to keys ``j`` with ``j <= positions[b, c]`` and ``j < seq_lens[b]``
    (and ``positions[b, c] - sliding_window < j``); soft_cap caps the scaled scores (see the
    module's docstring).
    The chunk's own K/V must already be written into the pages. Queries with no valid key
    (padding, empty slots) give finite garbage that callers ignore. Values past ``seq_lens``
    count as zeros: a page's unwritten tail holds a previous request's values, NaN perhaps
    (an fp16 overflow), and a zero weight times NaN would still be NaN.
    """
    check_options(sliding_window, soft_cap)
    batch, chunk, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    max_len = page_table.shape[1] * page_size

    k = widen(k_pages[page_table].reshape(batch, max_len, num_kv_heads, head_dim), q.dtype)
    v = widen(v_pages[page_table].reshape(batch, max_len, num_kv_heads, head_dim), q.dtype)
    qg = q.reshape(batch, chunk, num_kv_heads, group, head_dim)

    # scores: [B, kv_heads, group, C, max_len], in float32 whatever the input dtype
    scores = jnp.einsum("bckgd,bjkd->bkgcj", qg, k, preferred_element_type=jnp.float32) * scale
    scores = cap_scores(scores, soft_cap)
    key_pos = jnp.arange(max_len, dtype=jnp.int32)
    valid = (key_pos[None, None, :] <= positions[:, :, None]) & (
        key_pos[None, None, :] < seq_lens[:, None, None]
    )  # [B, C, max_len]
    if sliding_window is not None:
        valid &= key_pos[None, None, :] > positions[:, :, None] - sliding_window
    scores = jnp.where(valid[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    v = jnp.where((key_pos[None, :] < seq_lens[:, None])[:, :, None, None], v, 0)
    out = jnp.einsum("bkgcj,bjkd->bckgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, chunk, num_heads, head_dim).astype(q.dtype)


def decode_attention_ref(
    q: jax.Array,  # [S, num_heads, head_dim]   one query per slot, at position seq_lens - 1
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [S, pages_per_seq] int32
    seq_lens: jax.Array,  # [S] int32   0 for an empty slot
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [S, num_heads, head_dim]
    """One query per slot over the slot's first ``seq_lens`` keys (its last ``sliding_window``
    of them with a window)."""
    out = prefill_attention_ref(
        q[:, None], k_pages, v_pages, page_table, (seq_lens - 1)[:, None], seq_lens, scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
    )
    return out[:, 0]
