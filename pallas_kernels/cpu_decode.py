"""Paged decode attention for the CPU as a C++ kernel called through XLA's FFI.

XLA on the CPU materialises each gather of KV pages before the dot that reads it: the plain-XLA
block walk (`blocked.py`) writes every key and value it gathers and reads it back, about three
times the bytes a decode step needs. `cpu_decode.cc` reads the pages in place, once, spread over
XLA's intra-op threads. Same contract as `reference.decode_attention_ref`, float32 pages.

The kernel is compiled on first use with the machine's C++ compiler ($CXX, else c++ or g++)
against the headers jaxlib ships (`jax.ffi.include_dir()`), for this CPU (-march=native), and
cached under $JAXSERVE_CACHE_DIR (default ~/.cache/jaxserve) by a hash of the source, the flags,
the compiler, jax's version and the CPU. `available()` says whether it could be built, and why
not; callers fall back to the plain-XLA walk then.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = Path(__file__).with_name("cpu_decode.cc")
_TARGET = "jaxserve_cpu_decode_attention"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


class KernelUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded on this machine (the message says why)."""


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelUnavailable("no C++ compiler found ($CXX, c++, g++ or clang++)")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _cache_dir() -> Path:
    if os.environ.get("JAXSERVE_CACHE_DIR"):
        return Path(os.environ["JAXSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxserve"


def build() -> Path:
    """The compiled library's path, building it if this machine has none cached."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([
        _SOURCE.read_text(), " ".join(_FLAGS), version, jax.__version__, _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    path = _cache_dir() / "kernels" / f"cpu_decode-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # same file system: atomic rename
        built = Path(tmp) / path.name
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
        os.replace(built, path)
    return path


@functools.cache
def _register() -> None:
    library = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.JaxserveCpuDecodeAttention),
                                platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel is built and registered; otherwise why it cannot be."""
    try:
        _register()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None


def available() -> bool:
    return unavailable_reason() is None


def decode_attention_cpu(
    q: jax.Array,  # [S, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32
    page_table: jax.Array,  # [S, pages_per_seq] int32
    seq_lens: jax.Array,  # [S] int32
    scale: float,
) -> jax.Array:  # [S, num_heads, head_dim], q's dtype
    """Same contract as `reference.decode_attention_ref`; empty slots give zeros. Runs only
    on the CPU backend; raises KernelUnavailable where the kernel could not be built."""
    from pallas_kernels.decode import check_paged_inputs

    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}, expected [slots, num_heads, head_dim]")
    slots, num_heads, head_dim = q.shape
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, slots,
                       kernel=False)
    if k_pages.dtype != jnp.float32:
        raise ValueError(f"the CPU kernel reads float32 pages, got {k_pages.dtype}")
    if seq_lens.shape != (slots,) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens is {seq_lens.dtype}{list(seq_lens.shape)}, expected "
                         f"int32[{slots}]")
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pages, v_pages, page_table, seq_lens,
               scale=np.float32(scale))
    return out.astype(q.dtype)
