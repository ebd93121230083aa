"""Paged attention for the CPU as C++ kernels called through XLA's FFI: decode and prefill.

XLA on the CPU materialises each gather of KV pages before the dot that reads it: the plain-XLA
block walk (`blocked.py`) writes every key and value it gathers and reads it back, about three
times the bytes a decode step needs, and a prefill chunk also scores every query against every
key of each block before masking. `cpu_decode.cc` and `cpu_prefill.cc` read the pages in place,
once, spread over XLA's intra-op threads, and score a query only against the keys it may see.
Same contracts as `reference.decode_attention_ref` and `reference.prefill_attention_ref`, on
float32 pages, bfloat16 pages held as their bits in uint16 (`BF16_BITS`; see `bf16_bits` and
`from_bf16_bits`) or float8_e4m3fn pages held as their bytes in uint8 (`FP8_BITS`; `fp8_bits`,
`from_fp8_bits`): XLA on the CPU scatters an integer pool in place (a 64-token write into 4096
pages: 0.04 ms), where a bfloat16 one took 35 ms. The kernels widen each narrow key and value
exactly as they load it, so a narrow pool gives the bits a float32 pool holding the widened
values gives. Built with the other CPU kernels (`library.py`).

Each also takes the reference's two static options, `sliding_window` and `soft_cap` (None: off).
With a window a query's keys are read from its window's first on: the pages wholly before it
are not read at all (the engine may have freed them and pointed their table entries at the
null page), which is also what makes a window cheaper than the whole sequence. The cap is
std::tanh in every path, so a query's bits stay independent of the rest of its call.
"""

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.library import call
from pallas_kernels.decode import check_lengths, check_paged_inputs
from pallas_kernels.reference import check_options

BF16_BITS = jnp.uint16  # a bfloat16 pool's dtype: each element a bfloat16's bits


def bf16_bits(x: jax.Array) -> jax.Array:
    """x rounded to bfloat16 (to nearest even), as the uint16 a BF16_BITS pool holds."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)


def from_bf16_bits(bits: jax.Array) -> jax.Array:
    """A BF16_BITS array's values, widened (exactly) to float32."""
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


FP8_BITS = jnp.uint8  # a float8_e4m3fn pool's dtype: each element a float8_e4m3fn's bits
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value; it has no infinity


def fp8_bits(x: jax.Array) -> jax.Array:
    """x clamped to +-FP8_MAX and rounded to float8_e4m3fn (to nearest even), as the uint8 an
    FP8_BITS pool holds. The clamp keeps large values (and infinities) finite: the cast alone
    gives NaN from 464 on. NaN stays NaN, which the kernels read as +-480 (cpu_kernels.h)."""
    narrow = jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(narrow, FP8_BITS)


def from_fp8_bits(bits: jax.Array) -> jax.Array:
    """An FP8_BITS array's values, widened (exactly) to float32."""
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def decode_attention_cpu(
    q: jax.Array,  # [S, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32 or BF16/FP8_BITS
    v_pages: jax.Array,  # as k_pages
    page_table: jax.Array,  # [S, pages_per_seq] int32
    seq_lens: jax.Array,  # [S] int32
    scale: float,
    library: str = "",  # a suffix given to cpu_library.register (another build)
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [S, num_heads, head_dim], q's dtype
    """Same contract as `reference.decode_attention_ref`; empty slots give zeros, and so does
    a slot whose window lies wholly past its table. Runs only on the CPU backend; raises
    KernelUnavailable where the kernels could not be built."""
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}, expected [slots, num_heads, head_dim]")
    slots, num_heads, head_dim = q.shape
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, slots,
                       kernel=False)
    check_lengths("seq_lens", seq_lens, (slots,))
    return _call("jaxserve_cpu_decode_attention", q, k_pages, v_pages, page_table, seq_lens,
                 scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                 library=library)


def prefill_attention_cpu(
    q: jax.Array,  # [B, C, num_heads, head_dim]   a chunk of C queries per row
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32 or BF16/FP8_BITS
    v_pages: jax.Array,  # as k_pages
    page_table: jax.Array,  # [B, pages_per_seq] int32
    positions: jax.Array,  # [B, C] int32
    seq_lens: jax.Array,  # [B] int32
    scale: float,
    library: str = "",  # a suffix given to cpu_library.register (another build)
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, C, num_heads, head_dim], q's dtype
    """Same contract as `reference.prefill_attention_ref`, where a query at a position past its
    row's `seq_lens` (padding) gives zeros, as does one whose window lies wholly past its
    table. Runs only on the CPU backend; raises KernelUnavailable where the kernels could not
    be built."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}, expected [batch, chunk, num_heads, head_dim]")
    batch, chunk, num_heads, head_dim = q.shape
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, batch,
                       kernel=False)
    check_lengths("positions", positions, (batch, chunk))
    check_lengths("seq_lens", seq_lens, (batch,))
    return _call("jaxserve_cpu_prefill_attention", q, k_pages, v_pages, page_table, positions,
                 seq_lens, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                 library=library)


def prefill_attention_cpu_ragged(
    q: jax.Array,  # [T, num_heads, head_dim]   the rows' chunks one after another, then padding
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim] float32 or BF16/FP8_BITS
    v_pages: jax.Array,  # as k_pages
    page_table: jax.Array,  # [B, pages_per_seq] int32
    positions: jax.Array,  # [T] int32
    query_starts: jax.Array,  # [B + 1] int32   row b's queries: query_starts[b] .. [b + 1] - 1
    seq_lens: jax.Array,  # [B] int32
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], q's dtype
    """prefill_attention_cpu over packed rows (no padding inside a row's chunk): each query
    gives the bits it gives there; tokens past query_starts[B] give zeros. query_starts must be
    nondecreasing and within T (the kernel checks; a violation fails the call)."""
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}, expected [tokens, num_heads, head_dim]")
    tokens, num_heads, head_dim = q.shape
    batch = page_table.shape[0]
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, batch,
                       kernel=False)
    check_lengths("positions", positions, (tokens,))
    check_lengths("query_starts", query_starts, (batch + 1,))
    check_lengths("seq_lens", seq_lens, (batch,))
    return _call("jaxserve_cpu_prefill_attention_ragged", q, k_pages, v_pages, page_table,
                 positions, query_starts, seq_lens, scale=scale, sliding_window=sliding_window,
                 soft_cap=soft_cap)


# a pool dtype -> its kernels' FFI target suffix (library.TARGETS)
_POOL_SUFFIXES = {jnp.dtype(jnp.float32): "", jnp.dtype(BF16_BITS): "_bf16",
                  jnp.dtype(FP8_BITS): "_fp8"}


def _call(target: str, q, k_pages, v_pages, *int_args, scale: float,
          sliding_window: int | None, soft_cap: float | None, library: str = "") -> jax.Array:
    check_options(sliding_window, soft_cap)
    if k_pages.dtype not in _POOL_SUFFIXES or v_pages.dtype != k_pages.dtype:
        raise ValueError("the CPU kernels read float8_e4m3fn pages as uint8 bits, float32 pages "
                         "or bfloat16 ones as uint16 bits, got "
                         f"{k_pages.dtype}/{v_pages.dtype}")
    target += _POOL_SUFFIXES[k_pages.dtype]
    # the options only where set: a call without them is one that a library built before they
    # existed takes too (bench/cpu_kernel_speed.py --baseline)
    options = {}
    if sliding_window is not None:
        options["sliding_window"] = np.int64(sliding_window)
    if soft_cap is not None:
        options["soft_cap"] = np.float32(soft_cap)
    out = call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32), q.astype(jnp.float32),
               k_pages, v_pages, *int_args, scale=np.float32(scale), suffix=library, **options)
    return out.astype(q.dtype)
