"""The C++ kernels for the CPU, called through XLA's FFI: their build, cache and registration.

    cpu_decode.cc, cpu_prefill.cc   paged attention on float32, bfloat16 or float8_e4m3fn
                                    pages (wrapped by attention.py)
    cpu_matmul.cc                   the linear layers' matmul, on float32 weights or int8 /
                                    float8_e4m3fn ones with column scales, and the experts'
                                    grouped matmul (matmul.py)
    cpu_amx.cc                      the same on AMX tiles in three bf16 passes (matmul.py)
    cpu_kernels.h                   what they share

The kernels are compiled into one library on first use with the machine's C++ compiler ($CXX,
else c++ or g++) against the headers jaxlib ships (`jax.ffi.include_dir()`), for this CPU
(-march=native), and cached under $JAXSERVE_CACHE_DIR (default ~/.cache/jaxserve) by a hash of
the sources, the flags, the compiler, jax's version and the CPU. `unavailable_reason()` says
why it could not be built, if it could not; callers fall back to plain XLA then.
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

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "cpu_decode.cc", _HERE / "cpu_prefill.cc", _HERE / "cpu_matmul.cc",
            _HERE / "cpu_amx.cc")
_HEADERS = (_HERE / "cpu_kernels.h",)
SOURCE_FILES = tuple(f.name for f in (*_SOURCES, *_HEADERS))  # what a build reads, by name
# FFI target -> the library's symbol
TARGETS = {
    "jaxserve_cpu_decode_attention": "JaxserveCpuDecodeAttention",
    "jaxserve_cpu_prefill_attention": "JaxserveCpuPrefillAttention",
    "jaxserve_cpu_prefill_attention_ragged": "JaxserveCpuPrefillAttentionRagged",
    # the same three on a bfloat16 pool held as uint16 bits
    "jaxserve_cpu_decode_attention_bf16": "JaxserveCpuDecodeAttentionBf16",
    "jaxserve_cpu_prefill_attention_bf16": "JaxserveCpuPrefillAttentionBf16",
    "jaxserve_cpu_prefill_attention_ragged_bf16": "JaxserveCpuPrefillAttentionRaggedBf16",
    # ... on a float8_e4m3fn pool held as uint8 bytes
    "jaxserve_cpu_decode_attention_fp8": "JaxserveCpuDecodeAttentionFp8",
    "jaxserve_cpu_prefill_attention_fp8": "JaxserveCpuPrefillAttentionFp8",
    "jaxserve_cpu_prefill_attention_ragged_fp8": "JaxserveCpuPrefillAttentionRaggedFp8",
    "jaxserve_cpu_matmul": "JaxserveCpuMatmul",
    "jaxserve_cpu_matmul_transposed": "JaxserveCpuMatmulTransposed",
    "jaxserve_cpu_matmul_panels": "JaxserveCpuMatmulPanels",
    # the in-place and panels ones on an int8 or float8_e4m3fn w (the kernel reads which) and
    # a float32 scale per column
    "jaxserve_cpu_matmul_quantised": "JaxserveCpuMatmulQuantised",
    "jaxserve_cpu_matmul_quantised_panels": "JaxserveCpuMatmulQuantisedPanels",
    # the grouped (ragged) matmul of a mixture-of-experts layer, w [E, K, N] or its panels
    "jaxserve_cpu_matmul_grouped": "JaxserveCpuMatmulGrouped",
    "jaxserve_cpu_matmul_grouped_panels": "JaxserveCpuMatmulGroupedPanels",
    "jaxserve_cpu_row_sum_squares": "JaxserveCpuRowSumSquares",
    "jaxserve_cpu_matmul_amx": "JaxserveCpuMatmulAmx",
}
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


def build(extra_flags: tuple[str, ...] = (), source_dir: Path | None = None) -> Path:
    """The compiled library's path, building it if this machine has none cached. `extra_flags`
    follow the usual ones (the tests build the AVX2 and plain paths with -mno-avx512f ...);
    `source_dir` holds other versions of the same files (bench/cpu_kernel_speed.py --baseline)."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    files = [Path(source_dir or _HERE) / f.name for f in _SOURCES]
    headers = [Path(source_dir or _HERE) / f.name for f in _HEADERS]
    sources = [f.read_text() for f in (*files, *headers)]
    flags = (*_FLAGS, *extra_flags)
    key = hashlib.sha256("\n".join([
        *sources, " ".join(flags), version, jax.__version__, _cpu_signature(),
    ]).encode()).hexdigest()[:16]
    path = _cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # same file system: atomic rename
        built = Path(tmp) / path.name
        cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", *map(str, files), "-o",
               str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
        os.replace(built, path)
    return path


def register(path: Path, suffix: str = "") -> None:
    """Registers the library's kernels as XLA FFI targets (each TARGETS name + `suffix`; a
    library built from older sources may lack some)."""
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in TARGETS.items():
        if hasattr(library, symbol):
            jax.ffi.register_ffi_target(target + suffix,
                                        jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")


@functools.cache
def _register() -> ctypes.CDLL:
    path = build()
    register(path)
    return ctypes.cdll.LoadLibrary(str(path))


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels are built and registered; otherwise why it cannot be."""
    try:
        _register()
    except (KernelUnavailable, OSError) as e:
        return str(e)
    return None


@functools.cache
def amx_ready() -> bool:
    """Whether this machine runs the AMX matmul (cpu_amx.cc): the kernels built, for a CPU
    with AMX-BF16, and the OS granted the process the tile state."""
    if unavailable_reason() is not None:
        return False
    library = _register()
    return hasattr(library, "JaxserveCpuAmxReady") and library.JaxserveCpuAmxReady() == 1


def call(target: str, out: jax.ShapeDtypeStruct, *args, suffix: str = "", **attrs) -> jax.Array:
    """The kernel `target` on `args` (attributes as keywords); raises KernelUnavailable where
    the library could not be built. `suffix` names a library `register`ed by hand."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    return jax.ffi.ffi_call(target + suffix, out, vmap_method="sequential")(*args, **attrs)
