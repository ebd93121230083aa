"""Paged attention for jaxserve's KV cache: Pallas GPU kernels and their pure-jnp reference twins,
the plain-XLA block walk (`blocked`) and C++ decode and prefill kernels for the CPU
(`cpu_attention`).

This package imports jax only and knows nothing of the engine. The KV layout, shared by kernels
and references, is per layer:

    k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]

Page 0 is the null page: empty slots and padding tokens point at it and their outputs are ignored.
"""

from pallas_kernels.decode import decode_attention
from pallas_kernels.prefill import prefill_attention
from pallas_kernels.reference import decode_attention_ref, prefill_attention_ref

__all__ = [
    "decode_attention",
    "decode_attention_ref",
    "prefill_attention",
    "prefill_attention_ref",
]
