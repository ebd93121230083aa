"""Choosing the backend once, from the platform and the attention_impl / matmul_impl options.

    attention_impl   pallas     the Pallas kernels (Triton on the GPU; the interpreter elsewhere)
                     tpu        JAX's Pallas TPU ragged paged attention (the interpreter off a
                                TPU)
                     cpu        the C++ kernels through XLA's FFI, built on first use
                     reference  plain XLA, the block walk of pallas_kernels/blocked.py
                     auto       pallas on the GPU and tpu on a TPU where the kernels take the
                                shape, cpu on the CPU where the kernels build, reference
                                otherwise
    matmul_impl      cpu        the C++ matmul, float32, batch invariant
                     amx        the same on AMX tiles in three bf16 passes (opt-in: within about
                                1e-5 of float32, not its bits)
                     xla        XLA's dot (any platform and dtype)
                     auto       cpu on the CPU for float32 weights where the kernel builds, else
                                xla

The backend's name says which kernels a platform runs: gpu (Pallas attention), tpu (the TPU
kernel), cpu (any C++ kernel), reference (plain XLA only).
"""

import logging

import jax

from cpu_kernels import library as cpu_library
from jaxserve.backends.base import Attention, Backend, Ops
from jaxserve.backends.cpu import CpuAttention, CpuOps
from jaxserve.backends.gpu import PallasAttention
from jaxserve.backends.tpu import TpuAttention
from pallas_kernels import tpu_attention
from pallas_kernels.decode import kernel_shape_problem

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "pallas", "tpu", "cpu", "reference")
MATMUL_IMPLS = ("auto", "cpu", "amx", "xla")


def resolve_attention_impl(impl: str, platform: str, head_dim: int | None = None,
                           page_size: int | None = None, num_heads: int | None = None,
                           num_kv_heads: int | None = None, dtype: str = "float32") -> str:
    """auto -> pallas on GPU, tpu on a TPU, cpu on the CPU, and reference where the kernels
    cannot take the model's shape (Triton blocks are powers of two; the TPU kernel's pool
    tiles) or the CPU kernel cannot be built; an explicit choice that
    cannot run is a ValueError saying why."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "tpu" or (impl == "auto" and platform == "tpu"):
        tpu_problem = None if head_dim is None else tpu_attention.shape_problem(
            num_heads or 1, num_kv_heads or 1, tpu_attention.lane_padded(head_dim),
            page_size or 1, dtype)  # (a head_dim short of whole lanes is padded: tpu.py)
        if impl == "tpu" and tpu_problem:
            raise ValueError(f"attention_impl='tpu': {tpu_problem}; use "
                             "attention_impl='reference'")
        if tpu_problem:
            log.warning("the TPU attention kernel cannot run this model (%s): using the "
                        "reference attention, which is slower", tpu_problem)
        return "reference" if tpu_problem else "tpu"
    problem = None if head_dim is None else kernel_shape_problem(head_dim, page_size or 1)
    if impl == "pallas" and problem:
        raise ValueError(f"attention_impl='pallas': {problem}; use attention_impl='reference'")
    if impl == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_impl='cpu' runs on the CPU backend, not {platform!r}")
        if reason := cpu_library.unavailable_reason():
            raise ValueError(f"attention_impl='cpu': the kernel cannot be built here: {reason}")
    if impl == "auto" and platform == "cpu":
        if reason := cpu_library.unavailable_reason():
            log.warning("the CPU attention kernel cannot be built (%s): using the reference "
                        "attention, which is slower", reason)
            return "reference"
        return "cpu"
    if impl == "auto":
        if platform == "gpu" and problem:
            log.warning("Pallas attention cannot run this model (%s): using the reference "
                        "attention, which is slower", problem)
        return "pallas" if platform == "gpu" and not problem else "reference"
    return impl


def resolve_matmul_impl(impl: str, platform: str, dtype: str) -> str:
    """auto -> cpu on the CPU for float32 where the kernel builds, else xla; an explicit cpu
    or amx that cannot run is a ValueError saying why."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    if impl == "xla" or (impl == "auto" and (platform != "cpu" or dtype != "float32")):
        return "xla"
    if platform != "cpu":
        raise ValueError(f"matmul_impl={impl!r} runs on the CPU backend, not {platform!r}")
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
    return "amx" if impl == "amx" else "cpu"


def fp8_matmul_capable(compute_capability: str | None) -> bool:
    """Whether an NVIDIA device of this compute capability ("9.0") multiplies fp8 by fp8
    (8.9 on: Ada, Hopper, Blackwell); anything else (an AMD target, None) is taken as not."""
    try:
        major, minor = (int(part) for part in str(compute_capability).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (8, 9)


def is_hopper(compute_capability: str | None) -> bool:
    """Whether an NVIDIA device of this compute capability is a Hopper (9.x: H100, H200), the
    chip JAX's Mosaic GPU grouped matmul is written for."""
    return str(compute_capability).split(".")[0] == "9"


def select_backend(attention_impl: str, matmul_impl: str, dtype: str, head_dim: int,
                   page_size: int, platform: str | None = None, num_heads: int = 1,
                   num_kv_heads: int = 1, device: jax.Device | None = None) -> Backend:
    """The backend for this platform (jax.default_backend() unless given) and options;
    `device`: one the runner's arrays live on (a compile-only target's too), whose chip
    chooses what depends on it (default: this machine's first)."""
    platform = platform or jax.default_backend()
    attention_name = resolve_attention_impl(attention_impl, platform, head_dim, page_size,
                                            num_heads, num_kv_heads, dtype)
    matmul_name = resolve_matmul_impl(matmul_impl, platform, dtype)
    attention = {
        "pallas": PallasAttention(interpret=platform != "gpu"),
        "tpu": TpuAttention(interpret=platform != "tpu"),
        "cpu": CpuAttention(),
        "reference": Attention(),
    }[attention_name]
    # On the GPU XLA's dot is a cuBLAS call that takes its weights as a whole buffer, so under
    # scan each layer's are sliced out of the stack into a copy every step: on an H200 the
    # Llama-3-8B shape's bf16 decode step (2 rows) took 12.8 ms scanned against 5.8 ms
    # unrolled, where compiling it unrolled took no longer (7 s; bench/RESULTS.md)
    capability = getattr(device or jax.devices()[0], "compute_capability", None)
    native_fp8 = platform == "gpu" and fp8_matmul_capable(capability)
    ops = (Ops(scan_layers=platform != "gpu", native_fp8=native_fp8,
               hopper_grouped=platform == "gpu" and is_hopper(capability))
           if matmul_name == "xla"
           else CpuOps(amx=matmul_name == "amx"))
    if attention_name in ("pallas", "tpu"):
        name = {"pallas": "gpu", "tpu": "tpu"}[attention_name]
    elif "cpu" in (attention_name, matmul_name) or matmul_name == "amx":
        name = "cpu"
    else:
        name = "reference"
    return Backend(name, attention, ops)
