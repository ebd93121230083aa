"""The linear layers' matmul; `matmul_impl` picks XLA's dot or the CPU kernel.

    cpu   a C++ kernel through XLA's FFI (pallas_kernels/cpu_matmul.cc), float32: batch
          invariant (a row's result does not depend on the other rows of the step) and faster
          than XLA's dot; `pack_weights` stores each kernel as the panels it streams fastest
    xla   XLA's dot (any backend and dtype; the only one that differentiates, for training)
    auto  cpu on the CPU for float32 weights where the kernel builds, xla otherwise
"""

import logging

import jax
from flax import nnx

from pallas_kernels import cpu_library
from pallas_kernels.cpu_matmul import matmul_cpu, matmul_cpu_panels, pack_panels

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


def pack_weights(graphdef: nnx.GraphDef, state: nnx.State,
                 impl: str) -> tuple[nnx.GraphDef, nnx.State]:
    """For impl "cpu": every Linear's kernel [in, out] as panels [ceil(out / 64), in, 64]
    (pack_panels), which the kernel streams from memory in one run (1.1-1.6x the in-place
    layout's speed at a decode step's 2-64 rows, bench/cpu_kernels.py); the same bits. The
    packing happens in `state`'s own variables, one kernel at a time, so each in-place kernel
    is freed as its panels are made (a second copy of a large model's weights would not fit
    where the first one barely does): the state passed in is the packed one afterwards. Other
    impls keep the state as it is."""
    if impl != "cpu":
        return graphdef, state
    model = nnx.merge(graphdef, state)  # shares state's variables
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and module.kernel.get_value().ndim == 2:
            module.kernel.set_value(pack_panels(module.kernel.get_value()))
    return nnx.split(model)


def project(layer: nnx.Linear, x: jax.Array, impl: str) -> jax.Array:
    """layer(x) for x [..., in] -> [..., out], by `impl` ("cpu" | "xla", already resolved).
    With "cpu" the kernel may be packed (`pack_weights`) or in place."""
    if impl == "xla":
        return layer(x)
    w = layer.kernel[...]
    y = matmul_cpu(x, w) if w.ndim == 2 else matmul_cpu_panels(x, w, layer.out_features)
    return y if layer.bias is None else y + layer.bias[...]
