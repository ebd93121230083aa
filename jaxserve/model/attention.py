"""The one call site of paged attention; `attention_impl` picks Pallas kernels or the reference."""

import jax

from jaxserve.model.kv_cache import AttentionMetadata
from pallas_kernels.blocked import decode_attention_blocked, prefill_attention_blocked

ATTENTION_IMPLS = ("auto", "pallas", "reference")


def resolve_attention_impl(impl: str, backend: str) -> str:
    """auto -> pallas on GPU, reference elsewhere."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if backend == "gpu" else "reference"
    return impl


def paged_attention(
    q: jax.Array,  # [B, C, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    md: AttentionMetadata,
    scale: float,
    impl: str,  # "pallas" | "reference" (already resolved)
) -> jax.Array:  # [B, C, num_heads, head_dim]
    decode = q.shape[1] == 1
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
