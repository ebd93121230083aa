"""A pre-quantised checkpoint's tensors as the model holds them: GPTQ's and AWQ's 4- and 8-bit
values packed into int32 words (with their zero points, scales and act-order), compressed-
tensors' packed int4, the scales per channel or group, the narrow kernels checked against the
quantization_config. The loader (loader.py) calls these as it reads each tensor."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.model import ModelConfig

# AutoAWQ packs eight 4-bit values a word in this column order: word bits 4k hold column
# _AWQ_ORDER[k] of the word's eight
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def _unpack_columns(name: str, packed, bits: int, columns: int, awq: bool) -> np.ndarray:
    """[rows, words] int32 -> [rows, columns] int16 of the unsigned values, packed along the
    columns (AWQ: in its column order)."""
    values = unpack_int32(name, packed, jnp.uint8 if bits == 8 else jnp.uint4, columns, 0)
    values = values.astype(np.int16)
    if awq:
        words = values.reshape(values.shape[0], -1, 8)
        values = np.empty_like(words)
        values[:, :, _AWQ_ORDER] = words.reshape(values.shape)
        values = values.reshape(values.shape[0], -1)
    return values


def load_packed(name: str, read: Callable[[], Any], cfg: ModelConfig, expected: dict,
                values: dict, pending: dict, place) -> bool:
    """A GPTQ or AWQ layer's tensors (`read()`: the checkpoint's tensor `name`); False for
    any other. The kernel [in, out] is each
    stored value minus its zero point, scaled by its group's scale:
    qweight int32: GPTQ [in / per_word, out], `bits`-bit unsigned values packed along the input
      rows from the lowest bits; AWQ [in, out / 8], packed along the columns in _AWQ_ORDER;
    qzeros int32 [groups, out / per_word], the zero points packed along the columns (AWQ in its
      order; GPTQ's "gptq" format stores them minus one, as AutoGPTQ wrote them);
    scales [groups, out] (float16): the group-wise scales (one group: a scale per column);
    g_idx [in] (GPTQ) each row's group: contiguous groups, or with act-order (desc_act) any
    order of group_size rows a group: the kernel then holds the rows sorted by group (stable)
    and `input_order` the input feature of each;
    a bias where the model has none must be zeros.
    4-bit weights with zero points (but the "gptq" format's) keep their unsigned values as the
    kernel (uint4) and their zero points apart (`zero` / `group_zero`, uint4); the rest become
    value - zero. A layer's qweight waits in `pending` for its qzeros when the kernel is value -
    zero (symmetric: the zeros only checked to be 2^(bits - 1)) and for its g_idx in
    act-order."""
    stem, _, leaf = name.rpartition(".")
    key = tuple(int(p) if p.isdigit() else p for p in stem.split("."))
    kernel = (*key, "kernel")
    if leaf not in ("qweight", "scales", "qzeros", "g_idx", "bias") or kernel not in expected:
        return False
    if leaf == "bias" and (*key, "bias") in expected:
        return False  # the layer's own bias: loaded as any other
    tensor = np.asarray(read())
    bits, awq = cfg.quantization_bits, cfg.quantization_format == "awq"
    apart = cfg.quantization == "int4" and cfg.quantization_zero_points  # zero points held apart
    rows, columns = expected[kernel].shape
    group = cfg.quantization_group_size or rows
    if leaf == "qweight":
        q = (_unpack_columns(name, tensor, bits, columns, awq) if awq else
             _unpack_columns(name, tensor.T, bits, rows, False).T)
        if q.shape != (rows, columns):
            raise ValueError(f"tensor {name!r} holds {q.shape} values; the model expects "
                             f"{(rows, columns)}")
        pending.setdefault(key, {})["q"] = q
    elif leaf == "qzeros":
        zeros = _unpack_columns(name, tensor, bits, columns, awq)
        if zeros.shape != (rows // group, columns):
            raise ValueError(f"tensor {name!r} holds {zeros.shape} zero points; the model "
                             f"expects {(rows // group, columns)}")
        zeros = zeros + (cfg.quantization_format == "gptq")  # stored minus one
        symmetric = 1 << (bits - 1)
        if apart:
            at = (*key, "group_zero") if (*key, "group_zero") in expected else (*key, "zero")
            zeros = zeros.reshape(expected[at].shape).astype(expected[at].dtype)
            values[at] = jnp.asarray(zeros) if place is None else place(at, zeros)
        elif cfg.quantization_zero_points:
            pending.setdefault(key, {})["z"] = zeros
        elif np.any(zeros != symmetric):
            raise ValueError(f"tensor {name!r} holds zero points other than the symmetric "
                             f"{symmetric}, but the checkpoint says sym true")
    elif leaf == "scales":
        scales = (*key, "group_scale") if (*key, "group_scale") in expected else (*key, "scale")
        if tuple(tensor.shape) != (rows // group, columns):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the "
                             f"checkpoint but the model expects {(rows // group, columns)} "
                             f"(groups of {group} rows x columns)")
        values[scales] = checkpoint_scales(name, tensor.T.astype(np.float32),
                                           expected[scales].shape, place, scales)
    elif leaf == "g_idx" and cfg.quantization_act_order:
        order = _act_order(name, tensor, rows, group)
        pending.setdefault(key, {})["order"] = order
        at = (*key, "input_order")
        values[at] = jnp.asarray(order) if place is None else place(at, order)
    elif leaf == "g_idx":
        if not np.array_equal(tensor, np.arange(rows) // group):
            raise ValueError(f"tensor {name!r}: the rows' groups are not contiguous groups of "
                             f"{group}, but the checkpoint says desc_act false")
    elif np.any(tensor):  # a bias the model does not have
        raise ValueError(f"tensor {name!r}: a non-zero bias the {cfg.architecture} model has "
                         "no place for")
    parts = pending.get(key, {})
    if "q" in parts and ("z" in parts or apart or not cfg.quantization_zero_points) and (
            "order" in parts or not cfg.quantization_act_order):
        q = parts["q"] if "order" not in parts else parts["q"][parts["order"]]
        if not apart:
            zeros = parts.get("z", np.full((1, columns), 1 << (bits - 1), np.int16))
            q = q - np.repeat(zeros, rows // zeros.shape[0], axis=0)
        dtype = expected[kernel].dtype
        values[kernel] = narrow(name, q.astype(dtype), dtype, place, kernel)
        del pending[key]
    return True


def _act_order(name: str, g_idx, rows: int, group: int) -> np.ndarray:
    """An act-order layer's g_idx [in] -> the input rows in group order (stable: within a
    group, as the checkpoint holds them), checked to give each group `group` rows."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    counts = np.bincount(g_idx, minlength=rows // group) if (
        g_idx.shape == (rows,) and g_idx.min(initial=0) >= 0) else None
    if counts is None or counts.shape != (rows // group,) or np.any(counts != group):
        raise ValueError(f"tensor {name!r}: g_idx must give each of the {rows // group} groups "
                         f"{group} of the {rows} input rows, got shape {g_idx.shape}")
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def checkpoint_scales(name: str, tensor, shape: tuple, place, key: tuple) -> jax.Array:
    """A pre-quantised layer's checkpoint scales -> float32 of the model's `shape`: [columns]
    per output channel ([columns, 1] or [columns] in the checkpoint) or one for the whole
    tensor (broadcast); [groups, columns] group-wise ([columns, groups] in the checkpoint)."""
    if len(shape) == 2:
        groups, columns = shape
        if tuple(tensor.shape) != (columns, groups):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}: expected "
                             f"[{columns}, {groups}], a scale per output channel and group")
        scales = np.asarray(tensor, np.float32).T
    else:
        (columns,) = shape
        if tensor.size not in (1, columns) or (tensor.ndim == 2 and tensor.shape[1] != 1):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}: expected one "
                             f"scale per output channel [{columns}, 1] or one per tensor")
        scales = np.broadcast_to(np.asarray(tensor, np.float32).reshape(-1), (columns,))
    return jnp.asarray(scales) if place is None else place(key, np.ascontiguousarray(scales))


def unpack_int32(name: str, packed, dtype, columns: int, offset: int | None = None) -> np.ndarray:
    """Weights packed into int32 words [rows, words] -> [rows, columns] of `dtype` (int4 or
    int8; uint4 or uint8 for the unsigned values): a row's values follow one another in its
    words' bits from the lowest, `bits` each, stored plus `offset` (None: 2^(bits - 1), as
    compressed-tensors' pack-quantized stores them unsigned)."""
    bits = 4 if jnp.dtype(dtype) in (jnp.int4, jnp.uint4) else 8
    offset = 1 << (bits - 1) if offset is None else offset
    packed = np.asarray(packed)
    per_word = 32 // bits
    if packed.dtype != np.int32 or packed.ndim != 2 or packed.shape[1] * per_word < columns:
        raise ValueError(f"tensor {name!r} is {packed.dtype} {tuple(packed.shape)} in the "
                         f"checkpoint: expected int32 words of {per_word} {bits}-bit values "
                         f"holding {columns} columns")
    words = packed.view(np.uint32)[:, :, None] >> (bits * np.arange(per_word, dtype=np.uint32))
    values = (words & ((1 << bits) - 1)).reshape(packed.shape[0], -1)[:, :columns]
    return (values.astype(np.int16) - offset).astype(dtype)


def narrow(name: str, tensor, dtype, place, key: tuple) -> jax.Array:
    """A pre-quantised layer's weights [in, out] as the checkpoint holds them."""
    if tensor.dtype != dtype:
        raise ValueError(f"tensor {name!r} is {tensor.dtype} in the checkpoint, but its "
                         f"quantization_config says {jnp.dtype(dtype).name}")
    return jnp.asarray(tensor) if place is None else place(key, tensor)
