"""The CPU attention kernels on a bfloat16 pool held as its bits (BF16_BITS): each key and value
widened exactly as it is loaded, so the attention over the pool is the float32 kernels' over its
values, to the bit, on every instruction set path, windows and caps included; pools of other or
mixed dtypes are refused."""

import jax.numpy as jnp
import numpy as np
import pytest
from cpu_attention_cases import _case, _chunks, _packed

from cpu_kernels.attention import (
    BF16_BITS,
    bf16_bits,
    decode_attention_cpu,
    from_bf16_bits,
    prefill_attention_cpu,
    prefill_attention_cpu_ragged,
)
from pallas_kernels import decode_attention_ref, prefill_attention_ref


def test_bf16_bits_round_to_nearest_even_and_widen_exactly():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 1e-40, 3.0e38, 0.0], np.float32)
    bits = bf16_bits(jnp.asarray(x))
    assert bits.dtype == BF16_BITS
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even (1); 1 + 3 x 2^-8 rounds up to 1 + 2^-6
    want = np.array([1.0, 1.0, 1 + 2**-6, -2.5], np.float32)
    assert (np.asarray(from_bf16_bits(bits))[:4] == want).all()
    assert (np.asarray(bits)[:4] == want.view(np.uint32) >> 16).all()
    # within half a bfloat16 step (the subnormal may flush to zero)
    np.testing.assert_allclose(np.asarray(from_bf16_bits(bits)), x, rtol=2**-8, atol=1e-38)


def _bf16_pools(k, v):
    """A bfloat16 pool's bits and the float32 pool holding its values."""
    kb, vb = bf16_bits(k), bf16_bits(v)
    return (kb, vb), (from_bf16_bits(kb), from_bf16_bits(vb))


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [
    (2, 1, 64), (2, 3, 64), (1, 4, 32), (2, 2, 12),  # 12: the plain loops' tails
])
@pytest.mark.parametrize("path", ["", "_avx2", "_plain"])
def test_a_bf16_pool_gives_the_bits_of_a_float32_pool_of_its_values(kv_heads, group, head_dim,
                                                                    path, other_paths):
    # the kernels widen each bfloat16 key and value as they load it, on every instruction set
    # path: the attention over a bfloat16 pool is the attention over its values, to the bit
    rng = np.random.default_rng(kv_heads * 100 + group * 10 + head_dim)
    page_size, pages_per_seq, rows, chunk = 4, 12, 5, 19
    q, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 2)
    bf16, f32 = _bf16_pools(k, v)
    lens = jnp.asarray([1, 7, 0, 48, 30], jnp.int32)
    decode = [np.asarray(decode_attention_cpu(q, *pools, table, lens, 0.3, path))
              for pools in (bf16, f32)]
    assert (decode[0] == decode[1]).all()
    qs = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    positions, seq_lens = _chunks(rng, [0, 5, 20, 0, 3], [chunk, chunk, 6, 0, chunk], chunk)
    prefill = [np.asarray(prefill_attention_cpu(qs, *pools, table, positions, seq_lens, 0.3,
                                                path)) for pools in (bf16, f32)]
    assert (prefill[0] == prefill[1]).all()
    # and the rounding is all that separates it from the float32 pool's attention
    want = np.asarray(decode_attention_ref(q, k, v, table, lens, 0.3))
    np.testing.assert_allclose(decode[0], want, atol=0.05)


def test_a_bf16_pools_ragged_calls_give_its_padded_and_decode_calls_bits():
    rng = np.random.default_rng(11)
    kv_heads, group, head_dim, page_size, pages_per_seq, rows = 2, 2, 64, 4, 16, 4
    _, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 1)
    (kb, vb), _ = _bf16_pools(k, v)
    chunk = 21
    q = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    query_lens = [chunk, 1, 17, 1]
    starts = [0, 40, 9, 12]
    positions, seq_lens = _chunks(rng, starts, query_lens, chunk)
    padded = np.asarray(prefill_attention_cpu(q, kb, vb, table, positions, seq_lens, 0.3))
    qp, pp, qs, take = _packed(q, np.asarray(positions), query_lens, 48)
    got = np.asarray(prefill_attention_cpu_ragged(qp, kb, vb, table, pp, qs, seq_lens, 0.3))
    for t, (b, c) in enumerate(take):
        assert (got[t] == padded[b, c]).all(), (t, b, c)
    decode = np.asarray(decode_attention_cpu(q[:, 0], kb, vb, table, seq_lens, 0.3))
    for b in (1, 3):  # the one-token rows at their sequences' ends: the decode kernel's slots
        assert (got[np.asarray(qs)[b]] == decode[b]).all()
    assert (got[len(take):] == 0).all()


@pytest.mark.parametrize("path", ["", "_avx2", "_plain"])
def test_a_window_and_a_cap_on_a_bf16_pool_give_the_bits_of_its_values(path, other_paths):
    # on every instruction set path (the plain one's scalar softmax too): the attention over a
    # bfloat16 pool is the attention over its values, and the reference's over them
    rng = np.random.default_rng(10)
    kv_heads, group, head_dim, page_size, pages_per_seq, rows, chunk = 2, 3, 24, 4, 12, 5, 19
    q, k, v, table = _case(rng, rows, kv_heads, group, head_dim, page_size, pages_per_seq,
                           rows * pages_per_seq + 2)
    bf16, f32 = _bf16_pools(k, v)
    options = dict(sliding_window=7, soft_cap=3.0)
    lens = jnp.asarray([1, 7, 0, 48, 30], jnp.int32)
    decode = [np.asarray(decode_attention_cpu(q, *pools, table, lens, 0.3, path, **options))
              for pools in (bf16, f32)]
    assert (decode[0] == decode[1]).all()
    want = np.asarray(decode_attention_ref(q, *f32, table, lens, 0.3, **options))
    np.testing.assert_allclose(decode[0][[0, 1, 3, 4]], want[[0, 1, 3, 4]], atol=2e-6,
                               rtol=1e-5)
    qs = jnp.asarray(rng.standard_normal((rows, chunk, kv_heads * group, head_dim)), jnp.float32)
    query_lens = [chunk, chunk, 6, 0, chunk]
    positions, seq_lens = _chunks(rng, [0, 5, 20, 0, 3], query_lens, chunk)
    prefill = [np.asarray(prefill_attention_cpu(qs, *pools, table, positions, seq_lens, 0.3,
                                                path, **options)) for pools in (bf16, f32)]
    assert (prefill[0] == prefill[1]).all()
    want = np.asarray(prefill_attention_ref(qs, *f32, table, positions, seq_lens, 0.3,
                                            **options))
    for b, n in enumerate(query_lens):
        np.testing.assert_allclose(prefill[0][b, :n], want[b, :n], atol=2e-6, rtol=1e-5)


def test_the_kernels_reject_pools_of_other_or_mixed_dtypes():
    rng = np.random.default_rng(5)
    q, k, v, table = _case(rng, 2, 1, 2, 16, 4, 2, 6)
    lens = jnp.array([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="float32 pages or bfloat16 ones as uint16 bits, got "
                                         "uint16/float32"):
        decode_attention_cpu(q, bf16_bits(k), v, table, lens, 0.3)
    with pytest.raises(ValueError, match="got float16/float16"):
        decode_attention_cpu(q, k.astype(jnp.float16), v.astype(jnp.float16), table, lens, 0.3)
