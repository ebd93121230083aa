"""The backend seam: one object, chosen once at start-up from the platform and the options,
owns what differs between platforms (base.py says what). Backends:

    gpu        Pallas attention kernels (gpu.py), XLA's dot
    tpu        JAX's Pallas TPU ragged paged attention (tpu.py), XLA's dot
    cpu        the C++ kernels through XLA's FFI (cpu.py, cpu_kernels/), batch invariant
    reference  plain XLA on any platform (base.py)

Imports the model (the KV pool's layout, the quantised layers), pallas_kernels and cpu_kernels.
Must never import the host side (core, runner, engine, server); the model must never import it
either: the runner hands the model its backend.
"""

from jaxserve.backends.base import REFERENCE, Attention, Backend, Ops
from jaxserve.backends.select import (
    ATTENTION_IMPLS,
    MATMUL_IMPLS,
    resolve_attention_impl,
    resolve_matmul_impl,
    select_backend,
)

__all__ = [
    "ATTENTION_IMPLS",
    "MATMUL_IMPLS",
    "REFERENCE",
    "Attention",
    "Backend",
    "Ops",
    "resolve_attention_impl",
    "resolve_matmul_impl",
    "select_backend",
]
