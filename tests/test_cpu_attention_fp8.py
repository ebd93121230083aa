"""The CPU attention kernels on a float8_e4m3fn pool held as its bytes (FP8_BITS): each key and
value widened exactly as it is loaded, under the denormals-are-zero mode XLA runs the kernels
in, so the attention over the pool is the float32 kernel's over its widened values, to the bit,
on every instruction set path."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cpu_attention_cases import _case, _chunks, _free_before, _packed

from cpu_kernels.attention import (
    FP8_BITS,
    FP8_MAX,
    decode_attention_cpu,
    fp8_bits,
    from_fp8_bits,
    prefill_attention_cpu,
    prefill_attention_cpu_ragged,
)
from pallas_kernels import decode_attention_ref

FINITE = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)  # e4m3fn's finite bytes


def test_fp8_bits_round_to_nearest_even_clamp_and_widen_exactly():
    x = np.array([448, -448, 449, 464, 500, -1e6, np.inf, -np.inf,  # the largest, then clamped
                  1.0, 1 + 2**-4, 1 + 3 * 2**-4,  # ties to even: 1 and 1.25
                  2**-6, 2**-9, -3 * 2**-9, 7 * 2**-9,  # the smallest normal, then subnormals
                  2**-10, 3 * 2**-10, 2**-11,  # ties to even (0 and 2 x 2^-9), below half: 0
                  0.0, -0.0], np.float32)
    bits = fp8_bits(jnp.asarray(x))
    assert bits.dtype == FP8_BITS
    want = np.array([448, -448, 448, 448, 448, -448, 448, -448, 1.0, 1.0, 1.25, 2**-6, 2**-9,
                     -3 * 2**-9, 7 * 2**-9, 0.0, 2 * 2**-9, 0.0, 0.0, -0.0], np.float32)
    got = np.asarray(from_fp8_bits(bits))
    assert (got.view(np.uint32) == want.view(np.uint32)).all()  # -0.0 kept
    assert np.asarray(bits)[[0, 1, -2, -1]].tolist() == [0x7E, 0xFE, 0x00, 0x80]


def test_fp8_bits_is_the_e4m3fn_cast_of_the_clamped_value_and_never_nan():
    rng = np.random.default_rng(0)
    # normals of every magnitude e4m3fn holds and some past it: subnormals, clamped values
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-4, 3.5, 200_000)).astype(np.float32)
    x = np.concatenate([x, [np.inf, -np.inf, np.finfo(np.float32).max, 1e-45]]).astype(np.float32)
    bits = np.asarray(jax.jit(fp8_bits)(jnp.asarray(x)))
    want = np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert (bits == want).all()
    assert not np.isin(bits, [0x7F, 0xFF]).any()  # no NaN
    widened = np.asarray(from_fp8_bits(jnp.asarray(np.arange(256, dtype=np.uint8))))
    exact = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(widened, exact)  # NaN at 0x7f and 0xff in both


@pytest.mark.parametrize("head_dim", [128, 127])  # the vector loads; the scalar loop
@pytest.mark.parametrize("path", ["", "_avx2", "_plain"])
def test_the_kernels_widen_every_e4m3fn_byte_exactly(head_dim, path, other_paths):
    # one key per slot, a zero one: its softmax weight is exactly 1, so the output is the value
    # row as the kernel widened it (a zero as +0). 254 finite bytes over two KV heads,
    # subnormals among them, which a widening through a float32 subnormal would read as 0 under
    # denormals-are-zero
    row = np.zeros(2 * head_dim, np.uint8)
    row[:FINITE.size] = np.random.default_rng(1).permutation(FINITE)
    v = jnp.zeros((3, 4, 2, head_dim), FP8_BITS).at[1, 0].set(row.reshape(2, head_dim))
    v = v.at[2, 0].set(jnp.array([[0x7F], [0xFF]], FP8_BITS))  # NaN bytes, documented as +-480
    q = jnp.ones((2, 2, head_dim), jnp.float32)
    table = jnp.array([[1], [2]], jnp.int32)
    out = np.asarray(decode_attention_cpu(q, jnp.zeros_like(v), v, table,
                                          jnp.array([1, 1], jnp.int32), 0.1, path))
    want = np.asarray(from_fp8_bits(jnp.asarray(row))).reshape(2, head_dim)
    assert (out[0] == want).all()
    assert (out[1, :, 0] == [480, -480]).all()


def _fp8_pools(k, v):
    """An fp8 pool's bytes and the float32 pool holding its values."""
    kb, vb = fp8_bits(k), fp8_bits(v)
    return (kb, vb), (from_fp8_bits(kb), from_fp8_bits(vb))


def _wide_range(rng, x):
    """x's elements scaled by 10^-3 .. 10^2: subnormal, normal and clamped e4m3fn values."""
    return x * jnp.asarray(10.0 ** rng.uniform(-3, 2, x.shape), jnp.float32)


# GQA groups (an odd one: query heads in pairs and one alone), head_dim 64 and 128 (AVX-512's
# sixteen lanes), 32 (eight), 12 (the plain loops' tails)
SHAPES = [(2, 1, 64), (2, 3, 64), (1, 4, 128), (2, 2, 128), (4, 2, 32), (2, 2, 12)]


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), SHAPES)
@pytest.mark.parametrize("path", ["", "_avx2", "_plain"])
def test_an_fp8_pool_gives_the_bits_of_a_float32_pool_of_its_values(kv_heads, group, head_dim,
                                                                   path, other_paths):
    # decode (a key, partial pages, whole tables of several pages, an empty slot) and padded
    # prefill chunks (first, later and short ones, an empty row)
    rng = np.random.default_rng(kv_heads * 100 + group * 10 + head_dim)
    page_size, pages_per_seq, rows, chunk = 4, 12, 5, 19
    q, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 2)
    fp8, f32 = _fp8_pools(_wide_range(rng, k), _wide_range(rng, v))
    lens = jnp.asarray([1, 7, 0, 48, 30], jnp.int32)
    decode = [np.asarray(decode_attention_cpu(q, *pools, table, lens, 0.3, path))
              for pools in (fp8, f32)]
    assert (decode[0] == decode[1]).all()
    qs = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    positions, seq_lens = _chunks(rng, [0, 5, 20, 0, 3], [chunk, chunk, 6, 0, chunk], chunk)
    prefill = [np.asarray(prefill_attention_cpu(qs, *pools, table, positions, seq_lens, 0.3,
                                                path)) for pools in (fp8, f32)]
    assert (prefill[0] == prefill[1]).all()


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 3, 64), (2, 2, 128), (1, 4, 12)])
def test_an_fp8_pools_ragged_calls_give_the_float32_pools_and_its_padded_and_decode_bits(
        kv_heads, group, head_dim):
    rng = np.random.default_rng(kv_heads * 10 + group + head_dim)
    page_size, pages_per_seq, rows, chunk = 4, 16, 5, 37
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    (kb, vb), f32 = _fp8_pools(_wide_range(rng, k), _wide_range(rng, v))
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    # chunks below, at and past a 16-query block, one-token rows at their sequences' ends
    # (decode rows), an empty row
    query_lens = [chunk, 1, 17, 0, 1]
    starts = [0, 40, 9, 0, 12]
    positions, seq_lens = _chunks(rng, starts, query_lens, chunk)
    padded = np.asarray(prefill_attention_cpu(q, kb, vb, table, positions, seq_lens, 0.3))
    qp, pp, qs, take = _packed(q, np.asarray(positions), query_lens, 64)
    ragged = jax.jit(prefill_attention_cpu_ragged, static_argnums=7)
    got = np.asarray(ragged(qp, kb, vb, table, pp, qs, seq_lens, 0.3))
    assert (got == np.asarray(ragged(qp, *f32, table, pp, qs, seq_lens, 0.3))).all()
    for t, (b, c) in enumerate(take):
        assert (got[t] == padded[b, c]).all(), (t, b, c)
    decode = np.asarray(decode_attention_cpu(q[:, 0], kb, vb, table, seq_lens, 0.3))
    for b in (1, 4):
        assert (got[np.asarray(qs)[b]] == decode[b]).all()
    assert (got[len(take):] == 0).all()


@pytest.mark.parametrize(("group", "head_dim"), [(2, 64), (3, 128), (2, 12)])
def test_an_fp8_pools_attention_is_batch_invariant(group, head_dim):
    # a slot's decode bits whatever shares its call (few slots: each slot's KV heads split
    # among the threads; many: whole slots), and a token's decode bits are its prefill bits
    rng = np.random.default_rng(group + head_dim)
    kv_heads, page_size, pages_per_seq, slots = 2, 8, 6, 9
    q, k, v, table = _case(rng, slots, kv_heads, group, head_dim, page_size, pages_per_seq,
                           slots * pages_per_seq + 1)
    (kb, vb), _ = _fp8_pools(k, v)
    lens = jnp.asarray(rng.integers(1, page_size * pages_per_seq + 1, slots), jnp.int32)
    together = np.asarray(decode_attention_cpu(q, kb, vb, table, lens, 0.3))
    for s in range(slots):
        alone = decode_attention_cpu(q[s:s + 1], kb, vb, table[s:s + 1], lens[s:s + 1], 0.3)
        assert (np.asarray(alone)[0] == together[s]).all(), s
    chunk = 9
    qs = jnp.asarray(rng.standard_normal((3, chunk, kv_heads * group, head_dim)), jnp.float32)
    positions, seq_lens = _chunks(rng, [0, 20, 37], [chunk] * 3, chunk)
    prefill = np.asarray(prefill_attention_cpu(qs, kb, vb, table[:3], positions, seq_lens, 0.3))
    for i in range(chunk):
        decode = np.asarray(decode_attention_cpu(qs[:, i], kb, vb, table[:3],
                                                 jnp.asarray(positions)[:, i] + 1, 0.3))
        assert (decode == prefill[:, i]).all(), i


def test_an_fp8_pool_is_the_float32_attention_within_e4m3s_rounding():
    rng = np.random.default_rng(3)
    q, k, v, table = _case(rng, 4, 2, 2, 64, 8, 5, 24)
    lens = jnp.array([40, 33, 17, 1], jnp.int32)
    (kb, vb), _ = _fp8_pools(k, v)
    got = np.asarray(decode_attention_cpu(q, kb, vb, table, lens, 0.125))
    want = np.asarray(decode_attention_ref(q, k, v, table, lens, 0.125))
    # e4m3fn rounds a value to within 2^-4 of it (a one-key slot gives its value, rounded), and
    # the keys' rounding moves the weights: a few hundredths on outputs of about 0.5
    np.testing.assert_allclose(got, want, rtol=2**-4, atol=0.06)


def test_an_fp8_pool_reads_no_stale_pages():
    # NaN bytes in the pages and tails a row never reads change nothing
    rng = np.random.default_rng(7)
    q, k, v, _ = _case(rng, 2, 2, 2, 16, 4, 4, 16)
    (kb, vb), _ = _fp8_pools(k, v)
    table = jnp.array([[1, 11, 11, 11], [2, 3, 4, 5]], jnp.int32)
    lens = jnp.array([3, 14], jnp.int32)
    stale = [x.at[11].set(0x7F).at[1, 3:].set(0xFF).at[5, 2:].set(0x7F) for x in (kb, vb)]
    got = np.asarray(decode_attention_cpu(q, *stale, table, lens, 0.25))
    assert (got == np.asarray(decode_attention_cpu(q, kb, vb, table, lens, 0.25))).all()


@pytest.mark.parametrize("path", ["", "_avx2", "_plain"])
def test_a_window_and_a_cap_on_an_fp8_pool_give_the_bits_of_its_values(path, other_paths):
    # decode, padded and packed prefill with a window and a cap: the float32 pool's bits, on
    # every instruction set path, and the pages wholly before each row's window never read
    # (NaN bytes there, and in the null page their freed table entries point at, change nothing)
    rng = np.random.default_rng(12)
    kv_heads, group, head_dim, page_size, pages_per_seq, rows, chunk = 2, 3, 64, 4, 16, 4, 21
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    fp8, f32 = _fp8_pools(_wide_range(rng, k), _wide_range(rng, v))
    options = dict(sliding_window=6, soft_cap=5.0)
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    query_lens, starts = [chunk, 1, 13, chunk], [0, 40, 9, 30]
    positions, seq_lens = _chunks(rng, starts, query_lens, chunk)
    stale, freed_table = _free_before(fp8, table, np.maximum(np.array(starts) - 5, 0),
                                      page_size, stale=0x7F)
    decode = [np.asarray(decode_attention_cpu(q[:, 0], *pools, t, seq_lens, 0.3, path,
                                              **options))
              for pools, t in ((stale, freed_table), (fp8, table), (f32, table))]
    assert (decode[0] == decode[2]).all() and (decode[1] == decode[2]).all()
    prefill = [np.asarray(prefill_attention_cpu(q, *pools, t, positions, seq_lens, 0.3, path,
                                                **options))
               for pools, t in ((stale, freed_table), (fp8, table), (f32, table))]
    assert (prefill[0] == prefill[2]).all() and (prefill[1] == prefill[2]).all()
    # (the ragged kernel on this machine's path only: against that path's padded one)
    padded = np.asarray(prefill_attention_cpu(q, *fp8, table, positions, seq_lens, 0.3,
                                              **options))
    qp, pp, qs, take = _packed(q, np.asarray(positions), query_lens, 64)
    ragged = np.asarray(prefill_attention_cpu_ragged(qp, *stale, freed_table, pp, qs, seq_lens,
                                                     0.3, **options))
    for t, (b, c) in enumerate(take):
        assert (ragged[t] == padded[b, c]).all(), (t, b, c)


def test_the_kernels_reject_fp8_pools_mixed_with_other_dtypes():
    rng = np.random.default_rng(5)
    q, k, v, table = _case(rng, 2, 1, 2, 16, 4, 2, 6)
    lens = jnp.array([3, 5], jnp.int32)
    with pytest.raises(ValueError, match=r"float8_e4m3fn pages as uint8 bits, .* got "
                                         r"uint8/float32"):
        decode_attention_cpu(q, fp8_bits(k), v, table, lens, 0.3)
    with pytest.raises(ValueError, match="got float8_e4m3fn/float8_e4m3fn"):
        decode_attention_cpu(q, k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn),
                             table, lens, 0.3)
