"""The linear layers' matmul; `matmul_impl` picks XLA's dot or the CPU kernel.

    cpu   a C++ kernel through XLA's FFI (pallas_kernels/cpu_matmul.cc), float32: batch
          invariant (a row's result does not depend on the other rows of the step) and faster
          than XLA's dot at a decode step's few rows
    xla   XLA's dot (any backend and dtype; the only one that differentiates, for training)
    auto  cpu on the CPU for float32 weights where the kernel builds, xla otherwise
"""

import logging

import jax
from flax import nnx

from pallas_kernels import cpu_library
from pallas_kernels.cpu_matmul import matmul_cpu

log = logging.getLogger(__name__)

MATMUL_IMPLS = ("auto", "cpu", "xla")


def resolve_matmul_impl(impl: str, backend: str, dtype: str) -> str:
    """auto -> cpu on the CPU for float32 where the kernel builds, else xla; an explicit cpu that
    cannot run is a ValueError saying why."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    if impl == "xla" or (impl == "auto" and (backend != "cpu" or dtype != "float32")):
        return "xla"
    if backend != "cpu":
        raise ValueError(f"matmul_impl='cpu' runs on the CPU backend, not {backend!r}")
    if dtype != "float32":
        raise ValueError(f"matmul_impl='cpu' computes in float32, not {dtype}: pass "
                         "dtype='float32' or matmul_impl='xla'")
    if reason := cpu_library.unavailable_reason():
        if impl == "cpu":
            raise ValueError(f"matmul_impl='cpu': the kernel cannot be built here: {reason}")
        log.warning("the CPU matmul kernel cannot be built (%s): using XLA's dot", reason)
        return "xla"
    return "cpu"


def project(layer: nnx.Linear, x: jax.Array, impl: str) -> jax.Array:
    """layer(x) for x [..., in] -> [..., out], by `impl` ("cpu" | "xla", already resolved)."""
    if impl == "xla":
        return layer(x)
    y = matmul_cpu(x, layer.kernel[...])
    return y if layer.bias is None else y + layer.bias[...]
