"""Pallas paged-attention kernels against their jnp reference twins.

On a CPU the kernels run in interpret mode; on a GPU the same tests run the compiled Triton
kernels. Every case draws fresh random inputs from its own seed, with page tables that scatter
each sequence over random non-contiguous pages.

Unwritten outputs: the Pallas interpreter fills every output with NaN before the kernel runs
(`test_interpreter_poisons_unwritten_outputs` holds it to that), so the finiteness checks below
catch any output element, or any split's partial result, that a kernel forgets to write.
Table entries past a sequence's pages point at NaN-filled pages that the kernels must never read.

Sliding windows and soft caps (the options Gemma, Mistral and Qwen2's sliding layers need): the
reference twin is checked against attention written out in numpy, the kernels against the
twin. The pages wholly before a row's first window are NaN-filled in the kernels' pools: a walk
must skip them, and a read would show (a masked key's weight, 0, times NaN is NaN).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import (
    decode_attention,
    decode_attention_ref,
    prefill_attention,
    prefill_attention_ref,
)

INTERPRET = jax.default_backend() != "gpu"
F32, BF16, F16, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn


def _paged_kv(rng, seq_lens, case):
    """Random pools and page tables for ``case`` (its page_size, pages_per_seq, kv_heads, ...).

    Returns (k_pages, v_pages) for the kernels, (k_ref, v_ref) for the reference, and the page
    table. Used entries name random distinct pages; entries past a sequence's pages name
    "stale" pages, and its last page's tail past its length is stale too (a previous request's
    values): NaN in the kernels' pools and zero in the reference's.
    """
    batch, pages_per_seq, page_size = len(seq_lens), case.pages_per_seq, case.page_size
    num_live, num_stale = batch * pages_per_seq, 3
    num_pages = 1 + num_live + 5 + num_stale  # null page, live pages, spare, stale
    shape = (num_pages, page_size, case.kv_heads, case.head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    live = rng.permutation(np.arange(1, num_pages - num_stale))[:num_live]
    stale = rng.integers(num_pages - num_stale, num_pages, size=(batch, pages_per_seq))
    used = -(-np.asarray(seq_lens) // page_size)  # pages holding tokens
    in_use = np.arange(pages_per_seq)[None, :] < used[:, None]
    table = np.where(in_use, live.reshape(batch, pages_per_seq), stale)
    k_ref, v_ref = k.copy(), v.copy()
    k_ref[-num_stale:] = v_ref[-num_stale:] = 0.0
    k[-num_stale:] = v[-num_stale:] = np.nan
    for b, length in enumerate(seq_lens):
        if length % page_size and length // page_size < pages_per_seq:
            page = table[b, length // page_size]
            k_ref[page, length % page_size:] = v_ref[page, length % page_size:] = 0.0
            k[page, length % page_size:] = v[page, length % page_size:] = np.nan
    kernel_kv, ref_kv = (
        tuple(jnp.asarray(x, case.dtype) for x in kv) for kv in [(k, v), (k_ref, v_ref)]
    )
    return kernel_kv, ref_kv, jnp.asarray(table, jnp.int32)


def _assert_close(out, ref, rows, dtype):
    """out, ref: [B, ..., D]; rows: [B, ...] bool, the rows the contract defines."""
    out = np.asarray(out.astype(F32), np.float64)
    ref = np.asarray(ref.astype(F32), np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf (an element left unwritten?)"
    if dtype == F32:
        np.testing.assert_allclose(out[rows], ref[rows], rtol=1e-5, atol=1e-5)
    else:
        scale = np.abs(ref[rows]).max()
        np.testing.assert_allclose(out[rows], ref[rows], rtol=2e-2, atol=2e-2 * scale)


def _reference(fn, *args, **options):
    with jax.default_matmul_precision("float32"):  # no TF32 in the reference on a GPU
        return fn(*args, **options)


def _poison_before_window(kv, table, first_positions, window, page_size):
    """NaN into the pages each row's walk must skip: those wholly before the window of the
    row's earliest query (first_positions [B]). kv: the kernels' (k_pages, v_pages)."""
    table = np.asarray(table)
    pages = np.concatenate([table[b, :max(p - window + 1, 0) // page_size]
                            for b, p in enumerate(first_positions)]).astype(np.int32)
    assert pages.size, "a case whose windows skip no page checks no skip"
    return tuple(x.at[pages].set(np.nan) for x in kv)


def _dense_attention(q, k, v, positions, seq_lens, scale, sliding_window, soft_cap):
    """Attention written out in numpy over each sequence's keys laid end to end.

    q: [B, C, H, D]; k, v: [B, L, KV, D]; positions: [B, C]; the mask spelled out: query p
    sees key j when j <= p, j < seq_len and (with a window w) p - w < j. A query that sees no
    key (padding) gives zeros."""
    batch, chunk, heads, _ = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b, c, h in np.ndindex(batch, chunk, heads):
        p, j = positions[b, c], np.arange(k.shape[1])
        mask = (j <= p) & (j < seq_lens[b])
        if sliding_window is not None:
            mask &= j > p - sliding_window
        if not mask.any():
            continue
        s = scale * (k[b, :, h // group] @ q[b, c, h])  # [L]
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        s = np.where(mask, s, -np.inf)
        w = np.exp(s - s.max())
        out[b, c, h] = (w / w.sum()) @ v[b, :, h // group]
    return out


@pytest.mark.parametrize(("sliding_window", "soft_cap"),
                         [(1, None), (6, None), (8, None), (100, None), (None, 1.0), (6, 1.0)])
def test_reference_equals_dense_numpy_attention(sliding_window, soft_cap):
    """The twin (prefill chunks from past 0, and decode) against `_dense_attention`; windows of
    1 key, of 6 (not a multiple of the page size 4), of 2 pages and longer than every
    sequence."""
    rng = np.random.default_rng(30)
    page_size, pages_per_seq, kv_heads, group, head_dim, chunk = 4, 6, 2, 3, 8, 5
    starts, chunk_lens = np.array([0, 9, 18]), np.array([5, 4, 3])
    seq_lens = starts + chunk_lens
    batch, max_len = len(starts), pages_per_seq * page_size
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    table = rng.permutation(np.arange(1, 1 + batch * pages_per_seq)).reshape(batch, -1)
    k_pages = np.zeros((1 + batch * pages_per_seq, page_size, kv_heads, head_dim))
    v_pages = np.zeros_like(k_pages)
    k_pages[table] = k.reshape(batch, pages_per_seq, page_size, kv_heads, head_dim)
    v_pages[table] = v.reshape(batch, pages_per_seq, page_size, kv_heads, head_dim)
    q = rng.standard_normal((batch, chunk, kv_heads * group, head_dim))
    positions = starts[:, None] + np.arange(chunk)
    args = [jnp.asarray(x, F32) for x in (q, k_pages, v_pages)] + [jnp.asarray(table, jnp.int32)]
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap}

    got = _reference(prefill_attention_ref, *args, jnp.asarray(positions, jnp.int32),
                     jnp.asarray(seq_lens, jnp.int32), 0.4, **options)
    want = _dense_attention(q, k, v, positions, seq_lens, 0.4, **options)
    real = np.arange(chunk)[None, :] < chunk_lens[:, None]
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=1e-5, atol=1e-5)
    if soft_cap is not None or sliding_window < seq_lens.max():
        plain = _dense_attention(q, k, v, positions, seq_lens, 0.4, None, None)
        assert not np.allclose(want[real], plain[real]), "the options change nothing here"

    decode_q = q[np.arange(batch), chunk_lens - 1]  # each row's last query, at seq_len - 1
    got = _reference(decode_attention_ref, jnp.asarray(decode_q, F32), *args[1:],
                     jnp.asarray(seq_lens, jnp.int32), 0.4, **options)
    np.testing.assert_allclose(np.asarray(got), want[np.arange(batch), chunk_lens - 1],
                               rtol=1e-5, atol=1e-5)


class DecodeCase(NamedTuple):
    seed: int
    seq_lens: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    dtype: type = F32
    tuning: dict | None = None  # keyword tuning args for the kernel


DECODE_CASES = {
    "one-slot-mha-mid-page": DecodeCase(0, [13], 2, 2, 16, 8, 4),
    "gqa2-boundary-len1-empty": DecodeCase(
        1, [16, 1, 0, 7], 4, 2, 32, 4, 6, tuning={"pages_per_block": 4, "num_splits": 2}
    ),
    "gqa4-8slots-splits": DecodeCase(
        2,
        [256, 1, 100, 0, 64, 17, 255, 48],
        8,
        2,
        64,
        16,
        16,
        tuning={"pages_per_block": 2, "num_splits": 3},
    ),
    "gqa4-bf16-auto-splits": DecodeCase(3, [200, 0, 31, 32, 1], 16, 4, 64, 16, 16, BF16),
    "gqa2-bf16-page32": DecodeCase(4, [64, 33, 0], 4, 2, 32, 32, 4, BF16, {"num_splits": 1}),
    "gqa2-f16": DecodeCase(7, [40, 1, 0, 16], 4, 2, 32, 8, 6, F16),  # fp16 checkpoints
    "head-dim-8-page-4": DecodeCase(5, [9, 12, 3], 4, 2, 8, 4, 8, tuning={"pages_per_block": 2}),
    "all-empty": DecodeCase(6, [0, 0], 4, 1, 16, 8, 2, tuning={"num_splits": 2}),
}


@pytest.mark.parametrize("name", DECODE_CASES, ids=str)
def test_decode_matches_reference(name):
    case = DECODE_CASES[name]
    rng = np.random.default_rng(case.seed)
    (k, v), (k_ref, v_ref), table = _paged_kv(rng, case.seq_lens, case)
    q = jnp.asarray(
        rng.standard_normal((len(case.seq_lens), case.heads, case.head_dim)), case.dtype
    )
    lens = jnp.asarray(case.seq_lens, jnp.int32)
    scale = case.head_dim**-0.5

    out = decode_attention(q, k, v, table, lens, scale, interpret=INTERPRET, **(case.tuning or {}))
    ref = _reference(decode_attention_ref, q, k_ref, v_ref, table, lens, scale)

    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, np.asarray(case.seq_lens) > 0, case.dtype)


# (case, sliding_window, soft_cap): windows of 1 key, not a multiple of the page size, longer
# than every sequence; the cap alone and with a window
DECODE_OPTIONS = [
    ("gqa4-8slots-splits", 1, None),
    ("gqa4-8slots-splits", 37, None),
    ("gqa4-8slots-splits", 1000, None),
    ("gqa4-8slots-splits", None, 1.0),
    ("gqa4-8slots-splits", 37, 1.0),
    ("gqa2-boundary-len1-empty", 5, 2.0),
    ("gqa4-bf16-auto-splits", 48, 2.0),
]


@pytest.mark.parametrize(("name", "sliding_window", "soft_cap"), DECODE_OPTIONS, ids=str)
def test_decode_with_window_and_cap_matches_reference(name, sliding_window, soft_cap):
    case = DECODE_CASES[name]
    rng = np.random.default_rng(case.seed + 40)
    (k, v), (k_ref, v_ref), table = _paged_kv(rng, case.seq_lens, case)
    lens = np.asarray(case.seq_lens)
    if sliding_window is not None and sliding_window < lens.max():
        k, v = _poison_before_window((k, v), table, lens - 1, sliding_window, case.page_size)
    q = jnp.asarray(
        rng.standard_normal((len(case.seq_lens), case.heads, case.head_dim)), case.dtype
    )
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    scale = case.head_dim**-0.5

    out = decode_attention(q, k, v, table, jnp.asarray(lens, jnp.int32), scale,
                           interpret=INTERPRET, **(case.tuning or {}), **options)
    ref = _reference(decode_attention_ref, q, k_ref, v_ref, table, jnp.asarray(lens, jnp.int32),
                     scale, **options)
    _assert_close(out, ref, lens > 0, case.dtype)


class PrefillCase(NamedTuple):
    seed: int
    starts: list[int]  # position of each sequence's first chunk query
    chunk_lens: list[int]  # real queries; the rest of the chunk is padding
    chunk: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    dtype: type = F32
    tuning: dict | None = None  # keyword tuning args for the kernel


PREFILL_CASES = {
    "one-seq-mha-from-0": PrefillCase(10, [0], [8], 8, 2, 2, 16, 8, 2),
    "gqa2-mid-sequence-padded": PrefillCase(
        11, [0, 37, 100], [16, 9, 5], 16, 4, 2, 32, 4, 32, tuning={"block_q": 4}
    ),
    "gqa4-bf16-empty-seq": PrefillCase(12, [0, 40, 0, 128], [8, 8, 0, 3], 8, 8, 2, 64, 16, 9, BF16),
    "gqa3-bf16-page-boundaries": PrefillCase(13, [64, 0], [32, 32], 32, 6, 2, 32, 32, 3, BF16),
    "gqa2-f16-mid-sequence": PrefillCase(16, [0, 21], [8, 5], 8, 4, 2, 32, 8, 5, F16),
    "head-dim-8-length-1": PrefillCase(14, [0, 5], [1, 4], 4, 4, 1, 8, 4, 3, tuning={"block_q": 8}),
    "gqa4-many-key-blocks": PrefillCase(
        15, [0, 120, 200], [16, 16, 16], 16, 8, 2, 16, 8, 32, tuning={"block_q": 2}
    ),
}


@pytest.mark.parametrize("name", PREFILL_CASES, ids=str)
def test_prefill_matches_reference(name):
    case = PREFILL_CASES[name]
    rng = np.random.default_rng(case.seed)
    starts = np.asarray(case.starts)
    seq_lens = starts + np.asarray(case.chunk_lens)
    (k, v), (k_ref, v_ref), table = _paged_kv(rng, seq_lens, case)
    q_shape = (len(starts), case.chunk, case.heads, case.head_dim)
    q = jnp.asarray(rng.standard_normal(q_shape), case.dtype)
    positions = jnp.asarray(starts[:, None] + np.arange(case.chunk)[None, :], jnp.int32)
    lens = jnp.asarray(seq_lens, jnp.int32)
    scale = case.head_dim**-0.5

    out = prefill_attention(
        q, k, v, table, positions, lens, scale, interpret=INTERPRET, **(case.tuning or {})
    )
    ref = _reference(prefill_attention_ref, q, k_ref, v_ref, table, positions, lens, scale)

    assert out.shape == q.shape and out.dtype == q.dtype
    rows = np.broadcast_to((seq_lens > 0)[:, None], positions.shape)  # every query sees key 0
    _assert_close(out, ref, rows, case.dtype)


# (case, sliding_window, soft_cap), as DECODE_OPTIONS; chunks that start past 0 in every case
PREFILL_OPTIONS = [
    ("gqa2-mid-sequence-padded", 1, None),
    ("gqa2-mid-sequence-padded", 6, None),
    ("gqa2-mid-sequence-padded", 1000, None),
    ("gqa2-mid-sequence-padded", None, 1.0),
    ("gqa4-many-key-blocks", 13, 1.0),
    ("gqa4-bf16-empty-seq", 20, 2.0),
]


@pytest.mark.parametrize(("name", "sliding_window", "soft_cap"), PREFILL_OPTIONS, ids=str)
def test_prefill_with_window_and_cap_matches_reference(name, sliding_window, soft_cap):
    case = PREFILL_CASES[name]
    rng = np.random.default_rng(case.seed + 40)
    starts = np.asarray(case.starts)
    seq_lens = starts + np.asarray(case.chunk_lens)
    (k, v), (k_ref, v_ref), table = _paged_kv(rng, seq_lens, case)
    if sliding_window is not None and sliding_window < starts.max():
        k, v = _poison_before_window((k, v), table, starts, sliding_window, case.page_size)
    q_shape = (len(starts), case.chunk, case.heads, case.head_dim)
    q = jnp.asarray(rng.standard_normal(q_shape), case.dtype)
    positions = starts[:, None] + np.arange(case.chunk)[None, :]
    args = (jnp.asarray(positions, jnp.int32), jnp.asarray(seq_lens, jnp.int32),
            case.head_dim**-0.5)
    options = {"sliding_window": sliding_window, "soft_cap": soft_cap}

    out = prefill_attention(q, k, v, table, *args, interpret=INTERPRET, **(case.tuning or {}),
                            **options)
    ref = _reference(prefill_attention_ref, q, k_ref, v_ref, table, *args, **options)
    # a padding query past its sequence sees no key in a window: only real queries count
    _assert_close(out, ref, positions < seq_lens[:, None], case.dtype)


@pytest.mark.parametrize(("dtype", "options"), [
    (F32, {}), (BF16, {}), (BF16, {"sliding_window": 37, "soft_cap": 2.0}),
])
def test_an_fp8_pool_is_read_as_its_values_widened(dtype, options):
    """kv_cache_dtype="fp8": the kernels widen each float8_e4m3fn key and value to q's dtype as
    they load it (exactly: float32 and bfloat16 hold e4m3's values), so they give the outputs
    they give over the pool widened beforehand, for decode and prefill chunks."""
    case = DECODE_CASES["gqa4-8slots-splits"]._replace(dtype=F32)
    rng = np.random.default_rng(21)
    (k, v), _, table = _paged_kv(rng, case.seq_lens, case)
    k8, v8 = k.astype(FP8), v.astype(FP8)
    q = jnp.asarray(rng.standard_normal((len(case.seq_lens), case.heads, case.head_dim)), dtype)
    lens = jnp.asarray(case.seq_lens, jnp.int32)
    out = decode_attention(q, k8, v8, table, lens, 0.125, interpret=INTERPRET, **case.tuning,
                           **options)
    wide = decode_attention(q, k8.astype(dtype), v8.astype(dtype), table, lens, 0.125,
                            interpret=INTERPRET, **case.tuning, **options)
    rows = np.asarray(case.seq_lens) > 0
    np.testing.assert_array_equal(np.asarray(out.astype(F32))[rows],
                                  np.asarray(wide.astype(F32))[rows])
    chunk = 8
    qc = jnp.asarray(rng.standard_normal((len(case.seq_lens), chunk, case.heads,
                                          case.head_dim)), dtype)
    starts = np.maximum(np.asarray(case.seq_lens) - chunk, 0)
    positions = jnp.asarray(starts[:, None] + np.arange(chunk)[None, :], jnp.int32)
    out = prefill_attention(qc, k8, v8, table, positions, lens, 0.125, interpret=INTERPRET,
                            **options)
    wide = prefill_attention(qc, k8.astype(dtype), v8.astype(dtype), table, positions, lens,
                             0.125, interpret=INTERPRET, **options)
    np.testing.assert_array_equal(np.asarray(out.astype(F32))[rows],
                                  np.asarray(wide.astype(F32))[rows])


WINDOW_CAP = {"sliding_window": 40, "soft_cap": 30.0}


@pytest.mark.parametrize(
    ("dtype", "head_dim", "page_size", "group", "num_splits", "pool", "options"), [
        (F32, 64, 16, 1, 1, None, {}), (BF16, 128, 16, 4, 4, None, {}),
        (F16, 64, 8, 2, 2, None, WINDOW_CAP), (BF16, 64, 32, 2, None, None, {}),
        (BF16, 128, 16, 4, None, FP8, {}), (BF16, 128, 16, 4, None, FP8, WINDOW_CAP),
    ])
def test_kernels_lower_through_triton(dtype, head_dim, page_size, group, num_splits, pool,
                                      options):
    """Lowered for CUDA, here on the CPU: the Triton lowering runs its rules (no scalar
    prefetch, no scratch, power-of-two blocks, the primitives it knows), which interpret mode
    never checks, so a kernel change that only a GPU would refuse fails here. `pool`: the KV
    pool's dtype when it is not q's (fp8); `options`: a sliding window and a soft cap."""
    kv_heads, slots, pages_per_seq, chunk = 2, 4, 8, 32
    q = jax.ShapeDtypeStruct((slots, kv_heads * group, head_dim), dtype)
    pool = jax.ShapeDtypeStruct((64, page_size, kv_heads, head_dim), pool or dtype)
    table = jax.ShapeDtypeStruct((slots, pages_per_seq), jnp.int32)
    lens = jax.ShapeDtypeStruct((slots,), jnp.int32)
    decode = jax.jit(lambda q, k, v, t, n: decode_attention(q, k, v, t, n, 0.125,
                                                              num_splits=num_splits, **options))
    text = decode.trace(q, pool, pool, table, lens).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    qc = jax.ShapeDtypeStruct((slots, chunk, kv_heads * group, head_dim), dtype)
    positions = jax.ShapeDtypeStruct((slots, chunk), jnp.int32)
    prefill = jax.jit(lambda q, k, v, t, p, n: prefill_attention(q, k, v, t, p, n, 0.125,
                                                                 **options))
    text = prefill.trace(qc, pool, pool, table, positions, lens).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_interpreter_poisons_unwritten_outputs():
    """The premise of the finiteness checks: an output the kernel never writes comes out NaN."""

    def write_first_block_only(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    out = pl.pallas_call(
        write_first_block_only,
        grid=(2,),
        in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((16,), F32),
        interpret=True,
    )(jnp.ones(16, F32))
    assert np.isfinite(out[:8]).all() and np.isnan(out[8:]).all()


def _decode_args(**override):
    args = {
        "q": jnp.zeros((2, 8, 16), F32),
        "k_pages": jnp.zeros((5, 4, 4, 16), F32),
        "v_pages": jnp.zeros((5, 4, 4, 16), F32),
        "page_table": jnp.zeros((2, 3), jnp.int32),
        "seq_lens": jnp.zeros((2,), jnp.int32),
        "scale": 0.25,
    }
    return args | override


DECODE_ERRORS = {
    "q rank": ({"q": jnp.zeros((2, 8), F32)}, r"q has shape \(2, 8\)"),
    "heads": ({"q": jnp.zeros((2, 6, 16), F32)}, "q has 6 heads, not a multiple of k_pages' 4 kv"),
    "head_dim": ({"q": jnp.zeros((2, 8, 32), F32)}, "q has head_dim 32, k_pages has 16"),
    "q dtype": ({"q": jnp.zeros((2, 8, 16), jnp.int8)}, "q has dtype int8"),
    "no slots": ({"q": jnp.zeros((0, 8, 16), F32), "page_table": jnp.zeros((0, 3), jnp.int32),
                  "seq_lens": jnp.zeros((0,), jnp.int32)}, "q has 0 rows"),
    "empty table": ({"page_table": jnp.zeros((2, 0), jnp.int32)}, r"page_table has shape \(2, 0\)"),
    "kv dtype": (
        {"k_pages": jnp.zeros((5, 4, 4, 16), BF16), "v_pages": jnp.zeros((5, 4, 4, 16), BF16)},
        "k_pages/v_pages have dtypes bfloat16/bfloat16, not q's float32",
    ),
    "v shape": ({"v_pages": jnp.zeros((6, 4, 4, 16), F32)}, r"v_pages has shape \(6, 4, 4, 16\)"),
    "page_size": (
        {"k_pages": jnp.zeros((5, 6, 4, 16), F32), "v_pages": jnp.zeros((5, 6, 4, 16), F32)},
        "page_size 6 is not a power of two",
    ),
    "table rows": ({"page_table": jnp.zeros((3, 3), jnp.int32)}, r"page_table has shape \(3, 3\)"),
    "table dtype": ({"page_table": jnp.zeros((2, 3), F32)}, "page_table has dtype float32"),
    "seq_lens": ({"seq_lens": jnp.zeros((3,), jnp.int32)}, r"seq_lens is int32\[3\]"),
    "window 0": ({"sliding_window": 0}, "sliding_window is 0, expected a positive int or None"),
    "window float": ({"sliding_window": 4.0}, r"sliding_window is 4\.0, expected a positive int"),
    "cap 0": ({"soft_cap": 0.0}, r"soft_cap is 0\.0, expected a positive number or None"),
}


@pytest.mark.parametrize("case", DECODE_ERRORS, ids=str)
def test_decode_rejects_bad_inputs(case):
    override, message = DECODE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        decode_attention(**_decode_args(**override), interpret=True)


def test_decode_rejects_bad_tuning():
    with pytest.raises(ValueError, match="pages_per_block is 3, expected a power of two"):
        decode_attention(**_decode_args(), pages_per_block=3, interpret=True)
    with pytest.raises(ValueError, match="num_splits is 0"):
        decode_attention(**_decode_args(), num_splits=0, interpret=True)


def test_prefill_rejects_bad_inputs():
    q = jnp.zeros((2, 4, 8, 16), F32)
    pages = jnp.zeros((5, 4, 4, 16), F32)
    table = jnp.zeros((2, 3), jnp.int32)
    positions = jnp.zeros((2, 4), jnp.int32)
    lens = jnp.zeros((2,), jnp.int32)

    def call(**override):
        args = dict(q=q, k_pages=pages, v_pages=pages, page_table=table, positions=positions)
        args |= dict(seq_lens=lens, scale=0.25, interpret=True) | override
        return prefill_attention(**args)

    with pytest.raises(ValueError, match=r"q has shape \(2, 8, 16\)"):
        call(q=jnp.zeros((2, 8, 16), F32))
    with pytest.raises(ValueError, match="q has 10 heads, not a multiple of k_pages' 4 kv heads"):
        call(q=jnp.zeros((2, 4, 10, 16), F32))
    with pytest.raises(ValueError, match=r"positions is int32\[2, 5\], expected int32\[2, 4\]"):
        call(positions=jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"seq_lens is float32\[2\]"):
        call(seq_lens=jnp.zeros((2,), F32))
    with pytest.raises(ValueError, match="block_q is 6, expected a power of two"):
        call(block_q=6)
    with pytest.raises(ValueError, match="sliding_window is -2, expected a positive int"):
        call(sliding_window=-2)
    with pytest.raises(ValueError, match=r"soft_cap is -1\.0, expected a positive number"):
        call(soft_cap=-1.0)
