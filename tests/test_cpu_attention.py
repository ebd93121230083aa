"""The C++ attention for the CPU (cpu_kernels/cpu_decode.cc and cpu_prefill.cc, through XLA's
FFI) equals the gather-everything reference, and the engine picks it, or falls back, as it says.
Its bfloat16 pools: test_cpu_attention_bf16.py; its float8 ones: test_cpu_attention_fp8.py."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_attention_cases import _case, _chunks, _free_before, _packed

from cpu_kernels import library as cpu_library
from cpu_kernels.attention import (
    decode_attention_cpu,
    prefill_attention_cpu,
    prefill_attention_cpu_ragged,
)
from cpu_kernels.library import KernelUnavailable
from jaxserve.backends import resolve_attention_impl
from jaxserve.config.engine import kv_cache_dtype
from pallas_kernels import decode_attention_ref, prefill_attention_ref


# slots < 2 x threads: each slot's KV heads are shared among the threads; more: whole slots
@pytest.mark.parametrize(("slots", "kv_heads", "group", "head_dim", "page_size"), [
    (1, 2, 1, 16, 4), (3, 4, 2, 32, 8), (6, 2, 4, 16, 16), (37, 1, 8, 64, 4), (70, 4, 2, 8, 2),
    (9, 2, 2, 12, 4),  # head_dim not a multiple of 8: plain loops, not the AVX2 sums
    (5, 2, 3, 32, 4), (8, 2, 3, 64, 8),  # an odd group: query heads in pairs and one alone
])
def test_cpu_decode_equals_reference(slots, kv_heads, group, head_dim, page_size):
    rng = np.random.default_rng(slots)
    pages_per_seq = 7
    q, k, v, table = _case(rng, slots, kv_heads, group, head_dim, page_size, pages_per_seq,
                           slots * pages_per_seq + 5)
    lens = rng.integers(0, page_size * pages_per_seq + 1, slots)
    lens[0] = max(lens[0], 1)
    lens[-1] = page_size * pages_per_seq  # a full table
    if slots > 2:
        lens[1] = 0  # an empty slot: zeros
    seq_lens = jnp.asarray(lens, jnp.int32)
    want = np.asarray(decode_attention_ref(q, k, v, table, seq_lens, 0.3))
    got = np.asarray(jax.jit(decode_attention_cpu, static_argnums=5)(q, k, v, table, seq_lens,
                                                                     0.3))
    live = lens > 0
    np.testing.assert_allclose(got[live], want[live], atol=2e-6, rtol=1e-5)
    assert (got[~live] == 0).all()


def _attention_float64(q, k, v, table, seq_lens, scale):
    """Decode attention in numpy float64, a slot at a time: the truth both float32 paths
    approximate."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    kv_heads, head_dim = k.shape[2:]
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for s, n in enumerate(np.asarray(seq_lens)):
        pages = np.asarray(table)[s]
        keys = k[pages].reshape(-1, kv_heads, head_dim)[:n]
        values = v[pages].reshape(-1, kv_heads, head_dim)[:n]
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[s, h] * scale
            weights = np.exp(scores - scores.max())
            out[s, h] = weights @ values[:, h // group] / weights.sum()
    return out


def test_cpu_decode_softmax_holds_for_peaked_and_flat_scores():
    # the kernel's own exponential (a polynomial) across the range: scores about a hundred
    # apart (all weight on a few keys, the rest below float32's smallest normal) and all equal.
    # Against float64: at these scores float32 rounding alone moves the reference by 4e-5
    rng = np.random.default_rng(4)
    q, k, v, table = _case(rng, 4, 2, 2, 32, 8, 5, 24)
    seq_lens = jnp.array([40, 33, 17, 1], jnp.int32)
    for q_scaled in (q * 40.0, jnp.zeros_like(q)):
        want = _attention_float64(q_scaled, k, v, table, seq_lens, 0.5)
        got = np.asarray(decode_attention_cpu(q_scaled, k, v, table, seq_lens, 0.5))
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_cpu_decode_reads_neither_stale_pages_nor_past_the_table():
    # row 0 is short: its table entries past its pages and its last page's tail hold NaN (a
    # reused page after an overflow), which it never reads; row 1's length exceeds its table:
    # the 16 keys the table holds count, as in the reference; row 2 names pages outside the
    # pool, read as the null page rather than out of bounds
    rng = np.random.default_rng(11)
    q, k, v, _ = _case(rng, 3, 2, 2, 16, 4, 4, 16)
    k_nan = k.at[11].set(jnp.nan).at[1, 3:].set(jnp.nan)
    v_nan = v.at[11].set(jnp.nan).at[1, 3:].set(jnp.nan)
    table = jnp.array([[1, 11, 11, 11], [2, 3, 4, 5], [6, 99, -7, 0]], jnp.int32)
    got = np.asarray(decode_attention_cpu(q, k_nan, v_nan, table,
                                          jnp.array([3, 20, 16], jnp.int32), 0.25))
    want = np.asarray(decode_attention_ref(q, k, v, table.at[2].set(jnp.array([6, 0, 0, 0])),
                                           jnp.array([3, 16, 16], jnp.int32), 0.25))
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_cpu_decode_takes_16_bit_queries_and_gives_their_dtype():
    rng = np.random.default_rng(2)
    q, k, v, table = _case(rng, 4, 2, 2, 16, 4, 3, 16, dtype=jnp.bfloat16)
    seq_lens = jnp.array([5, 12, 1, 7], jnp.int32)
    got = decode_attention_cpu(q, k, v, table, seq_lens, 0.25)
    want = decode_attention_ref(q.astype(jnp.float32), k, v, table, seq_lens, 0.25)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2)


@pytest.mark.parametrize(("args", "message"), [
    ({"seq_lens": jnp.zeros((1,), jnp.int32)}, r"seq_lens is int32\[1\], expected int32\[2\]"),
    ({"q": jnp.zeros((2, 6, 16), jnp.float32)}, "q has 6 heads, not a multiple of k_pages' 4"),
    ({"q": jnp.zeros((2, 8), jnp.float32)}, r"expected \[slots, num_heads, head_dim\]"),
    ({"k_pages": jnp.zeros((5, 4, 4, 16), jnp.bfloat16),
      "v_pages": jnp.zeros((5, 4, 4, 16), jnp.bfloat16)}, "as uint16 bits, got bfloat16/bfloat16"),
    ({"sliding_window": 0}, "sliding_window is 0, expected a positive int or None"),
    ({"soft_cap": -1.0}, "soft_cap is -1.0, expected a positive number or None"),
])
def test_cpu_decode_rejects_bad_inputs(args, message):
    call = {"q": jnp.zeros((2, 8, 16), jnp.float32), "k_pages": jnp.zeros((5, 4, 4, 16)),
            "v_pages": jnp.zeros((5, 4, 4, 16)), "page_table": jnp.zeros((2, 3), jnp.int32),
            "seq_lens": jnp.zeros((2,), jnp.int32), "scale": 0.25} | args
    with pytest.raises(ValueError, match=message):
        decode_attention_cpu(**call)


# work items are blocks of 16 queries: chunks below, at and past one block, a partial last one
@pytest.mark.parametrize(("chunk", "kv_heads", "group", "head_dim", "page_size"), [
    (5, 2, 1, 16, 4), (16, 4, 2, 32, 8), (37, 2, 4, 16, 16), (64, 1, 8, 64, 4),
    (20, 2, 2, 12, 4),  # head_dim not a multiple of 8: plain loops, not the AVX2 sums
])
def test_cpu_prefill_equals_reference(chunk, kv_heads, group, head_dim, page_size):
    rng = np.random.default_rng(chunk)
    pages_per_seq = -(-(2 * chunk + 8) // page_size)
    rows = 4
    q, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 3)
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    # a first chunk, a later chunk, a short last chunk (padding queries), an empty row
    query_lens = [chunk, chunk, max(1, chunk // 3), 0]
    starts = [0, chunk + 3, 7, 0]
    positions, seq_lens = _chunks(rng, starts, query_lens, chunk)
    want = np.asarray(prefill_attention_ref(q, k, v, table, positions, seq_lens, 0.3))
    got = np.asarray(jax.jit(prefill_attention_cpu, static_argnums=6)(
        q, k, v, table, positions, seq_lens, 0.3))
    for b, n in enumerate(query_lens):
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=2e-6, rtol=1e-5)
        assert (got[b, n:] == 0).all()  # padding queries and the empty row: zeros


@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (2, 64), (3, 64), (2, 32), (3, 12)])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (11, 2.0)])
def test_decode_gives_the_bits_prefill_gives_the_same_query(group, head_dim, window, soft_cap):
    # a generated token's attention as decode computes it and as prefill recomputes it (after
    # a preemption) are one computation: decode pairs the query heads of a KV head, prefill
    # takes them one by one, and each query's sums are the same; with a window, prefill scores
    # a block of queries from its first query's window on, decode from the token's own
    rng = np.random.default_rng(group * 100 + head_dim)
    kv_heads, page_size, pages_per_seq, rows, chunk = 2, 8, 6, 3, 9
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    qs = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)),
                     jnp.float32)
    starts = [0, 20, 37]
    positions, seq_lens = _chunks(rng, starts, [chunk] * rows, chunk)
    options = dict(sliding_window=window, soft_cap=soft_cap)
    prefill = np.asarray(prefill_attention_cpu(qs, k, v, table, positions, seq_lens, 0.3,
                                               **options))
    for i in range(chunk):  # query i of each row, decoded at its position
        decode = np.asarray(decode_attention_cpu(qs[:, i], k, v, table,
                                                 jnp.asarray(positions)[:, i] + 1, 0.3,
                                                 **options))
        assert (decode == prefill[:, i]).all(), i


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 1, 16), (2, 3, 64), (1, 8, 12)])
def test_cpu_ragged_prefill_gives_the_padded_kernels_bits(kv_heads, group, head_dim):
    # rows packed with no padding between them (chunks below, at and past a 16-query block, a
    # later chunk, an empty row in the middle), then padding tokens, which give zeros
    rng = np.random.default_rng(head_dim + group)
    page_size, pages_per_seq, chunk = 4, 16, 37
    rows = 5
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    query_lens = [chunk, 16, 0, 5, 17]
    starts = [0, 20, 0, 3, 40]
    positions, seq_lens = _chunks(rng, starts, query_lens, chunk)
    padded = np.asarray(prefill_attention_cpu(q, k, v, table, positions, seq_lens, 0.3))
    qp, pp, qs, take = _packed(q, np.asarray(positions), query_lens, 96)
    got = np.asarray(jax.jit(prefill_attention_cpu_ragged, static_argnums=7)(
        qp, k, v, table, pp, qs, seq_lens, 0.3))
    for t, (b, c) in enumerate(take):
        assert (got[t] == padded[b, c]).all(), (t, b, c)
    assert (got[len(take):] == 0).all()


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 1, 16), (4, 2, 64), (1, 3, 12)])
def test_decode_rows_in_a_ragged_call_give_the_decode_kernels_bits(kv_heads, group, head_dim):
    # a mixed call: one-token rows at their sequences' ends (decode rows, run as the decode
    # kernel's slots) among prompt chunks; a one-token row short of its end is a query of the
    # prefill path and still sees only the keys before it
    rng = np.random.default_rng(kv_heads * 10 + head_dim)
    page_size, pages_per_seq, rows = 4, 16, 6
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    query_lens = [1, 20, 1, 1, 7, 1]
    seq_lens = np.array([33, 20, 1, 50, 30, 12], np.int32)
    ends = [True, True, True, True, True, False]  # the last row's query sits at position 5
    positions = [np.arange(n) + s - n if e else np.array([5])
                 for n, s, e in zip(query_lens, seq_lens, ends, strict=True)]
    tokens = 40
    q = jnp.asarray(rng.standard_normal((tokens, kv_heads * group, head_dim)), jnp.float32)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    flat = np.zeros(tokens, np.int32)
    flat[:starts[-1]] = np.concatenate(positions)
    got = np.asarray(prefill_attention_cpu_ragged(q, k, v, table, jnp.asarray(flat),
                                                  jnp.asarray(starts), jnp.asarray(seq_lens),
                                                  0.3))
    decode_rows = [b for b, n in enumerate(query_lens) if n == 1 and ends[b]]
    at = starts[decode_rows]
    decode = np.asarray(decode_attention_cpu(q[at], k, v, table[np.array(decode_rows)],
                                             jnp.asarray(seq_lens[decode_rows]), 0.3))
    assert (got[at] == decode).all()
    ref = np.asarray(prefill_attention_ref(
        q[starts[5]][None, None], k, v, table[5:6], jnp.array([[5]], jnp.int32),
        jnp.array([12], jnp.int32), 0.3))
    np.testing.assert_allclose(got[starts[5]], ref[0, 0], rtol=1e-5, atol=1e-5)
    assert (got[starts[-1]:] == 0).all()


# sliding_window and soft_cap: windows of one key, not a multiple of page_size (4), of two
# pages, longer than any sequence; the cap alone and with a window
OPTIONS = [(1, None), (5, None), (8, None), (500, None), (None, 2.0), (6, 2.5)]


@pytest.mark.parametrize(("window", "soft_cap"), OPTIONS)
def test_cpu_decode_with_a_window_or_a_cap_equals_reference(window, soft_cap):
    rng = np.random.default_rng(7)
    page_size, pages_per_seq, slots = 4, 16, 6
    q, k, v, table = _case(rng, slots, 2, 3, 32, page_size, pages_per_seq,
                           slots * pages_per_seq + 1)
    lens = np.array([1, 7, 0, 64, 30, 13])
    seq_lens = jnp.asarray(lens, jnp.int32)
    options = dict(sliding_window=window, soft_cap=soft_cap)
    want = np.asarray(decode_attention_ref(q, k, v, table, seq_lens, 0.3, **options))
    first_keys = np.maximum(lens - window, 0) if window else [0] * slots
    pools, freed_table = _free_before((k, v), table, first_keys, page_size)
    got = np.asarray(jax.jit(functools.partial(decode_attention_cpu, scale=0.3, **options))(
        q, *pools, freed_table, seq_lens))
    live = lens > 0
    np.testing.assert_allclose(got[live], want[live], atol=2e-6, rtol=1e-5)
    assert (got[~live] == 0).all()
    if window is not None and window >= lens.max():  # a window past the start: none at all
        assert (got == np.asarray(decode_attention_cpu(q, k, v, table, seq_lens, 0.3))).all()


@pytest.mark.parametrize(("window", "soft_cap"), OPTIONS)
def test_cpu_prefill_with_a_window_or_a_cap_equals_reference(window, soft_cap):
    # a first chunk, a later one (its items' windows starting at different pages), a short one
    # (padding), an empty row, a one-token row at its sequence's end; packed, the same bits,
    # and that row the decode kernel's. Pages of 2 keys: the freed pages end inside a 4-key
    # group of values, so a read of them would reach a seen value's sum (groups of zero
    # weights are skipped)
    rng = np.random.default_rng(8)
    kv_heads, group, head_dim, page_size, pages_per_seq, chunk = 2, 2, 16, 2, 32, 37
    rows = 5
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    query_lens, starts = [chunk, chunk, 12, 0, 1], [0, 23, 9, 0, 40]
    positions, seq_lens = _chunks(rng, starts, query_lens, chunk)
    options = dict(sliding_window=window, soft_cap=soft_cap)
    want = np.asarray(prefill_attention_ref(q, k, v, table, positions, seq_lens, 0.3,
                                            **options))
    first_keys = np.maximum(np.array(starts) - window + 1, 0) if window else [0] * rows
    pools, freed_table = _free_before((k, v), table, first_keys, page_size)
    got = np.asarray(prefill_attention_cpu(q, *pools, freed_table, positions, seq_lens, 0.3,
                                           **options))
    for b, n in enumerate(query_lens):
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=2e-6, rtol=1e-5)
        assert (got[b, n:] == 0).all()
    qp, pp, qs, take = _packed(q, np.asarray(positions), query_lens, 96)
    ragged = np.asarray(prefill_attention_cpu_ragged(qp, *pools, freed_table, pp, qs, seq_lens,
                                                     0.3, **options))
    for t, (b, c) in enumerate(take):
        assert (ragged[t] == got[b, c]).all(), (t, b, c)
    assert (ragged[len(take):] == 0).all()
    decode = np.asarray(decode_attention_cpu(q[4:, 0], *pools, freed_table[4:], seq_lens[4:],
                                             0.3, **options))
    assert (ragged[np.asarray(qs)[4]] == decode[0]).all()


def test_a_window_keeps_the_attention_batch_invariant():
    # a slot's (a row's) bits whatever shares its call: few slots split each slot's KV heads
    # among the threads, many give each thread whole slots; a row's prefill chunk alone and
    # among others, padded and packed
    rng = np.random.default_rng(9)
    kv_heads, group, head_dim, page_size, pages_per_seq, slots = 2, 3, 32, 4, 16, 9
    q, k, v, table = _case(rng, slots, kv_heads, group, head_dim, page_size, pages_per_seq,
                           slots * pages_per_seq + 1)
    options = dict(sliding_window=11, soft_cap=2.0)
    lens = jnp.asarray(rng.integers(1, page_size * pages_per_seq + 1, slots), jnp.int32)
    together = np.asarray(decode_attention_cpu(q, k, v, table, lens, 0.3, **options))
    for s in range(slots):
        alone = decode_attention_cpu(q[s:s + 1], k, v, table[s:s + 1], lens[s:s + 1], 0.3,
                                     **options)
        assert (np.asarray(alone)[0] == together[s]).all(), s
    chunk, rows = 20, 3
    qs = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    positions, seq_lens = _chunks(rng, [0, 30, 14], [chunk, chunk, 7], chunk)
    together = np.asarray(prefill_attention_cpu(qs, k, v, table[:rows], positions, seq_lens,
                                                0.3, **options))
    for b in range(rows):
        alone = prefill_attention_cpu(qs[b:b + 1], k, v, table[b:b + 1], positions[b:b + 1],
                                      seq_lens[b:b + 1], 0.3, **options)
        assert (np.asarray(alone)[0] == together[b]).all(), b
        qp, pp, starts, _ = _packed(qs[b:b + 1], np.asarray(positions[b:b + 1]),
                                    [int(seq_lens[b] - positions[b, 0])], chunk + 3)
        packed = prefill_attention_cpu_ragged(qp, k, v, table[b:b + 1], pp, starts,
                                              seq_lens[b:b + 1], 0.3, **options)
        n = int(starts[1])
        assert (np.asarray(packed)[:n] == together[b, :n]).all(), b


def test_cpu_ragged_prefill_rejects_bad_starts():
    rng = np.random.default_rng(4)
    q, k, v, table = _case(rng, 2, 2, 2, 16, 4, 4, 12)
    q = jnp.asarray(rng.standard_normal((10, 4, 16)), jnp.float32)
    positions, seq_lens = jnp.zeros((10,), jnp.int32), jnp.array([3, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"query_starts is int32\[2\], expected int32\[3\]"):
        prefill_attention_cpu_ragged(q, k, v, table, positions, jnp.array([0, 3], jnp.int32),
                                     seq_lens, 0.25)
    with pytest.raises(ValueError, match=r"expected \[tokens, num_heads, head_dim\]"):
        prefill_attention_cpu_ragged(q[None], k, v, table, positions,
                                     jnp.array([0, 3, 7], jnp.int32), seq_lens, 0.25)
    for starts, message in (([0, 5, 3], "decrease"), ([0, 3, 11], "outside q")):
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(prefill_attention_cpu_ragged(
                q, k, v, table, positions, jnp.array(starts, jnp.int32), seq_lens, 0.25))


def test_cpu_prefill_reads_neither_stale_pages_nor_past_the_table():
    # row 0's chunk ends inside its second page, whose tail and the table entries after it hold
    # NaN (a reused page); row 1's chunk runs past what its table holds: the 16 keys the table
    # holds count, as in the reference; row 2 names pages outside the pool, read as page 0
    rng = np.random.default_rng(5)
    q, k, v, _ = _case(rng, 3, 2, 2, 16, 4, 4, 16)
    q = jnp.asarray(rng.standard_normal((3, 8, 4, 16)), jnp.float32)
    k_nan = k.at[11].set(jnp.nan).at[1, 3:].set(jnp.nan)
    v_nan = v.at[11].set(jnp.nan).at[1, 3:].set(jnp.nan)
    table = jnp.array([[2, 1, 11, 11], [2, 3, 4, 5], [6, 99, -7, 0]], jnp.int32)
    positions, seq_lens = _chunks(rng, [0, 12, 4], [7, 8, 8], 8)
    got = np.asarray(prefill_attention_cpu(q, k_nan, v_nan, table, positions, seq_lens, 0.25))
    clean = table.at[2].set(jnp.array([6, 0, 0, 0]))
    want = np.asarray(prefill_attention_ref(q, k, v, clean, positions, seq_lens, 0.25))
    np.testing.assert_allclose(got[0, :7], want[0, :7], atol=2e-6)
    assert np.isfinite(got).all()
    held = np.asarray(jnp.minimum(positions[1], 15)) + 1  # keys row 1's queries see in the table
    want_1 = prefill_attention_ref(q[1:2], k, v, table[1:2], jnp.minimum(positions[1:2], 15),
                                   jnp.array([16], jnp.int32), 0.25)
    assert (held == 16).sum() >= 4
    np.testing.assert_allclose(got[1], np.asarray(want_1)[0], atol=2e-6)
    np.testing.assert_allclose(got[2], want[2], atol=2e-6)


def test_cpu_prefill_takes_16_bit_queries_and_rejects_bad_inputs():
    rng = np.random.default_rng(3)
    q, k, v, table = _case(rng, 2, 2, 2, 16, 4, 4, 12)
    q = jnp.asarray(rng.standard_normal((2, 6, 4, 16)), jnp.bfloat16)
    positions, seq_lens = _chunks(rng, [0, 3], [6, 4], 6)
    got = prefill_attention_cpu(q, k, v, table, positions, seq_lens, 0.25)
    want = prefill_attention_ref(q.astype(jnp.float32), k, v, table, positions, seq_lens, 0.25)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32)[:, :4], np.asarray(want)[:, :4],
                               atol=2e-2)
    with pytest.raises(ValueError, match=r"positions is int32\[2, 5\], expected int32\[2, 6\]"):
        prefill_attention_cpu(q, k, v, table, positions[:, :5], seq_lens, 0.25)
    with pytest.raises(ValueError, match=r"expected \[batch, chunk, num_heads, head_dim\]"):
        prefill_attention_cpu(q[0], k, v, table, positions, seq_lens, 0.25)


def test_the_build_is_cached_and_a_failed_one_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    built = cpu_library.build()
    assert built.parent == tmp_path / "kernels" and built.suffix == ".so"
    stamp = built.stat().st_mtime_ns
    assert cpu_library.build() == built and built.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails: a new cache key, no library
    with pytest.raises(KernelUnavailable, match="failed"):
        cpu_library.build()
    assert list((tmp_path / "kernels").iterdir()) == [built]  # no half-written file left


def test_auto_attention_takes_the_cpu_kernel_where_it_builds(monkeypatch, caplog):
    assert resolve_attention_impl("auto", "cpu", 64, 16) == "cpu"
    assert resolve_attention_impl("cpu", "cpu", 64, 16) == "cpu"
    assert kv_cache_dtype("bfloat16", "cpu", "cpu") == "float32"  # auto: a float32 pool
    assert kv_cache_dtype("float32", "cpu", "cpu", "bfloat16") == "bfloat16"  # asked for
    assert kv_cache_dtype("bfloat16", "gpu", "pallas", "bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' on the CPU is read by the "
                                         "cpu attention kernels, not attention_impl='reference'"):
        kv_cache_dtype("float32", "cpu", "reference", "bfloat16")
    with pytest.raises(ValueError, match="on 'gpu' the KV pool takes the model's dtype"):
        kv_cache_dtype("float32", "gpu", "pallas", "bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache_dtype("float32", "cpu", "cpu", "fp16")
    with pytest.raises(ValueError, match="attention_impl='cpu' runs on the CPU backend"):
        resolve_attention_impl("cpu", "gpu", 64, 16)
    monkeypatch.setattr(cpu_library, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_impl("auto", "cpu", 64, 16) == "reference"
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ValueError, match="cannot be built here: no C\\+\\+ compiler found"):
        resolve_attention_impl("cpu", "cpu", 64, 16)
