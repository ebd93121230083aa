"""The XLA block-walking attention (the CPU path) equals the gather-everything reference.

With a sliding window the pages wholly before a row's first window are NaN in the walk's pools
(and finite in the reference's): the walk must skip them, and a read would show (a masked key's
weight, 0, times NaN is NaN)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention_ref, prefill_attention_ref
from pallas_kernels.blocked import decode_attention_blocked, prefill_attention_blocked


def _pools(rng, num_pages, page_size, kv_heads, head_dim, dtype):
    k = jnp.asarray(rng.standard_normal((num_pages, page_size, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_pages, page_size, kv_heads, head_dim)), dtype)
    return k, v


@pytest.mark.parametrize(("group", "page_size", "ppb"), [(1, 4, 2), (2, 8, 8), (4, 16, 3)])
def test_decode_blocked_equals_reference(group, page_size, ppb):
    rng = np.random.default_rng(group * 10 + page_size)
    slots, kv_heads, head_dim, pages_per_seq = 6, 2, 16, 9
    k, v = _pools(rng, 64, page_size, kv_heads, head_dim, jnp.float32)
    table = jnp.asarray(rng.permutation(63)[:slots * pages_per_seq].reshape(slots, -1) + 1,
                        jnp.int32)
    seq_lens = jnp.array([1, page_size, page_size + 3, 5 * page_size, 0, 9 * page_size],
                         jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, kv_heads * group, head_dim)), jnp.float32)
    want = decode_attention_ref(q, k, v, table, seq_lens, 0.25)
    got = decode_attention_blocked(q, k, v, table, seq_lens, 0.25, pages_per_block=ppb)
    live = np.asarray(seq_lens) > 0
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def _poison_before_window(k, v, table, first_positions, window, page_size):
    """The pools with NaN in the pages each row's walk must skip: those wholly before the
    window of its earliest query (first_positions [B])."""
    table = np.asarray(table)
    pages = np.concatenate([table[b, :max(p - window + 1, 0) // page_size]
                            for b, p in enumerate(np.asarray(first_positions))])
    assert pages.size, "a case whose windows skip no page checks no skip"
    return k.at[pages].set(jnp.nan), v.at[pages].set(jnp.nan)


# (sliding_window, soft_cap, pages_per_block, rows_per_tile): windows of 1 key, not a multiple
# of the page size 4, longer than every sequence; the cap alone and with a window; sorted
# tiles of 2 slots
DECODE_OPTIONS = [(1, None, 2, 16), (6, None, 3, 2), (1000, None, 4, 16), (None, 1.0, 4, 16),
                  (9, 1.0, 3, 2)]


@pytest.mark.parametrize(("sliding_window", "soft_cap", "ppb", "rows_per_tile"), DECODE_OPTIONS)
def test_decode_blocked_with_window_and_cap_equals_reference(sliding_window, soft_cap, ppb,
                                                             rows_per_tile):
    rng = np.random.default_rng(20)
    slots, kv_heads, group, head_dim, page_size, pages_per_seq = 6, 2, 2, 16, 4, 9
    k, v = _pools(rng, 64, page_size, kv_heads, head_dim, jnp.float32)
    table = jnp.asarray(rng.permutation(63)[:slots * pages_per_seq].reshape(slots, -1) + 1,
                        jnp.int32)
    seq_lens = jnp.array([1, page_size, page_size + 3, 5 * page_size, 0, 9 * page_size],
                         jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, kv_heads * group, head_dim)), jnp.float32)
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    want = decode_attention_ref(q, k, v, table, seq_lens, 0.25, **options)
    if sliding_window is not None and sliding_window < max(seq_lens):
        k, v = _poison_before_window(k, v, table, seq_lens - 1, sliding_window, page_size)
    got = decode_attention_blocked(q, k, v, table, seq_lens, 0.25, pages_per_block=ppb,
                                   rows_per_tile=rows_per_tile, **options)
    live = np.asarray(seq_lens) > 0
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_decode_walks_sorted_tiles_of_slots_and_returns_them_in_order():
    # 37 slots of mixed lengths (empty ones too), tiles of 8 after sorting by length: each
    # slot's output is the reference's, in the slot's own place
    rng = np.random.default_rng(3)
    slots, kv_heads, group, head_dim, page_size, pages_per_seq = 37, 2, 2, 16, 4, 10
    k, v = _pools(rng, 400, page_size, kv_heads, head_dim, jnp.float32)
    table = jnp.asarray(rng.permutation(399)[:slots * pages_per_seq].reshape(slots, -1) + 1,
                        jnp.int32)
    seq_lens = jnp.asarray(rng.integers(0, page_size * pages_per_seq + 1, slots), jnp.int32)
    seq_lens = seq_lens.at[:3].set(jnp.array([0, 1, page_size * pages_per_seq]))
    q = jnp.asarray(rng.standard_normal((slots, kv_heads * group, head_dim)), jnp.float32)
    want = np.asarray(decode_attention_ref(q, k, v, table, seq_lens, 0.25))
    got = np.asarray(decode_attention_blocked(q, k, v, table, seq_lens, 0.25, rows_per_tile=8))
    live = np.asarray(seq_lens) > 0
    np.testing.assert_allclose(got[live], want[live], atol=1e-5)
    assert (got[~live] == 0).all()
    untiled = decode_attention_blocked(q, k, v, table, seq_lens, 0.25, rows_per_tile=slots)
    np.testing.assert_allclose(got, np.asarray(untiled), atol=1e-6)


@pytest.mark.parametrize(("dtype", "page_tail"), [(jnp.float32, False), (jnp.bfloat16, False),
                                                 (jnp.float32, True)])
def test_prefill_blocked_equals_reference(dtype, page_tail):
    rng = np.random.default_rng(7)
    batch, chunk, kv_heads, group, head_dim, page_size, pages_per_seq = 3, 8, 2, 2, 16, 4, 12
    k, v = _pools(rng, 48, page_size, kv_heads, head_dim, dtype)
    table = jnp.asarray(rng.permutation(47)[:batch * pages_per_seq].reshape(batch, -1) + 1,
                        jnp.int32)
    starts = np.array([0, 13, 30])
    lens = np.array([8, 5, 8])  # row 1 ends its chunk early (padding queries)
    positions = jnp.asarray(starts[:, None] + np.arange(chunk), jnp.int32)
    seq_lens = jnp.asarray(starts + lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, chunk, kv_heads * group, head_dim)), dtype)
    want = prefill_attention_ref(q, k, v, table, positions, seq_lens, 0.3)
    got = prefill_attention_blocked(q, k, v, table, positions, seq_lens, scale=0.3,
                                    pages_per_block=5, page_tail=page_tail)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for b in range(batch):
        np.testing.assert_allclose(np.asarray(got[b, :lens[b]], np.float32),
                                   np.asarray(want[b, :lens[b]], np.float32), atol=tol, rtol=tol)
    assert jax.tree.all(jax.tree.map(lambda x: bool(jnp.isfinite(x).all()), got))


# (sliding_window, soft_cap, page_tail, dtype), as DECODE_OPTIONS
PREFILL_OPTIONS = [(1, None, False, jnp.float32), (6, None, True, jnp.float32),
                   (100, None, False, jnp.float32), (None, 1.0, False, jnp.float32),
                   (6, 1.0, False, jnp.float32), (13, 2.0, True, jnp.bfloat16)]


@pytest.mark.parametrize(("sliding_window", "soft_cap", "page_tail", "dtype"), PREFILL_OPTIONS)
def test_prefill_blocked_with_window_and_cap_equals_reference(sliding_window, soft_cap,
                                                              page_tail, dtype):
    # chunks from 0, 13 and 30 (row 1's padded), so the windows start on different pages
    rng = np.random.default_rng(21)
    batch, chunk, kv_heads, group, head_dim, page_size, pages_per_seq = 3, 8, 2, 2, 16, 4, 12
    k, v = _pools(rng, 48, page_size, kv_heads, head_dim, dtype)
    table = jnp.asarray(rng.permutation(47)[:batch * pages_per_seq].reshape(batch, -1) + 1,
                        jnp.int32)
    starts, lens = np.array([0, 13, 30]), np.array([8, 5, 8])
    positions = jnp.asarray(starts[:, None] + np.arange(chunk), jnp.int32)
    seq_lens = jnp.asarray(starts + lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, chunk, kv_heads * group, head_dim)), dtype)
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    want = prefill_attention_ref(q, k, v, table, positions, seq_lens, 0.3, **options)
    if sliding_window is not None and sliding_window < starts.max():
        k, v = _poison_before_window(k, v, table, starts, sliding_window, page_size)
    got = prefill_attention_blocked(q, k, v, table, positions, seq_lens, scale=0.3,
                                    pages_per_block=5, page_tail=page_tail, **options)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for b in range(batch):
        np.testing.assert_allclose(np.asarray(got[b, :lens[b]], np.float32),
                                   np.asarray(want[b, :lens[b]], np.float32), atol=tol, rtol=tol)
    assert bool(jnp.isfinite(got).all())


def test_blocked_reads_neither_stale_pages_nor_past_the_table():
    # row 0 is short: its table entries past its pages name a NaN page, which the kernels
    # never read (they read the null page 0 there); row 1's length exceeds its table (4 pages
    # of 4): the reference reads the 16 keys the table holds, and so must the walk (it used to
    # read its last block twice, counting those keys twice)
    rng = np.random.default_rng(11)
    k, v = _pools(rng, 12, 4, 2, 16, jnp.float32)
    k_nan, v_nan = k.at[11].set(jnp.nan), v.at[11].set(jnp.nan)
    table = jnp.array([[1, 11, 11, 11], [2, 3, 4, 5]], jnp.int32)
    seq_lens = jnp.array([3, 20], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    want = np.asarray(decode_attention_ref(q, k, v, table, jnp.array([3, 16], jnp.int32), 0.25))
    for ppb in (1, 2, 4):
        got = np.asarray(decode_attention_blocked(q, k_nan, v_nan, table, seq_lens, 0.25,
                                                  pages_per_block=ppb))
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_stale_nan_in_a_reused_pages_tail_reaches_no_one():
    """A page's tail past a sequence's length holds what its previous request wrote: NaN after
    an fp16 overflow. Its weight is zero, and zero times NaN is NaN, so the values there must
    count as zeros, in the reference and the block walk alike (decode and prefill)."""
    rng = np.random.default_rng(5)
    k, v = _pools(rng, 8, 4, 2, 16, jnp.float32)
    table = jnp.array([[1, 2, 0], [3, 4, 5]], jnp.int32)
    seq_lens = jnp.array([6, 9], jnp.int32)  # page 2 holds tokens 4, 5; page 5 token 8
    k_nan = k.at[2, 2:].set(jnp.nan).at[5, 1:].set(jnp.nan)
    v_nan = v.at[2, 2:].set(jnp.nan).at[5, 1:].set(jnp.nan)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    want = np.asarray(decode_attention_ref(q, k, v, table, seq_lens, 0.25))
    for fn in (decode_attention_ref, decode_attention_blocked):
        np.testing.assert_allclose(np.asarray(fn(q, k_nan, v_nan, table, seq_lens, 0.25)),
                                   want, atol=1e-5)
    qc = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    positions = seq_lens[:, None] - jnp.array([3, 2, 1], jnp.int32)
    want = np.asarray(prefill_attention_ref(qc, k, v, table, positions, seq_lens, 0.25))
    for fn in (prefill_attention_ref, prefill_attention_blocked):
        np.testing.assert_allclose(
            np.asarray(fn(qc, k_nan, v_nan, table, positions, seq_lens, 0.25)), want, atol=1e-5)


@pytest.mark.parametrize(("args", "message"), [
    ({"seq_lens": jnp.zeros((1,), jnp.int32)}, r"seq_lens is int32\[1\], expected int32\[2\]"),
    ({"q": jnp.zeros((2, 6, 16), jnp.float32)}, "q has 6 heads, not a multiple of k_pages' 4"),
    ({"q": jnp.zeros((2, 8, 16), jnp.int8)}, "q has dtype int8"),
    ({"seq_lens": jnp.zeros((2,), jnp.float32)}, r"seq_lens is float32\[2\]"),
    ({"sliding_window": 0}, "sliding_window is 0, expected a positive int or None"),
    ({"soft_cap": -3.0}, r"soft_cap is -3\.0, expected a positive number or None"),
])
def test_blocked_decode_rejects_bad_inputs(args, message):
    call = {"q": jnp.zeros((2, 8, 16), jnp.float32), "k_pages": jnp.zeros((5, 4, 4, 16)),
            "v_pages": jnp.zeros((5, 4, 4, 16)), "page_table": jnp.zeros((2, 3), jnp.int32),
            "seq_lens": jnp.zeros((2,), jnp.int32), "scale": 0.25} | args
    with pytest.raises(ValueError, match=message):
        decode_attention_blocked(**call)
