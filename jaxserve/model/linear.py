"""The linear layers' matmul; `matmul_impl` picks XLA's dot or the CPU kernel.

    cpu   a C++ kernel through XLA's FFI (pallas_kernels/cpu_matmul.cc), float32: batch
          invariant (a row's result does not depend on the other rows of the step) and faster
          than XLA's dot; `pack_weights` stores each kernel as the panels it streams fastest
    amx   the CPU kernel on AMX tiles in three bf16 passes (bf16x3, JAX's Precision.HIGH;
          pallas_kernels/cpu_amx.cc): float32 in and out, within about 1e-5 of the float32
          product but not its bits, batch invariant, faster from about 16 rows on a CPU with
          AMX-BF16 (Sapphire Rapids on); `pack_weights` stores each kernel as its bf16 parts.
          Opt-in: its greedy ids may differ from float32's at near-ties
    xla   XLA's dot (any backend and dtype; the only one that differentiates, for training)
    auto  cpu on the CPU for float32 weights where the kernel builds, xla otherwise
"""

import logging

import jax
from flax import nnx

from pallas_kernels import cpu_library
from pallas_kernels.cpu_matmul import (
    amx_packable,
    matmul_cpu,
    matmul_cpu_amx,
    matmul_cpu_panels,
    pack_amx,
    pack_panels,
)

log = logging.getLogger(__name__)

MATMUL_IMPLS = ("auto", "cpu", "amx", "xla")


def resolve_matmul_impl(impl: str, backend: str, dtype: str) -> str:
    """auto -> cpu on the CPU for float32 where the kernel builds, else xla; amx -> cpu (the
    kernels' other uses, the weights packed by `pack_weights(..., amx=True)`); an explicit cpu
    or amx that cannot run is a ValueError saying why."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    if impl == "xla" or (impl == "auto" and (backend != "cpu" or dtype != "float32")):
        return "xla"
    if backend != "cpu":
        raise ValueError(f"matmul_impl={impl!r} runs on the CPU backend, not {backend!r}")
    if dtype != "float32":
        raise ValueError(f"matmul_impl={impl!r} computes in float32, not {dtype}: pass "
                         "dtype='float32' or matmul_impl='xla'")
    if reason := cpu_library.unavailable_reason():
        if impl != "auto":
            raise ValueError(f"matmul_impl={impl!r}: the kernel cannot be built here: {reason}")
        log.warning("the CPU matmul kernel cannot be built (%s): using XLA's dot", reason)
        return "xla"
    if impl == "amx" and not cpu_library.amx_ready():
        raise ValueError("matmul_impl='amx' needs a CPU with AMX-BF16 and AVX512-BF16 whose OS "
                         "grants the tile state (Linux 5.16 on); this one has not: use 'cpu'")
    return "cpu"


def pack_weights(graphdef: nnx.GraphDef, state: nnx.State, impl: str,
                 amx: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """For impl "cpu": every Linear's kernel [in, out] as panels [ceil(out / 64), in, 64]
    (pack_panels), which the kernel streams from memory in one run (1.1-1.6x the in-place
    layout's speed at a decode step's 2-64 rows, bench/cpu_kernels.py); the same bits. The
    packing happens in `state`'s own variables, one kernel at a time, so each in-place kernel
    is freed as its panels are made (a second copy of a large model's weights would not fit
    where the first one barely does): the state passed in is the packed one afterwards. With
    `amx` (matmul_impl="amx"), a kernel whose input size is a multiple of 32 becomes its bf16
    parts for the AMX kernel instead (`pack_amx`; the same bytes); the others are panels. Other
    impls keep the state as it is."""
    if impl != "cpu":
        return graphdef, state
    model = nnx.merge(graphdef, state)  # shares state's variables
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and module.kernel.get_value().ndim == 2:
            w = module.kernel.get_value()
            module.kernel.set_value(pack_amx(w) if amx and amx_packable(w) else pack_panels(w))
    return nnx.split(model)


def project(layer: nnx.Linear, x: jax.Array, impl: str) -> jax.Array:
    """layer(x) for x [..., in] -> [..., out], by `impl` ("cpu" | "xla", already resolved).
    With "cpu" the kernel may be packed (`pack_weights`: panels, or bf16 parts for AMX) or in
    place."""
    if impl == "xla":
        return layer(x)
    w = layer.kernel[...]
    if w.ndim == 4:
        y = matmul_cpu_amx(x, w, layer.out_features)
    else:
        y = matmul_cpu(x, w) if w.ndim == 2 else matmul_cpu_panels(x, w, layer.out_features)
    return y if layer.bias is None else y + layer.bias[...]
