"""LoRA adapters served side by side in one step (S-LoRA and Punica's idea, with JAX's grouped
matmul in place of their kernels).

With LoRA enabled each adaptable linear layer (q, k, v, o, gate, up, down) carries a bank:
A [max_loras, in, rank] and B [max_loras, rank, out] in float32, one slot an adapter, the
scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) folded into B, ranks below max_lora_rank
padded with zeros (which add nothing). A step's tokens each carry their row's adapter slot
(1 .. max_loras; 0: the base model); the layer's output is

    linear(x) + B[s] (A[s] x)

for a token of slot s, computed as two grouped matmuls (`backend.ops.grouped_linear`, the
mixture of experts' own: jax.lax.ragged_dot, or the CPU's batch invariant kernel) over the
step's tokens sorted by slot. Base tokens sort past every group, where the grouped matmul
writes zeros without computing: they add exact zeros, so a base request's output is what the
model without banks gives, and an adapter's token's output depends on its own adapter only
(not on which adapters share its step, nor in which slot its adapter sits). A bank that no
adapter of the step targets (each slot's `active` flag) is skipped whole (jax.lax.cond): a step
of base requests, or of q and v adapters in the other projections, costs no product.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

# the linear layers an adapter may target, by PEFT's module names, and where each sits
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES


class LoraFactor(nnx.Module):
    """One factor of every slot: kernel [max_loras, in, out] (grouped_linear's layout)."""

    def __init__(self, slots: int, n_in: int, n_out: int):
        self.kernel = nnx.Param(jnp.zeros((slots, n_in, n_out), jnp.float32))
        self.out_features = n_out


class LoraBank(nnx.Module):
    """A linear layer's adapters: lora_a [slots, in, rank], lora_b [slots, rank, out]."""

    def __init__(self, slots: int, n_in: int, n_out: int, rank: int):
        self.lora_a = LoraFactor(slots, n_in, rank)
        self.lora_b = LoraFactor(slots, rank, n_out)
        # [slots] int32: 1 where the slot's adapter targets this layer (else its factors are
        # zeros, and a step none of whose adapters targets it skips it)
        self.active = nnx.Param(jnp.zeros((slots,), jnp.int32))

    def __call__(self, x: jax.Array, rows: "LoraRows", backend) -> jax.Array:
        """x [..., in] -> the adapters' part of the output [..., out] (x's dtype); zeros,
        computing nothing, in a step none of whose tokens' adapters targets this layer (the
        base model's tokens: none)."""
        shape = x.shape
        n_out = self.lora_b.kernel[...].shape[-1]  # (this shard's, under tensor parallelism)

        def products():
            flat = x.reshape(-1, shape[-1]).astype(jnp.float32)
            sorted_rows = jnp.take(flat, rows.order, axis=0)
            linear = backend.ops.grouped_linear
            out = linear(self.lora_b, linear(self.lora_a, sorted_rows, rows.sizes), rows.sizes)
            return jnp.take(out, rows.inverse, axis=0).reshape(*shape[:-1], n_out).astype(x.dtype)

        targeted = jnp.take(self.active[...], rows.groups, mode="fill", fill_value=0)
        return jax.lax.cond(jnp.any(targeted > 0), products,
                            lambda: jnp.zeros((*shape[:-1], n_out), x.dtype))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraRows:
    """A step's tokens sorted by adapter slot, computed once a step: `order` [T] (the token
    at each sorted place), `inverse` [T] (each token's sorted place), `sizes` [max_loras]
    (the tokens of slots 1, 2, ...; base tokens sort last, outside every group), `groups`."""

    order: jax.Array
    inverse: jax.Array
    sizes: jax.Array
    groups: jax.Array  # [T] each token's group: its slot - 1, max_loras for the base model

    @staticmethod
    def of(token_slots: jax.Array, max_loras: int) -> "LoraRows":
        """token_slots [T] int32: each token's slot, 0 for the base model."""
        group = jnp.where(token_slots > 0, token_slots - 1, max_loras)
        order = jnp.argsort(group, stable=True).astype(jnp.int32)
        inverse = jnp.zeros_like(order).at[order].set(
            jnp.arange(order.shape[0], dtype=jnp.int32))
        sizes = jnp.bincount(group, length=max_loras + 1)[:max_loras].astype(jnp.int32)
        return LoraRows(order=order, inverse=inverse, sizes=sizes, groups=group)


def adapted(layer, bank: LoraBank | None, x: jax.Array, rows: LoraRows | None,
            backend) -> jax.Array:
    """The linear layer's output, plus its adapters' where the model has banks."""
    y = backend.ops.linear(layer, x)
    if bank is None or rows is None:
        return y
    return y + bank(x, rows, backend)


def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable linear layer of a model config (one device's whole)."""
    e, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (e, cfg.num_heads * d), "k_proj": (e, cfg.num_kv_heads * d),
            "v_proj": (e, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, e),
            "gate_proj": (e, i), "up_proj": (e, i), "down_proj": (i, e)}


def attach_banks(model, max_loras: int, max_rank: int) -> None:
    """Give every layer of `model` (a LlamaForCausalLM, its layers a list) its banks, every
    slot zero. A mixture of experts' MLPs take none."""
    shapes = module_shapes(model.config)
    for layer in model.model.layers:
        # (nnx.data: the attribute was None, static, before)
        layer.self_attn.lora = nnx.data(nnx.Dict({
            name: LoraBank(max_loras, *shapes[name], max_rank) for name in ATTENTION_MODULES}))
        if not model.config.num_experts:
            layer.mlp.lora = nnx.data(nnx.Dict({
                name: LoraBank(max_loras, *shapes[name], max_rank) for name in MLP_MODULES}))
    model.max_loras = max_loras
