"""The compute floor of a workload: the model FLOPs it needs and the machine's matmul rate.

FLOPs count the multiply-adds a decoder must do, nothing an implementation could skip:

    per fed token at context t:  2 * (linear parameters of the layers) + 4 * layers * heads *
                                 head_dim * t (scores and values)
    per sampled token:           2 * hidden * vocab (the LM head)

A request of P prompt and O output tokens feeds P + O - 1 tokens (the last one sampled is never
fed) and samples O. Embedding lookups and norms are not counted.
"""

import time

from jaxserve.config.model import ModelConfig


def workload_flops(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int]) -> float:
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    linear = cfg.num_layers * (attn + 3 * cfg.hidden_size * cfg.intermediate_size)
    per_context = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    head = 2 * cfg.hidden_size * cfg.vocab_size
    total = 0.0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        fed = p + o - 1
        total += 2 * linear * fed + per_context * fed * (fed + 1) / 2 + head * o
    return total


def measure_matmul_flops(m: int = 1024, k: int = 4096, n: int = 4096, repeats: int = 5) -> float:
    """The device's float32 matmul rate (FLOP/s), best of `repeats`, via XLA."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best
