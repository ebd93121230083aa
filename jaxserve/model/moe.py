"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE) as grouped matmuls.

A token's MLP is the weighted sum of its top-k experts' SwiGLU MLPs. The router scores every
expert (a softmax over its logits, in float32), keeps the k best, renormalises them to sum to
1 where the family does; Qwen2-MoE adds a shared expert every token runs, scaled by a sigmoid
gate.

The experts run as grouped matmuls: the step's (token, expert) pairs sorted by expert, so each
expert's tokens are one contiguous group of rows, and one call multiplies every group by its
expert's weights (`backend.ops.grouped_linear`: `jax.lax.ragged_dot`, on a Hopper GPU JAX's
Mosaic GPU kernel, on the CPU a batch invariant C++ kernel). Each token's k results are gathered back to it and summed in a fixed
order, so its output does not depend on the other tokens of the step.

Under a mesh the experts split one of two ways (jaxserve/parallel/sharding.py): tensor parallelism
inside each expert (its intermediate columns split like a dense MLP's) or expert parallelism
(each shard holds num_experts / shards whole experts). Either way every shard holds every
token (the attention's all-reduce left them there), routes them all the same way, computes the
share its weights give, and one all-reduce sums the shares: no token changes device, so expert
parallelism needs no all-to-all here.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config.model import ModelConfig


class ExpertLinear(nnx.Module):
    """Every expert's linear layer at once: kernel [num_experts, in, out] (no bias)."""

    def __init__(self, num_experts: int, n_in: int, n_out: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (num_experts, n_in, n_out), dtype))
        self.out_features = n_out


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, i, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.gate_proj = ExpertLinear(n, e, i, dtype, rngs)
        self.up_proj = ExpertLinear(n, e, i, dtype, rngs)
        self.down_proj = ExpertLinear(n, i, e, dtype, rngs)


def route(logits: jax.Array, top_k: int, renormalise: bool,
          backend) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int32): the softmax's k
    largest (ties to the lower expert, as torch.topk), renormalised to sum to 1 if asked."""
    probs = backend.ops.softmax(logits.astype(jnp.float32))
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / backend.ops.row_sum(weights)
    return weights, experts.astype(jnp.int32)


def grouped_experts(x: jax.Array, experts: jax.Array, layers: Experts, num_experts: int,
                    backend) -> jax.Array:
    """x [T, H], experts [T, k] -> each (token, choice)'s expert output [T, k, H], computed by
    grouped matmuls over the pairs sorted by expert. Under expert parallelism a shard holds
    experts first .. first + local - 1 (its kernels' leading axis): a pair whose expert it
    lacks sorts past every group, where the grouped matmul writes zeros."""
    t, k = experts.shape
    local = layers.gate_proj.kernel.shape[0]
    flat = experts.reshape(-1)
    if local != num_experts:  # expert parallelism: this shard's experts are 0 .. local - 1
        flat = flat - backend.shard_index() * local
        flat = jnp.where((flat >= 0) & (flat < local), flat, local)
    order = jnp.argsort(flat, stable=True)  # [T * k]: the pairs by expert
    sizes = jnp.bincount(flat, length=local).astype(jnp.int32)  # the overflow group left out
    rows = jnp.take(x, order // k, axis=0)  # [T * k, H]: each pair's token
    linear = backend.ops.grouped_linear
    hidden = (jax.nn.silu(linear(layers.gate_proj, rows, sizes))
              * linear(layers.up_proj, rows, sizes))
    out = linear(layers.down_proj, hidden, sizes)
    # back to (token, choice) order: pair order[j]'s output is out[j]
    return jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)


def dense_experts(x: jax.Array, experts: jax.Array, layers: Experts, num_experts: int,
                  backend) -> jax.Array:
    """grouped_experts' [T, k, H] by a loop over every expert, each run on every token (one
    group holding all rows, the same kernel): the baseline the grouped matmul is measured
    against (bench/moe.py) and a reference for it. One device (no expert parallelism)."""
    t = x.shape[0]
    out = jnp.zeros((*experts.shape, x.shape[-1]), x.dtype)
    linear = backend.ops.grouped_linear
    for e in range(layers.gate_proj.kernel.shape[0]):
        sizes = jnp.zeros(layers.gate_proj.kernel.shape[0], jnp.int32).at[e].set(t)
        hidden = (jax.nn.silu(linear(layers.gate_proj, x, sizes))
                  * linear(layers.up_proj, x, sizes))
        y = linear(layers.down_proj, hidden, sizes)
        out = jnp.where((experts == e)[..., None], y[:, None, :], out)
    return out


class SparseMoeBlock(nnx.Module):
    """The MLP of a mixture-of-experts layer: [B, C, H] -> [B, C, H]. Names as transformers'
    (mlp.gate, mlp.experts, mlp.shared_expert, mlp.shared_expert_gate); the loader maps
    Mixtral's (block_sparse_moe, w1/w3/w2) onto them."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, mlp_class):
        self.gate = nnx.Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, dtype=dtype,
                               param_dtype=dtype, rngs=rngs,
                               kernel_init=nnx.initializers.normal(0.02))
        self.experts = Experts(cfg, dtype, rngs)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = mlp_class(cfg, dtype, rngs, shared) if shared else None
        self.shared_expert_gate = nnx.Linear(
            cfg.hidden_size, 1, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
            kernel_init=nnx.initializers.normal(0.02)) if shared else None
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.renormalise = cfg.norm_topk_prob
        self.dense = False  # bench/moe.py's baseline: dense_experts in place of the grouped

    def __call__(self, x: jax.Array, backend) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        linear = backend.ops.linear
        weights, experts = route(linear(self.gate, x), self.top_k, self.renormalise, backend)
        if self.dense:
            outs = dense_experts(x, experts, self.experts, self.num_experts, backend)
        else:
            outs = grouped_experts(x, experts, self.experts, self.num_experts, backend)
        # each choice's output times its weight, summed over the choices in order (float32)
        parts = outs.astype(jnp.float32) * weights.astype(x.dtype).astype(jnp.float32)[..., None]
        total = parts[:, 0]
        for j in range(1, self.top_k):
            total = total + parts[:, j]
        out = total.astype(x.dtype)
        if self.shared_expert is not None:  # its partial products: one sum with the experts'
            scale = jax.nn.sigmoid(linear(self.shared_expert_gate, x))
            out = out + scale * self.shared_expert.partial(x, backend)
        return backend.sum_shards(out.reshape(shape))
