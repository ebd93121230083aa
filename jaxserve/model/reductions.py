"""Sums over a row that, with the CPU kernels, give the same bits whatever the batch around it.

XLA's CPU reductions sum a row of a [4, n] array differently from a row of a [2, n] one, and
within a large program even a tree of elementwise adds is rewritten and fused so that its
order varies with the shapes around it. With impl "cpu" the sum is the CPU matmul kernel's
product with a column of ones: one chain of additions in index order (cpu_matmul.cc), fixed by
the row alone. Used for RMSNorm and the sampler's (log-)softmax, so that with the CPU matmul
and attention kernels a token's logits and logprobs do not depend on the batch.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_matmul import matmul_cpu, row_sum_squares_cpu


def row_sum(x: jax.Array, impl: str) -> jax.Array:  # [..., n] float32 -> [..., 1]
    """Sum over the last axis; impl "cpu": batch invariant, else XLA's reduction."""
    if impl != "cpu":
        return jnp.sum(x, axis=-1, keepdims=True)
    return matmul_cpu(x, jnp.ones((x.shape[-1], 1), jnp.float32))


def row_sum_squares(x: jax.Array, impl: str) -> jax.Array:  # [..., n] float32 -> [..., 1]
    """row_sum(x * x, impl), to its bits; impl "cpu": one kernel, no array of squares."""
    if impl != "cpu":
        return row_sum(x * x, impl)
    return row_sum_squares_cpu(x)


def log_softmax(x: jax.Array, impl: str) -> jax.Array:  # [..., n] float32
    """jax.nn.log_softmax over the last axis; impl "cpu": its sum by `row_sum` (the max is exact
    anyway)."""
    if impl != "cpu":
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted), impl))


def softmax(x: jax.Array, impl: str) -> jax.Array:  # [..., n] float32
    """jax.nn.softmax over the last axis; impl "cpu": its sum by `row_sum`."""
    if impl != "cpu":
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / row_sum(e, impl)
