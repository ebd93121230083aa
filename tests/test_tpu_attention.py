"""The TPU backend's attention (JAX's Pallas TPU kernel, run in interpret mode on the CPU) equals
the pure-jnp reference over the same K/V values.

With a sliding window the pages wholly before a row's first window are NaN in the kernel's pool
(and finite in the reference's): the wrapper drops them from the row's table, and a read would
show (a masked key's weight, 0, times NaN is NaN)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

from pallas_kernels import prefill_attention_ref
from pallas_kernels.tpu_attention import (
    kv_pages_zeros,
    padded_attention,
    ragged_attention,
    shape_problem,
    write_kv,
)

HEAD_DIM = 128  # the kernel's lane width: the smallest head_dim it takes
SCALE = HEAD_DIM**-0.5


def _pools(rng, num_pages, page_size, kv_heads, dtype=jnp.float32):
    """Separate K and V pools for the reference, and the same values in the kernel's layout."""
    shape = (num_pages, page_size, kv_heads, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    kv = jnp.stack([k, v], axis=3).reshape(num_pages, page_size, 2 * kv_heads, HEAD_DIM)
    return k, v, kv


def _table(rng, rows, pages_per_seq, num_pages):
    """Distinct pages in shuffled order, never the null page."""
    pages = rng.permutation(np.arange(1, num_pages))[:rows * pages_per_seq]
    return jnp.asarray(pages.reshape(rows, pages_per_seq), jnp.int32)


def _poison_before_window(kv, table, first_positions, window, page_size):
    """The kernel's pool with NaN in the pages each row's walk must skip: those wholly before
    the window of its earliest query (first_positions [B])."""
    table = np.asarray(table)
    pages = np.concatenate([table[b, :max(p - window + 1, 0) // page_size]
                            for b, p in enumerate(np.asarray(first_positions))])
    assert pages.size, "a case whose windows skip no page checks no skip"
    return kv.at[pages].set(jnp.nan)


def _padded_case(rng, query_lens, seq_lens, kv_heads=2, group=4, page_size=16,
                 pages_per_seq=4, dtype=jnp.float32, sliding_window=None, soft_cap=None):
    rows, chunk = len(query_lens), max(max(query_lens), 1)
    k, v, kv = _pools(rng, 40, page_size, kv_heads, dtype)
    table = _table(rng, rows, pages_per_seq, 40)
    query_lens = jnp.array(query_lens, jnp.int32)
    seq_lens = jnp.array(seq_lens, jnp.int32)
    positions = (seq_lens - query_lens)[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, HEAD_DIM)), dtype)
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    want = prefill_attention_ref(q, k, v, table, positions, seq_lens, SCALE, **options)
    if sliding_window is not None and sliding_window < int(positions[:, 0].max()):
        kv = _poison_before_window(kv, table, positions[:, 0], sliding_window, page_size)
    got = padded_attention(q, kv, table, positions, query_lens, seq_lens, scale=SCALE,
                           interpret=True, block_sizes=(2, 8), **options)
    real = np.arange(chunk)[None, :] < np.asarray(query_lens)[:, None]  # [B, C]
    return np.asarray(got, np.float32), np.asarray(want, np.float32), real


def test_decode_rows_with_gqa_and_an_empty_row():
    # lengths off page boundaries, one a page exactly, one empty row, 4 query heads per kv head
    got, want, real = _padded_case(np.random.default_rng(0), [1, 1, 1, 0, 1],
                                   [1, 16, 37, 0, 64])
    np.testing.assert_allclose(got[real], want[real], atol=2e-5)
    assert (got[~real] == 0).all()


def test_prefill_chunks_starting_mid_sequence():
    # chunks of 8 queries at positions 0, 13 and 40; a short chunk padded; an empty row
    got, want, real = _padded_case(np.random.default_rng(1), [8, 8, 3, 0, 8],
                                   [8, 21, 43, 0, 48])
    np.testing.assert_allclose(got[real], want[real], atol=2e-5)
    assert (got[~real] == 0).all()


def test_bfloat16_prefill_chunks():
    got, want, real = _padded_case(np.random.default_rng(2), [4, 1, 4], [4, 30, 50],
                                   dtype=jnp.bfloat16)
    np.testing.assert_allclose(got[real], want[real], atol=3e-2)
    assert (got[~real] == 0).all()


# (sliding_window, soft_cap): windows of 1 key, not a multiple of the page size 16, longer than
# every sequence; the cap alone and with a window (a cap of 1 bends scores of about 1)
@pytest.mark.parametrize(("sliding_window", "soft_cap"),
                         [(1, None), (20, None), (1000, None), (None, 1.0), (20, 1.0)])
def test_decode_rows_with_window_and_cap(sliding_window, soft_cap):
    got, want, real = _padded_case(np.random.default_rng(7), [1, 1, 1, 0, 1],
                                   [1, 16, 37, 0, 64], sliding_window=sliding_window,
                                   soft_cap=soft_cap)
    np.testing.assert_allclose(got[real], want[real], atol=2e-5)
    assert (got[~real] == 0).all()


@pytest.mark.parametrize(("sliding_window", "soft_cap", "dtype"),
                         [(5, None, jnp.float32), (20, 1.0, jnp.float32),
                          (13, 2.0, jnp.bfloat16)])
def test_prefill_chunks_with_window_and_cap(sliding_window, soft_cap, dtype):
    # chunks from 0, 13, 40 and 57: windows that start on each row's own page
    got, want, real = _padded_case(np.random.default_rng(8), [8, 8, 3, 0, 7],
                                   [8, 21, 43, 0, 64], dtype=dtype,
                                   sliding_window=sliding_window, soft_cap=soft_cap)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got[real], want[real], atol=tol)
    assert (got[~real] == 0).all()


def test_options_are_the_kernels_own():
    """JAX's own reference for its kernel (`ref_ragged_paged_attention`, over K/V in the same
    combined layout) takes sliding_window and soft_cap as jaxserve's reference does."""
    rng = np.random.default_rng(9)
    k, v, kv = _pools(rng, 12, 4, 2)
    table = _table(rng, 1, 5, 12)
    q = jnp.asarray(rng.standard_normal((1, 6, 4, HEAD_DIM)), jnp.float32)
    positions = jnp.arange(13, 19, dtype=jnp.int32)[None]
    options = {"sliding_window": 7, "soft_cap": 1.0}
    want = prefill_attention_ref(q, k, v, table, positions, jnp.array([19], jnp.int32), SCALE,
                                 **options)
    theirs = rpa.ref_ragged_paged_attention(
        q[0], kv, jnp.array([19], jnp.int32), table, jnp.array([0, 6], jnp.int32),
        jnp.array([1], jnp.int32), sm_scale=SCALE, **options)
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(want[0]), atol=2e-5)


def test_two_head_blocks_of_the_kernel():
    # 8 kv heads in float32 is two of the kernel's head blocks: one call per block
    got, want, real = _padded_case(np.random.default_rng(3), [5, 1], [20, 33], kv_heads=8,
                                   group=1, page_size=8, pages_per_seq=5)
    np.testing.assert_allclose(got[real], want[real], atol=2e-5)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 10, "soft_cap": 1.0}])
def test_mixed_ragged_batch_equals_reference(options):
    # decode rows and prefill chunks packed in one call, an empty row among them (it must not
    # disturb the row after it), padding at the end, a row past num_seqs ignored; with a
    # window, rows whose first pages are dropped next to rows that keep all theirs
    rng = np.random.default_rng(4)
    kv_heads, group, page_size, pages_per_seq = 2, 2, 16, 4
    k, v, kv = _pools(rng, 40, page_size, kv_heads)
    query_lens = np.array([1, 7, 0, 1, 12, 3])
    seq_lens = np.array([29, 7, 18, 64, 50, 9])
    rows, total = len(query_lens), 40
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    table = _table(rng, rows, pages_per_seq, 40)
    q = jnp.asarray(rng.standard_normal((total, kv_heads * group, HEAD_DIM)), jnp.float32)
    got = np.asarray(ragged_attention(q, kv, table, jnp.asarray(starts), jnp.asarray(seq_lens,
                                      jnp.int32), rows - 1, scale=SCALE, interpret=True,
                                      block_sizes=(1, 8), **options))
    # the reference in the padded layout: row b's queries at [b, :query_lens[b]]
    chunk = query_lens.max()
    c = np.arange(chunk)
    token = np.minimum(starts[:-1, None] + c, total - 1)  # [B, C]
    positions = jnp.asarray(seq_lens[:, None] - query_lens[:, None] + c, jnp.int32)
    want = np.asarray(prefill_attention_ref(q[token], k, v, table, positions,
                                            jnp.asarray(seq_lens, jnp.int32), SCALE, **options))
    for b in range(rows - 1):
        np.testing.assert_allclose(got[starts[b]:starts[b + 1]], want[b, :query_lens[b]],
                                   atol=2e-5, err_msg=f"row {b}")
    assert (got[starts[rows - 1]:] == 0).all()  # the ignored row's queries and the padding


def test_write_kv_puts_k_and_v_where_the_kernel_reads_them():
    rng = np.random.default_rng(5)
    kv_heads, group, page_size = 2, 2, 8
    pool = kv_pages_zeros(12, page_size, kv_heads, HEAD_DIM, jnp.float32)
    assert pool.shape == (12, page_size, 2 * kv_heads, HEAD_DIM)
    table = jnp.array([[5, 2, 9]], jnp.int32)
    seq_len = 19
    k = jnp.asarray(rng.standard_normal((seq_len, kv_heads, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((seq_len, kv_heads, HEAD_DIM)), jnp.float32)
    tokens = jnp.arange(seq_len)
    write = jax.jit(write_kv, donate_argnums=0)
    pool = write(pool, k, v, table[0, tokens // page_size], tokens % page_size)
    np.testing.assert_array_equal(pool[2, 3, 0::2], k[11])  # token 11: page 2, offset 3
    np.testing.assert_array_equal(pool[2, 3, 1::2], v[11])
    # the kernel over the written pool equals the reference over the same K and V
    q = jnp.asarray(rng.standard_normal((1, 4, kv_heads * group, HEAD_DIM)), jnp.float32)
    positions = jnp.arange(seq_len - 4, seq_len, dtype=jnp.int32)[None]
    lens = jnp.array([seq_len], jnp.int32)
    got = padded_attention(q, pool, table, positions, jnp.array([4], jnp.int32), lens,
                           scale=SCALE, interpret=True)
    k_pages = jnp.zeros((12, page_size, kv_heads, HEAD_DIM)).at[
        table[0, tokens // page_size], tokens % page_size].set(k)
    v_pages = jnp.zeros((12, page_size, kv_heads, HEAD_DIM)).at[
        table[0, tokens // page_size], tokens % page_size].set(v)
    want = prefill_attention_ref(q, k_pages, v_pages, table, positions, lens, SCALE)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_write_kv_writes_the_pool_in_place():
    pool = kv_pages_zeros(64, 16, 2, HEAD_DIM, jnp.float32)
    new = jnp.ones((3, 2, HEAD_DIM))
    page, offset = jnp.array([1, 1, 7], jnp.int32), jnp.array([0, 1, 15], jnp.int32)
    write = jax.jit(write_kv, donate_argnums=0)
    hlo = write.lower(pool, new, new, page, offset).compile().as_text()
    pool_copies = [line for line in hlo.splitlines()
                   if " copy(" in line and "= f32[64,16,4,128]" in line]
    assert not pool_copies  # the scatter writes the donated pool; nothing copies it
    before = pool.unsafe_buffer_pointer()
    pool = write(pool, new, new, page, offset)
    assert pool.unsafe_buffer_pointer() == before


def test_interpret_mode_runs_the_pallas_kernel():
    # the jaxpr holds the kernel's pallas_call (not a jnp fallback); without interpret the
    # CPU refuses it, which shows the same call goes to Pallas
    rng = np.random.default_rng(6)
    _, _, kv = _pools(rng, 8, 16, 2)
    q = jnp.asarray(rng.standard_normal((4, 4, HEAD_DIM)), jnp.float32)
    args = (q, kv, jnp.array([[1, 2]], jnp.int32), jnp.array([0, 4], jnp.int32),
            jnp.array([20], jnp.int32), 1)
    jaxpr = str(jax.make_jaxpr(lambda *a: ragged_attention(*a, scale=SCALE, interpret=True))(
        *args))
    assert "pallas_call" in jaxpr and "ragged_paged_attention_kernel" in jaxpr
    ragged_attention(*args, scale=SCALE, interpret=True).block_until_ready()
    if jax.default_backend() == "cpu":
        with pytest.raises(Exception, match="interpret"):
            ragged_attention(*args, scale=SCALE, interpret=False, block_sizes=(2, 4))


@pytest.mark.parametrize(("shape", "words"), [
    ((8, 8, 64, 16, jnp.float32), "head_dim 64 is not a multiple of 128"),
    ((12, 6, 128, 16, jnp.float32), "num_kv_heads 6 does not tile"),
    ((24, 12, 128, 16, jnp.bfloat16), "num_kv_heads 12 does not tile"),
    ((12, 8, 128, 16, jnp.float32), "not a multiple of num_kv_heads 8"),
    ((8, 2, 128, 16, jnp.float16), "float16 is not float32 or bfloat16"),
])
def test_shape_problem_names_what_the_kernel_cannot_take(shape, words):
    problem = shape_problem(*shape)
    assert problem is not None and words in problem
    num_heads, kv_heads, head_dim, page_size, dtype = shape
    q = jnp.zeros((4, num_heads, head_dim), dtype)
    pool = jnp.zeros((4, page_size, 2 * kv_heads, head_dim), dtype)
    with pytest.raises(ValueError, match=words):
        ragged_attention(q, pool, jnp.ones((1, 2), jnp.int32), jnp.array([0, 4], jnp.int32),
                         jnp.array([4], jnp.int32), 1, scale=1.0, interpret=True)


@pytest.mark.parametrize("shape", [(32, 8, 128, 16, jnp.float32), (24, 12, 128, 16, jnp.float32),
                                   (8, 8, 256, 12, jnp.bfloat16), (4, 1, 128, 16, jnp.float32)])
def test_shape_problem_accepts_what_the_kernel_takes(shape):
    assert shape_problem(*shape) is None
