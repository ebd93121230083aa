"""The linear layers' matmul for the CPU as a C++ kernel called through XLA's FFI.

Batch invariant: each output element is one chain of fused multiply-adds over k in order, so a
row's result does not depend on the other rows of the call or on their number (XLA's CPU dot
sums a row differently for different M). It is also faster than XLA's dot for the few rows of a
decode step (`cpu_matmul.cc`). Built with the other CPU kernels (`library.py`).

A weight the engine multiplies by every step is stored packed (`pack_panels`): panels of 64
columns, each a contiguous [K, 64] block, which the kernel streams from memory in one run; the
in-place layout reads rows of w N floats apart. Both give the same bits.

Weight-only quantisation: an int8 or float8_e4m3fn w with a float32 scale per column
(`matmul_cpu_quant`, in place or packed by the same `pack_panels`), widened to float32 in the
kernel as it is loaded. A decode step's few rows read the weights at memory speed, and these
are a quarter of float32's bytes.

A mixture-of-experts layer's grouped matmul (`matmul_cpu_grouped`, jax.lax.ragged_dot's
meaning): the rows sorted by expert, each group times its expert's w, a row's bits those of
`matmul_cpu` on that row alone with that w.
"""

import math

import jax
import jax.numpy as jnp

from cpu_kernels.library import call

PANEL = 64  # columns per packed panel (cpu_matmul.cc's kNC)
QUANTISED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # matmul_cpu_quant's w types


def matmul_cpu(
    x: jax.Array,  # [..., K] float32
    w: jax.Array,  # [K, N] float32, or [N, K] with transposed=True
    transposed: bool = False,
    library: str = "",  # a suffix given to cpu_library.register (the tests' other builds)
) -> jax.Array:  # [..., N] float32
    """x @ w (x @ w.T when `transposed`), over x's last axis. Runs only on the CPU backend;
    raises KernelUnavailable where the kernels could not be built."""
    _check_float32(x, w)
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"x has shape {x.shape} and w {w.shape}: expected [..., K] and a "
                         "matrix")
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, w takes {k} (w {w.shape}, "
                         f"transposed={transposed})")
    target = "jaxserve_cpu_matmul_transposed" if transposed else "jaxserve_cpu_matmul"
    return _call_on_rows(target, x, (w,), n, library)


def pack_panels(w: jax.Array) -> jax.Array:  # [K, N] -> [ceil(N / PANEL), K, PANEL]
    """w's columns in panels of PANEL (the last one zero-padded), for `matmul_cpu_panels` (or,
    of an int8 or float8_e4m3fn w, for `matmul_cpu_quant_panels`)."""
    if w.ndim != 2:
        raise ValueError(f"w has shape {w.shape}: expected a matrix [K, N]")
    k, n = w.shape
    panels = -(-n // PANEL)
    padded = jnp.pad(w, ((0, 0), (0, panels * PANEL - n)))
    return padded.reshape(k, panels, PANEL).transpose(1, 0, 2)


def matmul_cpu_panels(
    x: jax.Array,  # [..., K] float32
    panels: jax.Array,  # [ceil(N / PANEL), K, PANEL] float32, from pack_panels
    n: int,  # w's columns
    library: str = "",
) -> jax.Array:  # [..., N] float32
    """x @ w for w given as `pack_panels(w)`: the same bits as `matmul_cpu(x, w)`."""
    _check_float32(x, panels)
    _check_panels(x, panels, n)
    return _call_on_rows("jaxserve_cpu_matmul_panels", x, (panels,), n, library)


def matmul_cpu_quant(
    x: jax.Array,  # [..., K] float32
    w: jax.Array,  # [K, N] int8 or float8_e4m3fn
    scale: jax.Array,  # [N] float32: the weight's column j is w[:, j] * scale[j]
    library: str = "",
) -> jax.Array:  # [..., N] float32
    """(x @ w) * scale, w widened to float32 (exactly) in the kernel: each element is the chain
    `matmul_cpu` runs on float32(w), then one multiply by its column's scale, so a row's bits do
    not depend on the other rows either. e4m3fn's NaN bytes read as +-480 (no weight is NaN)."""
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"x has shape {x.shape} and w {w.shape}: expected [..., K] and a "
                         "matrix")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, w takes {k} (w {w.shape})")
    _check_quantised(x, w, scale, n)
    return _call_on_rows("jaxserve_cpu_matmul_quantised", x, (w, scale), n, library)


def matmul_cpu_quant_panels(
    x: jax.Array,  # [..., K] float32
    panels: jax.Array,  # [ceil(N / PANEL), K, PANEL] int8 or float8_e4m3fn, pack_panels(w)
    scale: jax.Array,  # [N] float32
    n: int,  # w's columns
    library: str = "",
) -> jax.Array:  # [..., N] float32
    """(x @ w) * scale for w given as `pack_panels(w)`: the same bits as
    `matmul_cpu_quant(x, w, scale)`."""
    _check_panels(x, panels, n)
    _check_quantised(x, panels, scale, n)
    return _call_on_rows("jaxserve_cpu_matmul_quantised_panels", x, (panels, scale), n, library)


def matmul_cpu_grouped(
    x: jax.Array,  # [M, K] float32, rows sorted by expert
    w: jax.Array,  # [E, K, N] float32
    group_sizes: jax.Array,  # [E] int32: expert e's rows follow those of experts 0 .. e-1
    library: str = "",
) -> jax.Array:  # [M, N] float32
    """jax.lax.ragged_dot(x, w, group_sizes): rows 0 .. g0-1 times w[0], the next g1 rows times
    w[1], and so on; rows past the groups are zero. The sizes are read at run time: a negative
    one counts as 0, and a total past M ends the groups at row M. Each row has the bits of
    `matmul_cpu(row, w[e])` alone, whatever the other rows and groups."""
    _check_float32(x, w)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x has shape {x.shape} and w {w.shape}: expected [M, K] and "
                         "[E, K, N]")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features, w takes {w.shape[1]} (w {w.shape})")
    _check_group_sizes(group_sizes, w.shape[0])
    return call("jaxserve_cpu_matmul_grouped",
                jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32), x, w, group_sizes,
                suffix=library)


def pack_expert_panels(w: jax.Array) -> jax.Array:  # [E, K, N] -> [E, ceil(N / PANEL), K, PANEL]
    """`pack_panels` of each expert's w, for `matmul_cpu_grouped_panels`."""
    if w.ndim != 3:
        raise ValueError(f"w has shape {w.shape}: expected a stack of matrices [E, K, N]")
    return jax.vmap(pack_panels)(w)


def matmul_cpu_grouped_panels(
    x: jax.Array,  # [M, K] float32, rows sorted by expert
    panels: jax.Array,  # [E, ceil(N / PANEL), K, PANEL] float32, from pack_expert_panels
    group_sizes: jax.Array,  # [E] int32
    n: int,  # w's columns
    library: str = "",
) -> jax.Array:  # [M, N] float32
    """`matmul_cpu_grouped(x, w, group_sizes)` for w given as `pack_expert_panels(w)`: the same
    bits."""
    _check_float32(x, panels)
    blocks = -(-n // PANEL)
    if panels.ndim != 4 or panels.shape[1] != blocks or panels.shape[3] != PANEL:
        raise ValueError(f"panels have shape {panels.shape}: expected [E, {blocks}, K, {PANEL}] "
                         f"for {n} columns (pack_expert_panels)")
    if x.ndim != 2 or x.shape[1] != panels.shape[2]:
        raise ValueError(f"x has shape {x.shape}: expected [M, {panels.shape[2]}], the panels' "
                         "features")
    _check_group_sizes(group_sizes, panels.shape[0])
    return call("jaxserve_cpu_matmul_grouped_panels",
                jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), x, panels, group_sizes,
                suffix=library)


AMX_BLOCK = 16  # columns per block of pack_amx (cpu_amx.cc)
AMX_K = 32  # k per tile product: K must be a multiple


def amx_packable(w: jax.Array) -> bool:
    """Whether `pack_amx` takes w [K, N]: K a multiple of AMX_K."""
    return w.ndim == 2 and w.shape[0] % AMX_K == 0 and w.shape[0] > 0


def pack_amx(w: jax.Array) -> jax.Array:  # [K, N] float32 -> [2, ceil(N / 16), K / 2, 32] bf16
    """w's high and low bf16 parts (w = hi + lo to 2^-17) in the pair layout the AMX tile
    product reads (cpu_amx.cc), columns in blocks of AMX_BLOCK, zero past N."""
    if not amx_packable(w) or w.dtype != jnp.float32:
        raise ValueError(f"pack_amx takes float32 [K, N] with K a multiple of {AMX_K}, got "
                         f"{w.dtype}{list(w.shape)}")
    k, n = w.shape
    blocks = -(-n // AMX_BLOCK)
    padded = jnp.pad(w, ((0, 0), (0, blocks * AMX_BLOCK - n)))
    hi = padded.astype(jnp.bfloat16)
    lo = (padded - hi.astype(jnp.float32)).astype(jnp.bfloat16)

    def pairs(part):  # [K, blocks * 16] -> [blocks, K / 2, 32]: (w[2r, c], w[2r + 1, c]) per c
        return (part.reshape(k // 2, 2, blocks, AMX_BLOCK).transpose(2, 0, 3, 1)
                .reshape(blocks, k // 2, 2 * AMX_BLOCK))

    return jnp.stack([pairs(hi), pairs(lo)])


def matmul_cpu_amx(
    x: jax.Array,  # [..., K] float32
    packed: jax.Array,  # [2, ceil(N / 16), K / 2, 32] bfloat16, from pack_amx
    n: int,  # w's columns
    library: str = "",
) -> jax.Array:  # [..., N] float32
    """x @ w on AMX tiles in three bf16 passes (Precision.HIGH): within about 1e-5 of the
    float32 product, batch invariant, not matmul_cpu's bits. Needs `cpu_library.amx_ready()`."""
    if x.dtype != jnp.float32 or packed.dtype != jnp.bfloat16:
        raise ValueError(f"the AMX matmul takes float32 x and bf16 parts, got {x.dtype} and "
                         f"{packed.dtype}")
    blocks = -(-n // AMX_BLOCK)
    if packed.ndim != 4 or packed.shape[0] != 2 or packed.shape[1] != blocks or \
            packed.shape[3] != 2 * AMX_BLOCK:
        raise ValueError(f"packed has shape {packed.shape}: expected [2, {blocks}, K / 2, "
                         f"{2 * AMX_BLOCK}] for {n} columns (pack_amx)")
    k = 2 * packed.shape[2]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {x.shape}, the packed weight takes {k} features")
    return _call_on_rows("jaxserve_cpu_matmul_amx", x, (packed,), n, library)


def row_sum_squares_cpu(x: jax.Array, library: str = "") -> jax.Array:  # [..., K] -> [..., 1]
    """sum(x * x) over the last axis, to the bits of matmul_cpu(x * x, ones [K, 1]) (one chain
    of adds in index order), without the array of squares."""
    if x.dtype != jnp.float32 or x.ndim < 1:
        raise ValueError(f"the CPU row sum takes float32 [..., K], got {x.dtype}{list(x.shape)}")
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = call("jaxserve_cpu_row_sum_squares", jax.ShapeDtypeStruct((rows.shape[0], 1),
                                                                    jnp.float32), rows,
               suffix=library)
    return out.reshape(*x.shape[:-1], 1)


def _check_float32(x: jax.Array, w: jax.Array) -> None:
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"the CPU matmul takes float32, got x {x.dtype} and w {w.dtype}")


def _check_group_sizes(group_sizes: jax.Array, experts: int) -> None:
    if group_sizes.dtype != jnp.int32 or group_sizes.shape != (experts,):
        raise ValueError(f"group_sizes is {group_sizes.dtype}{list(group_sizes.shape)}: "
                         f"expected int32[{experts}], one size per expert of w")


def _check_quantised(x: jax.Array, w: jax.Array, scale: jax.Array, n: int) -> None:
    if x.dtype != jnp.float32 or w.dtype not in QUANTISED or scale.dtype != jnp.float32:
        raise ValueError("the CPU quantised matmul takes float32 x, int8 or float8_e4m3fn w and "
                         f"float32 scale, got x {x.dtype}, w {w.dtype} and scale {scale.dtype}")
    if scale.shape != (n,):
        raise ValueError(f"scale has shape {scale.shape}: expected [{n}], one per column of w")


def _check_panels(x: jax.Array, panels: jax.Array, n: int) -> None:
    if panels.ndim != 3 or panels.shape[2] != PANEL or panels.shape[0] != -(-n // PANEL):
        raise ValueError(f"panels have shape {panels.shape}: expected "
                         f"[{-(-n // PANEL)}, K, {PANEL}] for {n} columns (pack_panels)")
    k = panels.shape[1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {x.shape}, the panels take {k} features")


def _call_on_rows(target: str, x: jax.Array, weights: tuple[jax.Array, ...], n: int,
                  library: str) -> jax.Array:
    """The kernel on x's leading axes flattened to rows and `weights` (w, and its scale where
    it has one): [..., K] -> [..., n]."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = call(target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32), rows, *weights,
               suffix=library)
    return out.reshape(*x.shape[:-1], n)
