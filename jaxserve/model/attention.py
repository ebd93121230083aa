"""The one call site of paged attention; `attention_impl` picks the kernels or the reference.

    pallas     Pallas kernels (Triton on the GPU; interpret mode elsewhere, for tests)
    cpu        C++ kernels through XLA's FFI (decode and prefill), built on first use
    reference  plain XLA, the block walk of pallas_kernels/blocked.py
    auto       pallas on the GPU where the kernels take the shape, cpu on the CPU where the
               kernel builds, reference otherwise
"""

import logging

import jax

from jaxserve.model.kv_cache import AttentionMetadata, RaggedMetadata
from pallas_kernels import cpu_attention, cpu_library
from pallas_kernels.blocked import decode_attention_blocked, prefill_attention_blocked
from pallas_kernels.decode import kernel_shape_problem

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "pallas", "cpu", "reference")


def resolve_attention_impl(impl: str, backend: str, head_dim: int | None = None,
                           page_size: int | None = None) -> str:
    """auto -> pallas on GPU, cpu on the CPU, and reference where the kernels cannot take the
    model's head_dim or the page_size (Triton blocks are powers of two) or the CPU kernel
    cannot be built; an explicit choice that cannot run is a ValueError saying why."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    problem = None if head_dim is None else kernel_shape_problem(head_dim, page_size or 1)
    if impl == "pallas" and problem:
        raise ValueError(f"attention_impl='pallas': {problem}; use attention_impl='reference'")
    if impl == "cpu":
        if backend != "cpu":
            raise ValueError(f"attention_impl='cpu' runs on the CPU backend, not {backend!r}")
        if reason := cpu_library.unavailable_reason():
            raise ValueError(f"attention_impl='cpu': the kernel cannot be built here: {reason}")
    if impl == "auto" and backend == "cpu":
        if reason := cpu_library.unavailable_reason():
            log.warning("the CPU attention kernel cannot be built (%s): using the reference "
                        "attention, which is slower", reason)
            return "reference"
        return "cpu"
    if impl == "auto":
        if backend == "gpu" and problem:
            log.warning("Pallas attention cannot run this model (%s): using the reference "
                        "attention, which is slower", problem)
        return "pallas" if backend == "gpu" and not problem else "reference"
    return impl


def paged_attention(
    q: jax.Array,  # [B, C, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    md: AttentionMetadata | RaggedMetadata,
    scale: float,
    impl: str,  # "pallas" | "cpu" | "reference" (already resolved)
) -> jax.Array:  # [B, C, num_heads, head_dim]
    if isinstance(md, RaggedMetadata):  # q [1, T, heads, head_dim]
        if impl != "cpu":
            raise ValueError(f"a ragged prefill call runs on the cpu attention, not {impl!r}")
        return cpu_attention.prefill_attention_cpu_ragged(
            q[0], k_pages, v_pages, md.page_table, md.positions[0], md.query_starts, md.seq_lens,
            scale)[None]
    decode = q.shape[1] == 1
    if impl == "cpu" and decode:
        return cpu_attention.decode_attention_cpu(q[:, 0], k_pages, v_pages, md.page_table,
                                                  md.seq_lens, scale)[:, None]
    if impl == "cpu":
        return cpu_attention.prefill_attention_cpu(q, k_pages, v_pages, md.page_table,
                                                   md.positions, md.seq_lens, scale)
    if impl == "reference":  # pure XLA; walks only the pages the longest sequence uses
        if decode:
            return decode_attention_blocked(q[:, 0], k_pages, v_pages, md.page_table,
                                            md.seq_lens, scale)[:, None]
        return prefill_attention_blocked(q, k_pages, v_pages, md.page_table, md.positions,
                                         md.seq_lens, scale=scale)
    from pallas_kernels import decode_attention, prefill_attention

    interpret = jax.default_backend() != "gpu"
    if decode:
        return decode_attention(q[:, 0], k_pages, v_pages, md.page_table, md.seq_lens, scale,
                                interpret=interpret)[:, None]
    return prefill_attention(q, k_pages, v_pages, md.page_table, md.positions, md.seq_lens,
                             scale, interpret=interpret)
