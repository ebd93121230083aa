"""Reductions over a row that give the same bits whatever the batch around the row.

XLA's CPU reduction sums a row of a [4, n] array differently from a row of a [2, n] one, so a
request's norms and logprobs would depend on how many others share its step. These sum by a
halving tree of elementwise adds instead, fixed by the row's length alone. With the CPU kernels
(batch-invariant matmul and attention) they make a token's logits and logprobs independent of
the batch, the chunking of its prompt, and whether it was decoded or prefilled.
"""

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array) -> jax.Array:  # [..., n] -> [..., 1]
    """Sum over the last axis: zero-padded to a power of two, then halved by elementwise adds."""
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(n - 1, 0).bit_length()) - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def log_softmax(x: jax.Array) -> jax.Array:  # [..., n]
    """jax.nn.log_softmax over the last axis, its sum by `row_sum` (the max is exact anyway)."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted)))


def softmax(x: jax.Array) -> jax.Array:  # [..., n]
    """jax.nn.softmax over the last axis, its sum by `row_sum`."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / row_sum(e)
