"""Tensor parallelism: one model over the devices of a `jax.sharding.Mesh` (axes data, model).

Megatron's split, as vLLM's `--tensor-parallel-size`: q/k/v and the MLP's gate/up split by
columns (each shard its own heads and intermediate columns), o and down by rows (each shard's
partial product summed across the `model` axis: two all-reduces a layer), the embedding table
and the LM head split by vocabulary (a token's row comes from the shard that holds it; each
shard's logits are gathered for sampling). The KV pool is split by KV heads; where there are
fewer KV heads than shards, each head is repeated so every shard holds one, as vLLM does.

Mixture-of-experts layers (model/moe.py) split each expert like a dense MLP (its intermediate
columns over the shards), or with `enable_expert_parallel` (vLLM's name) each shard holds
num_experts / tp whole experts; the router is on every shard.

The model runs once per shard under `jax.shard_map` (model/step.py), on its own part of each
array, so every backend's kernels (the C++ kernels on the CPU, Pallas on the GPU) see plain local
arrays; `Backend.model_axis` tells the model where to sum and gather.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.model import ModelConfig
from jaxserve.model.kv_cache import KVCache

MODEL_AXIS = "model"
# a weight's split by the last part of its name: the mesh axis of each of its trailing dims
# (a stacked layer's leading layer axis is never split)
_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # [in, out]: out split
_ROWS = ("o_proj", "down_proj")  # [in, out]: in split


def check_tensor_parallel(cfg: ModelConfig, tp: int, num_devices: int,
                          expert_parallel: bool = False) -> None:
    """A ValueError naming tensor_parallel_size where the model or the machine cannot take tp."""
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; "
                         f"{num_devices} found")
    if expert_parallel and not cfg.num_experts:
        raise ValueError(f"enable_expert_parallel: the {cfg.architecture} model has no experts")
    if tp == 1:
        return
    splits = [("attention heads", cfg.num_heads), ("vocabulary", cfg.vocab_size)]
    if not cfg.num_experts:
        splits.append(("MLP intermediate size", cfg.intermediate_size))
    elif expert_parallel:
        splits.append(("experts (enable_expert_parallel)", cfg.num_experts))
    else:
        splits.append(("experts' intermediate size", cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        splits.append(("shared expert's intermediate size", cfg.shared_expert_intermediate_size))
    for name, value in splits:
        if value % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {value} "
                             f"{name}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} and the model's {cfg.num_kv_heads} KV "
                         "heads: one must divide the other")
    if cfg.o_bias:
        raise ValueError("tensor_parallel_size > 1 with an o_proj bias is not supported")
    if cfg.quantization_act_order:  # o_proj's and down_proj's inputs would be gathered whole
        raise ValueError("tensor_parallel_size > 1 with a GPTQ act-order (desc_act) checkpoint "
                         "is not supported; data_parallel_size runs it on several devices")
    group = cfg.quantization_group_size
    rows = (("o_proj", cfg.num_heads * cfg.head_dim), ("down_proj", cfg.intermediate_size))
    for name, features in rows if group else ():  # its groups of input rows split whole
        if (features // group) % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {name}'s "
                             f"{features // group} groups of {group} quantised input rows")


def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int:
    return max(cfg.num_kv_heads // tp, 1)


@dataclass(frozen=True)
class Shards:
    """Where the steps' arrays live: the mesh, each weight's PartitionSpec (in the order of the
    state's leaves) and the KV cache's."""

    mesh: Mesh
    weights: list  # [PartitionSpec], one per weight leaf
    kv: KVCache  # the KV cache's spec tree

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def make_mesh(devices) -> Mesh:
    """One replica's mesh: its tensor_parallel_size devices along `model`."""
    return Mesh(np.array(devices).reshape(1, len(devices)), ("data", MODEL_AXIS))


def replica_devices(dp: int, tp: int) -> list[list[jax.Device]]:
    """Data parallelism's device grid [dp, tp], a row per replica (the rows of a mesh with
    axes data and model); a ValueError naming the sizes where the machine has too few."""
    devices = jax.devices()
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs "
                         f"{dp * tp} devices; {len(devices)} found")
    return [devices[i * tp:(i + 1) * tp] for i in range(dp)]


def path_names(path) -> list[str]:
    """A state path's keys as strings (module and variable names, layer indices)."""
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def weight_spec(names: list[str], ndim: int, expert_parallel: bool = False) -> P:
    """The split of the weight at `names` (its path in the state) with `ndim` dims; experts'
    kernels [num_experts, in, out] by expert with `expert_parallel`, else like a dense MLP's."""
    tail: tuple = ()
    # a kernel [in, out], and group-wise scales, zero points and minima [in / group, out], alike
    matrix = any(n in names for n in ("kernel", "group_scale", "group_zero", "group_min"))
    if "lora" in names:  # a LoRA bank (model/lora.py): [slots, in, rank], [slots, rank, out]
        # B split by output columns as its layer's kernel, A by input rows; the rest whole
        if "lora_b" in names and any(n in _COLUMNS for n in names):
            tail = (None, None, MODEL_AXIS)
        elif "lora_a" in names and any(n in _ROWS for n in names):
            tail = (None, MODEL_AXIS, None)
    elif expert_parallel and "experts" in names:
        tail = (MODEL_AXIS, None, None)
    elif any(n in _COLUMNS for n in names):
        tail = (None, MODEL_AXIS) if matrix else (MODEL_AXIS,)
    elif any(n in _ROWS for n in names):
        tail = (MODEL_AXIS, None) if matrix else (None,)
    elif "embed_tokens" in names:  # [vocab, hidden]
        tail = (MODEL_AXIS, None)
    elif "lm_head" in names:  # kernel [hidden, vocab]
        tail = (None, MODEL_AXIS) if "kernel" in names else (MODEL_AXIS,)
    return P(*([None] * (ndim - len(tail)) + list(tail)))


def repeat_heads(names: list[str], x, cfg: ModelConfig, tp: int):
    """Fewer KV heads than shards: k_proj's and v_proj's columns (and biases) of each head
    repeated tp / num_kv_heads times, so shard s holds head s // (tp / num_kv_heads), the one
    its query heads read. Numpy or jax; a weight already repeated is returned as it is."""
    repeats = tp // cfg.num_kv_heads
    if (repeats <= 1 or not any(n in ("k_proj", "v_proj") for n in names)
            or x.shape[-1] != cfg.num_kv_heads * cfg.head_dim
            or ("lora" in names and "lora_b" not in names)):  # (a LoRA bank's B: its columns)
        return x
    heads = x.reshape(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.repeat(heads, repeats, axis=-2).reshape(*x.shape[:-1], -1)


def repeat_kv_heads(state, cfg: ModelConfig, tp: int):
    """repeat_heads over a whole state."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: repeat_heads(path_names(path), x, cfg, tp), state)


@dataclass(frozen=True)
class ShardPlacement:
    """The loader's `place`: where each weight goes (jaxserve/model/loader.py). Called with a
    checkpoint tensor in host memory, it puts it straight onto its shards, each device sent
    only its part; random weights are made on their shards (`transform`, `sharding`). No
    device holds a whole weight first."""

    mesh: Mesh
    cfg: ModelConfig
    tp: int
    expert_parallel: bool = False

    def transform(self, path: tuple, x):  # the model's layout -> the sharded model's
        return repeat_heads([str(p) for p in path], x, self.cfg, self.tp)

    def sharding(self, path: tuple, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, weight_spec([str(p) for p in path], ndim,
                                                    self.expert_parallel))

    def __call__(self, path: tuple, tensor):
        x = self.transform(path, np.asarray(tensor))
        return jax.device_put(x, self.sharding(path, x.ndim))


def shard_state(state, mesh: Mesh, expert_parallel: bool = False,
                put=jax.device_put) -> tuple[object, list]:
    """The state's arrays placed on their shards, and their specs in leaf order (`put`: how
    an array goes to its sharding; compile-only runners place shapes)."""
    specs = []

    def place(path, x):
        spec = weight_spec(path_names(path), x.ndim, expert_parallel)
        specs.append(spec)
        return put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state), specs


def kv_spec(kv: KVCache) -> KVCache:
    """A pool [rows, page_size, kv_heads, head_dim] split by KV heads."""
    return KVCache(pools=tuple(P(None, None, MODEL_AXIS, None) for _ in kv.pools),
                   num_pages=kv.num_pages)
