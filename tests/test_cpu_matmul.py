"""The CPU matmul kernel (cpu_kernels/cpu_matmul.cc through XLA's FFI): float64 numpy is the
reference; a row's result is bitwise the same whatever the other rows, on every instruction-set
path the kernel has; the engine picks it, or XLA's dot, as it says."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_kernels import library as cpu_library
from cpu_kernels.matmul import (
    PANEL,
    matmul_cpu,
    matmul_cpu_panels,
    pack_panels,
    row_sum_squares_cpu,
)
from jaxserve.backends import Ops, resolve_matmul_impl
from jaxserve.backends.cpu import CpuOps

# rows around the 6-row register tile and the 96-row work item, columns around the 64-column
# panel (masked partial panels), k around the 256-long block (partial sums through the output)
SHAPES = [(1, 1, 1), (5, 17, 15), (6, 64, 64), (7, 256, 65), (13, 300, 130), (100, 513, 64),
          (97, 40, 200)]


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_cpu_matmul_equals_float64(m, k, n, transposed):
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    got = np.asarray(jax.jit(matmul_cpu, static_argnums=2)(x, w, transposed))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(k), rtol=1e-5)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_packed_panels_give_the_same_bits_as_w_in_place(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    panels = pack_panels(w)
    assert panels.shape == (-(-n // PANEL), k, PANEL)
    got = np.asarray(jax.jit(matmul_cpu_panels, static_argnums=2)(x, panels, n))
    assert (got == np.asarray(matmul_cpu(x, w))).all()


def test_pack_panels_layout():
    w = jnp.arange(3 * 70, dtype=jnp.float32).reshape(3, 70)
    panels = np.asarray(pack_panels(w))
    np.testing.assert_array_equal(panels[0], np.asarray(w)[:, :64])
    np.testing.assert_array_equal(panels[1, :, :6], np.asarray(w)[:, 64:])
    assert (panels[1, :, 6:] == 0).all()  # the last panel is zero past N


def test_pack_weights_packs_every_linear_kernel_and_linear_takes_either():
    layer = nnx.Linear(40, 130, use_bias=True, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 40)), jnp.float32)
    want = np.asarray(layer(x))  # XLA's dot
    ops = CpuOps()
    in_place = np.asarray(ops.linear(layer, x))
    np.testing.assert_allclose(in_place, want, atol=1e-5)
    graphdef, state = nnx.split(layer)
    assert Ops().pack_weights(graphdef, state)[1] is state  # XLA's dot keeps the layout
    kernel = state["kernel"].get_value()
    packed = nnx.merge(*ops.pack_weights(graphdef, state))
    assert packed.kernel[...].shape == (3, 40, PANEL)
    assert (np.asarray(ops.linear(packed, x)) == in_place).all()
    # packed in the state's own variables: the in-place kernel is no longer held
    assert state["kernel"].get_value().shape == (3, 40, PANEL)
    assert (np.asarray(packed.kernel[...]) == np.asarray(pack_panels(kernel))).all()


def test_cpu_matmul_keeps_leading_axes_and_takes_empty_shapes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul_cpu(x, w)), x @ w, atol=1e-5)
    assert matmul_cpu(jnp.zeros((0, 8)), w).shape == (0, 5)
    assert (np.asarray(matmul_cpu(jnp.ones((3, 0)), jnp.ones((0, 4)))) == 0).all()


def _rows_alone_and_together(x, w, transposed=False, library=""):
    together = np.asarray(matmul_cpu(x, w, transposed, library))
    alone = np.stack([np.asarray(matmul_cpu(x[i:i + 1], w, transposed, library))[0]
                      for i in range(x.shape[0])])
    return together, alone


@pytest.mark.parametrize("transposed", [False, True])
def test_a_row_gives_the_same_bits_whatever_the_other_rows(transposed):
    # XLA's dot on the CPU does not (it sums a row one way for M = 1, another for M = 2..32)
    rng = np.random.default_rng(7)
    k, n = 384, 200
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((40, k)), jnp.float32)
    together, alone = _rows_alone_and_together(x, w, transposed)
    assert (together == alone).all()
    for m in (2, 7, 13, 33):  # and as the first rows of other batch sizes
        assert (np.asarray(matmul_cpu(x[:m], w, transposed)) == alone[:m]).all()


def test_every_instruction_set_path_gives_the_same_bits(other_paths):
    # one chain of correctly rounded fused multiply-adds per element, however it is vectorised:
    # a model's greedy output does not depend on the machine's vector width either
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((13, 300)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 130)), jnp.float32)
    want = np.asarray(matmul_cpu(x, w))
    for suffix in other_paths:
        together, alone = _rows_alone_and_together(x, w, library=suffix)
        assert (together == want).all() and (alone == want).all(), suffix
        wt = jnp.asarray(np.asarray(w).T)
        assert (np.asarray(matmul_cpu(x, wt, True, suffix)) == want).all(), suffix
        panels = np.asarray(matmul_cpu_panels(x, pack_panels(w), w.shape[1], suffix))
        assert (panels == want).all(), suffix


@pytest.mark.parametrize(("shape"), [(1, 7), (3, 512), (13, 384), (70, 33), (2, 9, 64), (0, 8),
                                     (4, 0)])
def test_row_sum_squares_gives_the_bits_of_the_matmul_on_the_squares(shape, other_paths):
    # RMSNorm's sum: before this kernel, XLA squared x and the matmul summed the squares
    # against a column of ones; same chain of adds in index order, on every build
    x = jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape) * 3, jnp.float32)
    want = np.asarray(matmul_cpu(x * x, jnp.ones((shape[-1], 1), jnp.float32)))
    for suffix in ("", *other_paths):
        got = np.asarray(jax.jit(row_sum_squares_cpu, static_argnums=1)(x, suffix))
        assert got.shape == (*shape[:-1], 1) and (got == want).all(), suffix
    with pytest.raises(ValueError, match="takes float32"):
        row_sum_squares_cpu(x.astype(jnp.bfloat16))


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((4, 3))), "takes float32, got x bfloat16"),
    ((jnp.zeros((2, 4)), jnp.zeros((5, 3))), "x has 4 features, w takes 5"),
    ((jnp.zeros((2, 4)), jnp.zeros((4,))), "expected \\[..., K\\] and a matrix"),
])
def test_cpu_matmul_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        matmul_cpu(*args)


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((2, 4)), jnp.zeros((2, 4, PANEL)), 200), "expected \\[4, K, 64\\] for 200"),
    ((jnp.zeros((2, 4)), jnp.zeros((2, 4, PANEL)), 129), "expected \\[3, K, 64\\] for 129"),
    ((jnp.zeros((2, 5)), jnp.zeros((1, 4, PANEL)), 10), "the panels take 4 features"),
    ((jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((1, 4, PANEL)), 10), "takes float32"),
])
def test_cpu_matmul_panels_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        matmul_cpu_panels(*args)
    with pytest.raises(ValueError, match="expected a matrix"):
        pack_panels(jnp.zeros((2, 3, 4)))


def test_auto_matmul_takes_the_cpu_kernel_for_float32_on_the_cpu(monkeypatch, caplog):
    assert resolve_matmul_impl("auto", "cpu", "float32") == "cpu"
    assert resolve_matmul_impl("auto", "cpu", "bfloat16") == "xla"  # the kernel is float32
    assert resolve_matmul_impl("auto", "gpu", "float32") == "xla"
    assert resolve_matmul_impl("xla", "cpu", "float32") == "xla"
    with pytest.raises(ValueError, match="matmul_impl must be one of"):
        resolve_matmul_impl("fast", "cpu", "float32")
    with pytest.raises(ValueError, match="runs on the CPU backend, not 'gpu'"):
        resolve_matmul_impl("cpu", "gpu", "float32")
    with pytest.raises(ValueError, match="computes in float32, not bfloat16"):
        resolve_matmul_impl("cpu", "cpu", "bfloat16")
    monkeypatch.setattr(cpu_library, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level(logging.WARNING):
        assert resolve_matmul_impl("auto", "cpu", "float32") == "xla"
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ValueError, match="cannot be built here: no C\\+\\+ compiler found"):
        resolve_matmul_impl("cpu", "cpu", "float32")
