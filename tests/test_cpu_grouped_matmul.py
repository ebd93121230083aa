"""The CPU grouped matmul of a mixture-of-experts layer (cpu_kernels/cpu_matmul.cc through
matmul_cpu_grouped): float64 numpy per group is the reference; each row has the bits of
matmul_cpu on that row alone with its expert's w, whatever the other rows and group sizes, in
place and as panels, on every instruction-set path; the sizes are read at run time (negative
ones count as 0, a total past M ends at row M, rows past the total are zero)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.matmul import (
    PANEL,
    matmul_cpu,
    matmul_cpu_grouped,
    matmul_cpu_grouped_panels,
    pack_expert_panels,
    pack_panels,
)

# (K, N): k past the 256-long block (partial sums through the output), columns around the
# 64-column panel (a masked partial panel)
FEATURES = [(17, 15), (300, 130), (513, 65)]
# (M, group sizes): one row; empty groups first, inside and last; a group past the 6-row tile
# and one past the 96-row work item, starting mid-tile
GROUPS = [(1, [1, 0, 0]), (1, [0, 0, 1]), (7, [0, 3, 4]), (13, [5, 0, 6]),
          (120, [3, 100, 17]), (200, [0, 0, 200])]


def _problem(m: int, k: int, n: int, experts: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((experts, k, n)).astype(np.float32)
    return x, w


def _groups(sizes, m: int) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each group, as the kernel reads the sizes: a negative
    one counts as 0, and the groups end at row m."""
    out, row = [], 0
    for e, size in enumerate(sizes):
        end = min(m, row + max(size, 0))
        out.append((e, row, end))
        row = end
    return out


def _float64(x, w, sizes) -> np.ndarray:
    want = np.zeros((x.shape[0], w.shape[2]))
    for e, begin, end in _groups(sizes, x.shape[0]):
        want[begin:end] = x[begin:end].astype(np.float64) @ w[e].astype(np.float64)
    return want


def _rows_alone(x, w, sizes) -> np.ndarray:
    """matmul_cpu on each row alone with its expert's w; zero past the groups."""
    alone = jax.jit(matmul_cpu)
    want = np.zeros((x.shape[0], w.shape[2]), np.float32)
    for e, begin, end in _groups(sizes, x.shape[0]):
        we = jnp.asarray(w[e])
        for r in range(begin, end):
            want[r] = np.asarray(alone(x[r:r + 1], we))[0]
    return want


def _grouped(x, w, sizes, panels: bool, library: str = "") -> np.ndarray:
    sizes = jnp.asarray(sizes, jnp.int32)
    if panels:
        return np.asarray(matmul_cpu_grouped_panels(x, pack_expert_panels(jnp.asarray(w)), sizes,
                                                    w.shape[2], library))
    return np.asarray(matmul_cpu_grouped(x, w, sizes, library))


@pytest.mark.parametrize(("k", "n"), FEATURES)
@pytest.mark.parametrize(("m", "sizes"), GROUPS)
def test_grouped_matmul_equals_float64_per_group(m, sizes, k, n):
    x, w = _problem(m, k, n, len(sizes), seed=m + k)
    got = _grouped(x, w, sizes, panels=False)
    np.testing.assert_allclose(got, _float64(x, w, sizes), rtol=1e-5, atol=2e-5 * np.sqrt(k))


@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize(("k", "n"), FEATURES)
@pytest.mark.parametrize(("m", "sizes"), GROUPS)
def test_a_row_has_the_bits_of_the_matmul_on_it_alone(m, sizes, k, n, panels):
    # whichever rows share the call, whatever the other experts' group sizes, wherever in its
    # group the row sits
    x, w = _problem(m, k, n, len(sizes), seed=m * 7 + n)
    assert (_grouped(x, w, sizes, panels) == _rows_alone(x, w, sizes)).all()


def test_a_row_keeps_its_bits_as_the_groups_around_it_change():
    # one row of expert 1, after `first` rows of expert 0 and `before` others of its own group,
    # `after` more of its group and 3 of expert 2 behind it
    rng = np.random.default_rng(5)
    k, n = 300, 130
    w = rng.standard_normal((3, k, n)).astype(np.float32)
    row = rng.standard_normal((1, k)).astype(np.float32)
    want = np.asarray(matmul_cpu(row, w[1]))[0]
    for first, before, after in ((0, 0, 0), (1, 5, 2), (6, 1, 0), (13, 100, 7), (97, 6, 40)):
        at = first + before
        others = rng.standard_normal((at + after + 3, k)).astype(np.float32)
        x = np.concatenate([others[:at], row, others[at:]])
        sizes = [first, before + 1 + after, 3]
        for panels in (False, True):
            assert (_grouped(x, w, sizes, panels)[at] == want).all(), (first, before, panels)


def test_rows_past_the_groups_are_zero_and_empty_groups_take_none():
    x, w = _problem(30, 70, 90, 4, seed=2)
    for sizes in ([3, 0, 4, 0], [0, 0, 0, 0], [0, 11, 0, 2]):
        total = sum(sizes)
        for panels in (False, True):
            got = _grouped(x, w, sizes, panels)
            assert (got[total:] == 0).all(), (sizes, panels)
            assert (got == _rows_alone(x, w, sizes)).all(), (sizes, panels)


def test_sizes_past_m_end_at_row_m_and_negative_ones_count_as_zero():
    x, w = _problem(10, 40, 20, 4, seed=3)
    cases = {  # sizes -> the sizes they mean for M = 10
        (4, 9, 3, 2): [4, 6, 0, 0],
        (-3, 5, -1, 8): [0, 5, 0, 5],
        (12, 1, 0, 0): [10, 0, 0, 0],
        (2**31 - 1, 2**31 - 1, 1, 1): [10, 0, 0, 0],  # no overflow of the running total
    }
    for sizes, meant in cases.items():
        want = _grouped(x, w, meant, panels=False)
        assert (want == _rows_alone(x, w, meant)).all()
        for panels in (False, True):
            assert (_grouped(x, w, list(sizes), panels) == want).all(), (sizes, panels)


def test_empty_shapes():
    w = np.ones((2, 5, 3), np.float32)
    assert _grouped(np.ones((0, 5), np.float32), w, [0, 0], panels=False).shape == (0, 3)
    got = _grouped(np.ones((4, 0), np.float32), np.ones((2, 0, 3), np.float32), [1, 2], False)
    assert got.shape == (4, 3) and (got == 0).all()  # K = 0: empty sums
    got = _grouped(np.ones((4, 5), np.float32), np.ones((0, 5, 3), np.float32), [], False)
    assert got.shape == (4, 3) and (got == 0).all()  # no experts: no groups
    assert _grouped(np.ones((4, 5), np.float32), np.ones((2, 5, 0), np.float32), [2, 2],
                    False).shape == (4, 0)


def test_in_jit_with_sizes_computed_there():
    # a mixture-of-experts layer's way: each token's expert chosen in the step, the tokens
    # sorted by expert and counted, all inside one jitted function
    experts, k, n = 4, 300, 70
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((23, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((experts, k, n)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((k, experts)), jnp.float32)

    def step(x, w, panels, use_panels: bool):
        choice = jnp.argmax(x @ router, axis=-1)
        order = jnp.argsort(choice, stable=True)
        sizes = jnp.bincount(choice, length=experts).astype(jnp.int32)
        if use_panels:
            out = matmul_cpu_grouped_panels(x[order], panels, sizes, n)
        else:
            out = matmul_cpu_grouped(x[order], w, sizes)
        return out, order, sizes

    step = jax.jit(step, static_argnums=3)
    panels = pack_expert_panels(w)
    got, order, sizes = step(x, w, panels, False)
    got_panels, _, _ = step(x, w, panels, True)
    sorted_x, sizes = np.asarray(x)[np.asarray(order)], np.asarray(sizes).tolist()
    assert sum(sizes) == 23 and sum(s > 0 for s in sizes) > 1  # rows for several experts
    want = _rows_alone(sorted_x, np.asarray(w), sizes)
    assert (np.asarray(got) == want).all() and (np.asarray(got_panels) == want).all()
    ragged = jax.lax.ragged_dot(jnp.asarray(sorted_x), w, jnp.asarray(sizes, jnp.int32),
                                precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ragged), rtol=1e-5,
                               atol=2e-5 * np.sqrt(k))


def test_every_instruction_set_path_gives_the_same_bits(other_paths):
    x, w = _problem(13, 300, 130, 3, seed=13)
    sizes = [5, 0, 7]
    want = _rows_alone(x, w, sizes)
    for suffix in other_paths:
        for panels in (False, True):
            assert (_grouped(x, w, sizes, panels, suffix) == want).all(), (suffix, panels)


def test_pack_expert_panels_packs_each_expert():
    w = jnp.arange(2 * 3 * 70, dtype=jnp.float32).reshape(2, 3, 70)
    packed = np.asarray(pack_expert_panels(w))
    assert packed.shape == (2, 2, 3, PANEL)
    for e in range(2):
        assert (packed[e] == np.asarray(pack_panels(w[e]))).all()
    with pytest.raises(ValueError, match="expected a stack of matrices \\[E, K, N\\]"):
        pack_expert_panels(jnp.zeros((3, 4)))


SIZES = jnp.zeros((2,), jnp.int32)


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((2, 4, 3)), SIZES),
     "takes float32, got x bfloat16"),
    ((jnp.zeros((2, 4)), jnp.zeros((2, 4, 3), jnp.bfloat16), SIZES), "and w bfloat16"),
    ((jnp.zeros((2, 4)), jnp.zeros((2, 5, 3)), SIZES), "x has 4 features, w takes 5"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3)), SIZES), "expected \\[M, K\\] and \\[E, K, N\\]"),
    ((jnp.zeros((1, 2, 4)), jnp.zeros((2, 4, 3)), SIZES), "expected \\[M, K\\] and"),
    ((jnp.zeros((2, 4)), jnp.zeros((3, 4, 3)), SIZES),
     "group_sizes is int32\\[2\\]: expected int32\\[3\\]"),
    ((jnp.zeros((2, 4)), jnp.zeros((2, 4, 3)), jnp.zeros((2,))),
     "group_sizes is float32\\[2\\]: expected int32\\[2\\]"),
])
def test_grouped_matmul_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        matmul_cpu_grouped(*args)


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((2, 4)), jnp.zeros((2, 4, 4, PANEL)), SIZES, 300),
     "expected \\[E, 5, K, 64\\] for 300 columns"),
    ((jnp.zeros((2, 4)), jnp.zeros((2, 2, 4, PANEL)), SIZES, 129),
     "expected \\[E, 3, K, 64\\] for 129"),
    ((jnp.zeros((2, 4)), jnp.zeros((1, 4, PANEL)), SIZES, 10), "expected \\[E, 1, K, 64\\]"),
    ((jnp.zeros((2, 5)), jnp.zeros((2, 1, 4, PANEL)), SIZES, 10),
     "x has shape \\(2, 5\\): expected \\[M, 4\\]"),
    ((jnp.zeros((2, 4)), jnp.zeros((3, 1, 4, PANEL)), SIZES, 10), "expected int32\\[3\\]"),
    ((jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((2, 1, 4, PANEL)), SIZES, 10),
     "takes float32"),
])
def test_grouped_matmul_panels_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        matmul_cpu_grouped_panels(*args)
