"""The CPU matmul on int8 and float8_e4m3fn weights with a float32 scale per column
(cpu_kernels/cpu_matmul.cc through matmul_cpu_quant): XLA's dot on the widened weights is the
reference; each element is the float32 kernel's chain on float32(w), then one multiply by its
column's scale, so a row's bits do not depend on the other rows, on the layout of w or on the
instruction-set path."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cpu_kernels.matmul import (
    PANEL,
    matmul_cpu,
    matmul_cpu_quant,
    matmul_cpu_quant_panels,
    pack_panels,
)

DTYPES = [jnp.int8, jnp.float8_e4m3fn]
# rows around the 6-row register tile and the 96-row work item, columns around the 64-column
# panel (partial panels: in place, widened into scratch; packed, read whole from the zeros),
# k around the 256-long block; 13 rows and k past a block: the next block's shared prefetch
SHAPES = [(1, 1, 1), (5, 17, 15), (6, 64, 64), (7, 256, 65), (13, 300, 130), (100, 513, 64),
          (97, 40, 200)]


def quantised(rng, k: int, n: int, dtype) -> tuple[jax.Array, jax.Array]:
    """w [K, N] of `dtype` spread over its range, and a scale [N] that brings w * scale near 1."""
    if dtype == jnp.int8:
        w = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    else:  # well inside e4m3fn's +-448
        w = jnp.asarray(rng.standard_normal((k, n)) * 32, jnp.float32).astype(dtype)
    return w, jnp.asarray(rng.uniform(0.5, 1.5, n) / 32, jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_quantised_matmul_matches_xla_on_the_widened_weights(m, k, n, dtype):
    rng = np.random.default_rng(m * 1000 + k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, scale = quantised(rng, k, n, dtype)
    want = np.asarray(jnp.matmul(x, w.astype(jnp.float32), precision="highest") * scale)
    got = np.asarray(jax.jit(matmul_cpu_quant)(x, w, scale))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(k), rtol=1e-5)
    # to the bit: the float32 kernel's chain on the widened weights, then the scale
    assert (got == np.asarray(matmul_cpu(x, w.astype(jnp.float32)) * scale)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_packed_panels_give_the_same_bits_as_w_in_place(m, k, n, dtype):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, scale = quantised(rng, k, n, dtype)
    panels = pack_panels(w)
    assert panels.dtype == w.dtype and panels.shape == (-(-n // PANEL), k, PANEL)
    assert (np.asarray(panels[-1, :, n - (len(panels) - 1) * PANEL:], np.float32) == 0).all()
    got = np.asarray(jax.jit(matmul_cpu_quant_panels, static_argnums=3)(x, panels, scale, n))
    assert (got == np.asarray(matmul_cpu_quant(x, w, scale))).all()


def _rows_alone_and_together(x, w, scale, panels: bool, library=""):
    def mm(rows):
        if panels:
            return np.asarray(matmul_cpu_quant_panels(rows, pack_panels(w), scale, w.shape[1],
                                                      library))
        return np.asarray(matmul_cpu_quant(rows, w, scale, library))

    return mm(x), np.stack([mm(x[i:i + 1])[0] for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("panels", [False, True])
def test_a_row_gives_the_same_bits_whatever_the_other_rows(dtype, panels):
    rng = np.random.default_rng(7)
    k, n = 384, 200
    w, scale = quantised(rng, k, n, dtype)
    x = jnp.asarray(rng.standard_normal((64, k)), jnp.float32)
    together, alone = _rows_alone_and_together(x, w, scale, panels)
    assert (together == alone).all()
    for m in (1, 2, 7):  # and as the first rows of other batch sizes
        assert (np.asarray(matmul_cpu_quant(x[:m], w, scale)) == alone[:m]).all()
    for at in (0, 5, 40, 63):  # row 0 elsewhere among the others
        moved = jnp.concatenate([x[1:at + 1], x[:1], x[at + 1:]])
        assert (np.asarray(matmul_cpu_quant(moved, w, scale))[at] == alone[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_instruction_set_path_gives_the_same_bits(dtype, other_paths):
    # AVX2 and plain C++ against AVX-512 (on this machine): the weight widened the same way,
    # rows alone and together, in place and packed
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((13, 300)), jnp.float32)
    w, scale = quantised(rng, 300, 130, dtype)
    want = np.asarray(matmul_cpu_quant(x, w, scale))
    for suffix in other_paths:
        for panels in (False, True):
            together, alone = _rows_alone_and_together(x, w, scale, panels, suffix)
            assert (together == want).all() and (alone == want).all(), (suffix, panels)


def _every_value_by_identity(w, scale, library=""):
    """x = I picks row k of w: out[k] = float32(w[k]) * scale, exactly (zeros add nothing)."""
    x = jnp.eye(w.shape[0], dtype=jnp.float32)
    in_place = np.asarray(matmul_cpu_quant(x, w, scale, library))
    packed = np.asarray(matmul_cpu_quant_panels(x, pack_panels(w), scale, w.shape[1], library))
    assert (in_place == packed).all(), library
    return in_place


def test_int8_extremes_widen_exactly(other_paths):
    w = jnp.asarray(np.arange(-128, 128).reshape(4, 64), jnp.int8)  # -128 .. 127
    scale = jnp.asarray(np.linspace(0.25, 4, 64), jnp.float32)
    want = np.arange(-128, 128, dtype=np.float32).reshape(4, 64) * np.asarray(scale)
    for suffix in ("", *other_paths):
        np.testing.assert_array_equal(_every_value_by_identity(w, scale, suffix), want)


def test_fp8_extremes_widen_exactly(other_paths):
    # every e4m3fn byte but the two NaNs: +-448, the subnormals down to +-2^-9, +-0. XLA runs the
    # kernels with denormals-are-zero set: a widening through float32 subnormals would give 0
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # 254 values
    values = codes.view(ml_dtypes.float8_e4m3fn)
    w = jnp.asarray(np.concatenate([values, values[:2]]).reshape(4, 64))
    scale = jnp.ones(64, jnp.float32)
    want = np.asarray(w, np.float32)
    assert {448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 7 * 2.0 ** -9} <= set(want.ravel())
    for suffix in ("", *other_paths):
        np.testing.assert_array_equal(_every_value_by_identity(w, scale, suffix), want)
    # a column's scale multiplies a subnormal weight's value too
    small = jnp.full((1, 1), 2.0 ** -9, jnp.float8_e4m3fn)
    got = matmul_cpu_quant(jnp.full((1, 1), 3.0, jnp.float32), small, jnp.full((1,), 0.5))
    assert float(got[0, 0]) == 3 * 2.0 ** -10


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantised_matmul_keeps_leading_axes_and_takes_empty_shapes(dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    w, scale = quantised(rng, 8, 70, dtype)
    got = matmul_cpu_quant(x, w, scale)
    assert got.shape == (2, 3, 70)
    assert (np.asarray(got) == np.asarray(matmul_cpu_quant(x.reshape(6, 8), w, scale))
            .reshape(2, 3, 70)).all()
    packed = matmul_cpu_quant_panels(x, pack_panels(w), scale, 70)
    assert (np.asarray(packed) == np.asarray(got)).all()
    assert matmul_cpu_quant(jnp.zeros((0, 8)), w, scale).shape == (0, 70)
    empty = matmul_cpu_quant(jnp.ones((3, 0)), jnp.zeros((0, 4), dtype), jnp.ones(4))
    assert empty.shape == (3, 4) and (np.asarray(empty) == 0).all()


I8, F8 = jnp.int8, jnp.float8_e4m3fn


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((4, 3), I8), jnp.ones(3)),
     "takes float32 x, int8 or float8_e4m3fn w and float32 scale, got x bfloat16"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3)), jnp.ones(3)), "got x float32, w float32"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3), jnp.float8_e5m2), jnp.ones(3)), "w float8_e5m2"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3), F8), jnp.ones(3, jnp.bfloat16)), "scale bfloat16"),
    ((jnp.zeros((2, 4)), jnp.zeros((5, 3), I8), jnp.ones(3)), "x has 4 features, w takes 5"),
    ((jnp.zeros((2, 4)), jnp.zeros((4,), I8), jnp.ones(3)), "expected \\[..., K\\] and a matrix"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3), I8), jnp.ones(4)),
     "scale has shape \\(4,\\): expected \\[3\\], one per column"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3), I8), jnp.ones((1, 3))), "scale has shape \\(1, 3\\)"),
])
def test_quantised_matmul_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        matmul_cpu_quant(*args)


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((2, 4)), jnp.zeros((2, 4, PANEL), I8), jnp.ones(200), 200),
     "expected \\[4, K, 64\\] for 200"),
    ((jnp.zeros((2, 5)), jnp.zeros((1, 4, PANEL), F8), jnp.ones(10), 10),
     "the panels take 4 features"),
    ((jnp.zeros((2, 4)), jnp.zeros((1, 4, PANEL)), jnp.ones(10), 10), "got x float32, w float32"),
    ((jnp.zeros((2, 4)), jnp.zeros((1, 4, PANEL), I8), jnp.ones(64), 10),
     "scale has shape \\(64,\\): expected \\[10\\]"),
])
def test_quantised_panels_reject_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        matmul_cpu_quant_panels(*args)
