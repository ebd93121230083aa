"""Paged attention for the CPU as C++ kernels called through XLA's FFI: decode and prefill.

XLA on the CPU materialises each gather of KV pages before the dot that reads it: the plain-XLA
block walk (`blocked.py`) writes every key and value it gathers and reads it back, about three
times the bytes a decode step needs, and a prefill chunk also scores every query against every
key of each block before masking. `cpu_decode.cc` and `cpu_prefill.cc` read the pages in place,
once, spread over XLA's intra-op threads, and score a query only against the keys it may see.
Same contracts as `reference.decode_attention_ref` and `reference.prefill_attention_ref`,
float32 pages.

Both kernels are compiled into one library on first use with the machine's C++ compiler ($CXX,
else c++ or g++) against the headers jaxlib ships (`jax.ffi.include_dir()`), for this CPU
(-march=native), and cached under $JAXSERVE_CACHE_DIR (default ~/.cache/jaxserve) by a hash of
the sources, the flags, the compiler, jax's version and the CPU. `available()` says whether it
could be built, and why not; callers fall back to the plain-XLA walk then.
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

from pallas_kernels.decode import check_lengths, check_paged_inputs

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "cpu_decode.cc", _HERE / "cpu_prefill.cc")
_HEADERS = (_HERE / "cpu_kernels.h",)
_DECODE = "jaxserve_cpu_decode_attention"
_PREFILL = "jaxserve_cpu_prefill_attention"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


class KernelUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded on this machine (the message says why)."""


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
    sources = [f.read_text() for f in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256("\n".join([
        *sources, " ".join(_FLAGS), version, jax.__version__, _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    path = _cache_dir() / "kernels" / f"cpu_attention-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # same file system: atomic rename
        built = Path(tmp) / path.name
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o",
               str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
        os.replace(built, path)
    return path


@functools.cache
def _register() -> None:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in ((_DECODE, library.JaxserveCpuDecodeAttention),
                           (_PREFILL, library.JaxserveCpuPrefillAttention)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels are built and registered; otherwise why it cannot be."""
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
    on the CPU backend; raises KernelUnavailable where the kernels could not be built."""
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}, expected [slots, num_heads, head_dim]")
    slots, num_heads, head_dim = q.shape
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, slots,
                       kernel=False)
    check_lengths("seq_lens", seq_lens, (slots,))
    return _call(_DECODE, q, k_pages, v_pages, page_table, seq_lens, scale=scale)


def prefill_attention_cpu(
    q: jax.Array,  # [B, C, num_heads, head_dim]   a chunk of C queries per row
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32
    page_table: jax.Array,  # [B, pages_per_seq] int32
    positions: jax.Array,  # [B, C] int32
    seq_lens: jax.Array,  # [B] int32
    scale: float,
) -> jax.Array:  # [B, C, num_heads, head_dim], q's dtype
    """Same contract as `reference.prefill_attention_ref`, where a query at a position past its
    row's `seq_lens` (padding) gives zeros. Runs only on the CPU backend; raises
    KernelUnavailable where the kernels could not be built."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}, expected [batch, chunk, num_heads, head_dim]")
    batch, chunk, num_heads, head_dim = q.shape
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, batch,
                       kernel=False)
    check_lengths("positions", positions, (batch, chunk))
    check_lengths("seq_lens", seq_lens, (batch,))
    return _call(_PREFILL, q, k_pages, v_pages, page_table, positions, seq_lens, scale=scale)


def _call(target: str, q, k_pages, v_pages, *int_args, scale: float) -> jax.Array:
    if k_pages.dtype != jnp.float32:
        raise ValueError(f"the CPU kernels read float32 pages, got {k_pages.dtype}")
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pages, v_pages, *int_args, scale=np.float32(scale))
    return out.astype(q.dtype)
