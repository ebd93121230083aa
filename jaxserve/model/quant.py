"""Weight-only quantisation of the decoder's linear layers: int8, fp8 (float8_e4m3fn), int4.

Each weight [in, out] is stored in the narrow type with one float32 scale per output column
(symmetric, absmax: w ~ q * scale; int8's absmax maps to 127.5, int4's to 7.5, as qwix and
compressed-tensors both do), quantised by Google's JAX quantisation library qwix
(`qwix.quantize`, channelwise over the output axis) as the checkpoint's tensors load, so the
full-precision model is never held whole. The embedding table and the LM head keep the model's
dtype, as vLLM keeps them.

qwix's model rewriting (`quantize_model`, which intercepts the ops a module calls) does not fit
this engine: its linear layers run through the backend seam (`backend.ops.linear`), where a
backend may call a kernel XLA cannot look into, and the weights must keep their state paths for
the tensor-parallel split (jaxserve/parallel/sharding.py). So a `QuantizedLinear` holds the arrays under
those paths, and each backend's `Ops.linear` multiplies by them its own way; called directly,
it is plain XLA through qwix's dot (the dequantisation fused into the matmul).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config.model import QUANTIZATIONS

_QTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn),
           "int4": jnp.dtype(jnp.int4)}
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def array_bytes(shape, dtype) -> int:
    """An array's bytes as an accelerator holds it: int4 and uint4 two to a byte."""
    size = int(np.prod(shape))
    return (size + 1) // 2 if jnp.dtype(dtype) in (jnp.int4, jnp.uint4) else (
        size * jnp.dtype(dtype).itemsize)


def qtype(method: str) -> jnp.dtype:
    if method not in _QTYPES:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
    return _QTYPES[method]


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    import qwix  # here, not at the top: a float model runs where qwix is not installed

    q = qwix.quantize(w.astype(jnp.float32), dtype, channelwise_axes=(1,),
                      scale_dtype=jnp.float32)
    return q.qvalue, q.scale[0]


def quantize_weight(w: jax.Array, method: str) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (the narrow weight [in, out], float32 scales [out]); w ~ q * scale."""
    if w.ndim != 2:
        raise ValueError(f"a linear layer's weight is a matrix [in, out], got {w.shape}")
    return _quantize(w, qtype(method))


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


class QuantizedLinear(nnx.Module):
    """nnx.Linear's surface (kernel [in, out], bias, in/out_features) over a narrow kernel and
    its scales: one per output column (`scale` [out]) or, with `group_size`, one per column
    and group of group_size input rows (`group_scale` [in / group_size, out], a checkpoint's
    group-wise int4: the kernel's rows g * group_size .. are scaled by group_scale[g]; its own
    name, so the tensor-parallel split can tell it from a stack of column scales). With
    `act_order` (GPTQ's desc_act, whose groups' rows lie scattered over the input), the kernel
    holds the rows sorted by group, so its groups are contiguous again, and `input_order` [in]
    the input feature each row multiplies: x is gathered in that order first (`ordered`).
    With `zero_points` (int4 only: AWQ's and GPTQ's asymmetric 4-bit weights) the kernel holds
    the unsigned stored values (uint4) and `zero` [out] (or `group_zero` [in / group_size, out])
    each column's (and group's) zero point, also uint4: w = (kernel - zero) * scale.
    Called directly, the plain XLA product (qwix's dot, which takes either)."""

    def __init__(self, in_features: int, out_features: int, use_bias: bool, dtype,
                 method: str, group_size: int | None = None, act_order: bool = False,
                 zero_points: bool = False, offsets: bool = False,
                 scale_dtype=jnp.float32):
        self.in_features, self.out_features = in_features, out_features
        if zero_points and method != "int4":
            raise ValueError(f"zero points are held for int4 weights, not {method}")
        if offsets and group_size is None:
            raise ValueError("a minimum a group needs group-wise scales")
        narrow = jnp.uint4 if zero_points or (offsets and method == "int4") else qtype(method)
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), narrow))
        if group_size is not None and in_features % group_size:
            raise ValueError(f"quantization group_size {group_size} does not divide a linear "
                             f"layer's {in_features} input features")
        self.scale = (nnx.Param(jnp.ones((out_features,), jnp.float32)) if group_size is None
                      else None)
        self.group_scale = None if group_size is None else nnx.Param(
            jnp.ones((in_features // group_size, out_features), scale_dtype))
        # with `offsets` (GGUF's Q4_1: w = kernel * scale + min) each group's minimum
        self.group_min = nnx.Param(jnp.zeros((in_features // group_size, out_features),
                                             scale_dtype)) if offsets else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.input_order = nnx.Param(jnp.arange(in_features, dtype=jnp.int32)) if (
            act_order) else None
        # named as the scales are (the tensor-parallel split tells them apart by name)
        self.zero = nnx.Param(jnp.zeros((out_features,), jnp.uint4)) if (
            zero_points and group_size is None) else None
        self.group_zero = nnx.Param(jnp.zeros((in_features // group_size, out_features),
                                              jnp.uint4)) if (
            zero_points and group_size is not None) else None
        # the kernel held [out, in] instead (Ops.pack_weights, for an fp8 matmul that reads
        # both operands along the contracted axis, as the GPUs' do)
        self.out_major = False

    def ordered(self, x: jax.Array) -> jax.Array:  # [..., in]: the kernel's rows' order
        return x if self.input_order is None else jnp.take(x, self.input_order[...], axis=-1)

    def scales(self) -> jax.Array:
        """[groups, out]: one group (the column scales) or the group-wise ones."""
        return self.scale[...][None] if self.group_scale is None else self.group_scale[...]

    def zeros(self) -> jax.Array | None:
        """[groups, out] uint4 as scales() (None: symmetric, no zero points)."""
        return self.zero[...][None] if self.zero is not None else (
            None if self.group_zero is None else self.group_zero[...])

    def in_major_kernel(self) -> jax.Array:  # [in, out], however it is held
        return self.kernel[...].T if self.out_major else self.kernel[...]

    def dequantized(self, dtype=jnp.float32) -> jax.Array:  # [in, out]
        scales, zeros = self.scales(), self.zeros()
        kernel = self.in_major_kernel().astype(jnp.float32)
        groups = kernel.reshape(scales.shape[0], -1, kernel.shape[-1])
        if zeros is not None:
            groups = groups - zeros.astype(jnp.float32)[:, None]
        groups = groups * scales.astype(jnp.float32)[:, None]
        if self.group_min is not None:
            groups = groups + self.group_min[...].astype(jnp.float32)[:, None]
        return groups.reshape(kernel.shape).astype(dtype)

    @property
    def takes_fp8_activations(self) -> bool:
        """An fp8 kernel with one scale per column (no groups or zero points): what
        `fp8_product` multiplies."""
        return (self.kernel[...].dtype == jnp.float8_e4m3fn and self.group_scale is None
                and self.zero is None)

    def fp8_product(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out] in x's dtype
        """x's rows scaled into float8_e4m3fn, each row's largest magnitude to e4m3's 448
        (vLLM's dynamic per-token activations), times the fp8 kernel in one fp8 x fp8 dot
        that accumulates in float32, both scales applied to its result: the device's own fp8
        matmul where it has one (NVIDIA compute capability 8.9 on). Each input is off by at
        most 2**-4 of itself (e4m3's 3 mantissa bits), or 2**-10 of its row's scale below
        e4m3's normal range."""
        xs = self.ordered(x).astype(jnp.float32)
        row_scale = jnp.maximum(jnp.max(jnp.abs(xs), axis=-1, keepdims=True), 1e-30) / FP8_MAX
        xq = (xs / row_scale).astype(jnp.float8_e4m3fn)
        y = jax.lax.dot_general(xq, self.kernel[...],
                                (((x.ndim - 1,), (1 if self.out_major else 0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        y = (y * row_scale * self.scale[...]).astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out] in x's dtype
        import qwix

        x = self.ordered(x)
        kernel = self.in_major_kernel()
        weight = qwix.QArray(kernel, self.scales().astype(x.dtype), self.zeros(),
                             qtype=kernel.dtype)
        y = qwix.dot_general(x, weight, (((x.ndim - 1,), (0,)), ((), ())))
        if self.group_min is not None:  # + each group's inputs' sum times its minimum
            minima = self.group_min[...]
            sums = x.reshape(*x.shape[:-1], minima.shape[0], -1).sum(-1, dtype=jnp.float32)
            y = y + (sums @ minima.astype(jnp.float32)).astype(y.dtype)
        return y if self.bias is None else y + self.bias[...]


class QuantizedEmbed(nnx.Module):
    """nnx.Embed's surface (`__call__(ids)`) over a narrow table [vocab, hidden] whose rows are
    scaled in groups of `group_size` columns (`group_scale` [vocab, hidden / group_size]; with
    `offsets` plus a minimum a group, `group_min`): a GGUF file's Q8_0, Q4_0 or Q4_1 token
    embedding as it is stored. A row is dequantised as it is looked up; `table()` gives them
    all (a tied LM head's)."""

    def __init__(self, vocab: int, hidden: int, dtype, method: str, group_size: int,
                 offsets: bool = False, scale_dtype=jnp.float16):
        if hidden % group_size:
            raise ValueError(f"quantization group_size {group_size} does not divide the "
                             f"embedding's {hidden} columns")
        narrow = jnp.uint4 if offsets and method == "int4" else qtype(method)
        self.dtype = dtype
        self.embedding = nnx.Param(jnp.zeros((vocab, hidden), narrow))
        self.group_scale = nnx.Param(jnp.ones((vocab, hidden // group_size), scale_dtype))
        self.group_min = nnx.Param(jnp.zeros((vocab, hidden // group_size), scale_dtype)) if (
            offsets) else None

    def _dequantize(self, q, scale, minimum) -> jax.Array:  # [..., hidden] in self.dtype
        groups = q.astype(jnp.float32).reshape(*q.shape[:-1], scale.shape[-1], -1)
        groups = groups * scale.astype(jnp.float32)[..., None]
        if minimum is not None:
            groups = groups + minimum.astype(jnp.float32)[..., None]
        return groups.reshape(q.shape).astype(self.dtype)

    def rows(self, table_rows: jax.Array) -> jax.Array:
        """[...] indices into this (local) table -> their rows, dequantised."""
        take = lambda p: jnp.take(p[...], table_rows, axis=0)  # noqa: E731
        return self._dequantize(take(self.embedding), take(self.group_scale),
                                None if self.group_min is None else take(self.group_min))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.rows(ids)

    def table(self) -> jax.Array:  # [vocab, hidden] in the model's dtype
        return self._dequantize(self.embedding[...], self.group_scale[...],
                                None if self.group_min is None else self.group_min[...])


def embedding_table(embed) -> jax.Array:
    """An embedding module's table [vocab, hidden] in the model's dtype (nnx.Embed's own)."""
    return embed.table() if isinstance(embed, QuantizedEmbed) else embed.embedding[...]


def embedding_rows(embed, table_rows: jax.Array) -> jax.Array:
    """An embedding module's rows at `table_rows` (indices into its local table)."""
    if isinstance(embed, QuantizedEmbed):
        return embed.rows(table_rows)
    return jnp.take(embed.embedding[...], table_rows, axis=0)
