"""The LoRA adapters a runner serves: read once into host memory (at most max_cpu_loras of
them, the least recently used dropped), and the max_loras device slots of the model's banks
(model/lora.py) they take when a step runs them.

Before each step the runner calls `assign` with its chunks: every adapter the step runs gets a
slot, the one it holds or one whose adapter no request of this step uses (the scheduler lets
at most max_loras adapters run at once, so there always is one). Writing a slot makes new bank
arrays (`.at[slot].set`): a step already dispatched keeps reading the old ones.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.model import ModelConfig
from jaxserve.model.lora_files import LoraAdapter, read_adapter
from jaxserve.parallel.sharding import path_names, repeat_heads
from jaxserve.request import LoRARequest, Request

log = logging.getLogger("jaxserve")


@dataclass(frozen=True)
class BankLeaf:
    """A bank's array among the weights' leaves: `index` in the list, its `module`, its
    `factor` ("lora_a", "lora_b" or "active"), its `layer` (None where the layers are stacked:
    the leaf [num_layers, slots, ...]) and its path's `names`."""

    index: int
    module: str
    factor: str
    layer: int | None
    names: tuple[str, ...]


def bank_leaves(paths: list[tuple]) -> list[BankLeaf]:
    """The banks among a state's leaves, from each leaf's path (jax.tree_util's keys)."""
    found = []
    for index, path in enumerate(paths):
        names = path_names(path)
        if "lora" not in names:
            continue
        at = names.index("lora")
        after = names[names.index("layers") + 1]
        found.append(BankLeaf(index, names[at + 1], names[at + 2],
                              int(after) if after.isdigit() else None, tuple(names)))
    return found


class LoraSlots:
    """Adapters by name: known (registered), on the host, and in device slots 1..max_loras."""

    def __init__(self, model_config: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_loras: int | None, leaves: list[BankLeaf], tp: int = 1):
        """`tp`: the tensor-parallel shards the banks are split over (k_proj's and v_proj's
        B with their heads repeated where the model has fewer KV heads, as their kernels)."""
        self.model_config, self.tp = model_config, tp
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.leaves = leaves  # bank_leaves of the runner's weights
        self.known: dict[str, LoRARequest] = {}
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.slots: list[str | None] = [None] * max_loras  # slot i + 1's adapter
        self.used: list[int] = [0] * max_loras  # when each slot last ran (assign's count)
        self._steps = 0

    def add(self, lora: LoRARequest, adapter: LoraAdapter) -> None:
        """Register an adapter with its weights (read_adapter's). The same name again with
        another path or id replaces it."""
        old = self.known.get(lora.lora_name)
        if old is not None:
            self.remove(lora.lora_name)
        self.known[lora.lora_name] = lora
        self._keep(adapter)
        log.info("LoRA adapter %s: rank %d, %s, %.1f MiB", lora.lora_name, adapter.rank,
                 ", ".join(adapter.modules), adapter.nbytes / 2**20)

    def remove(self, name: str) -> bool:
        """Forget an adapter, its slot freed (the engine calls this once no unfinished
        request uses it)."""
        if name not in self.known:
            return False
        del self.known[name]
        self.host.pop(name, None)
        if name in self.slots:
            self.slots[self.slots.index(name)] = None
        return True

    def _keep(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            dropped, _ = self.host.popitem(last=False)
            log.info("LoRA adapter %s: dropped from host memory (max_cpu_loras %d)", dropped,
                     self.max_cpu_loras)

    def slot(self, request: Request) -> int:
        """The request's device slot (assign gave its adapter one); 0: the base model."""
        name = request.lora_name
        return 0 if name is None else self.slots.index(name) + 1

    def assign(self, requests: list[Request], leaves: list) -> list:
        """Give every adapter of a step's requests a slot; returns the weights' leaves (new
        bank arrays where a slot was written)."""
        self._steps += 1
        names = {r.lora_name for r in requests} - {None}
        for name in names:
            if name in self.slots:
                self.used[self.slots.index(name)] = self._steps
        for name in names - set(self.slots):
            free = [i for i, n in enumerate(self.slots) if n not in names]
            if not free:
                raise RuntimeError(f"a step runs {len(names)} LoRA adapters, past max_loras "
                                   f"{self.max_loras}")
            slot = min(free, key=lambda i: (self.slots[i] is not None, self.used[i]))
            leaves = self._write(slot, self._adapter(name), leaves)
            self.slots[slot], self.used[slot] = name, self._steps
        return leaves

    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # dropped from host memory: read again
            lora = self.known.get(name)
            if lora is None:
                raise ValueError(f"LoRA adapter {name!r} is not loaded")
            adapter = read_adapter(Path(lora.lora_path), self.model_config, self.max_rank,
                                   name)
            self._keep(adapter)
        else:
            self.host.move_to_end(name)
        return adapter

    def _write(self, slot: int, adapter: LoraAdapter, leaves: list) -> list:
        """Slot `slot`'s bank entries set to the adapter's (zeros where it has none)."""
        leaves = list(leaves)
        weights = adapter.weights
        for bank in self.leaves:
            leaf, module = leaves[bank.index], bank.module
            layers = range(leaf.shape[0]) if bank.layer is None else [bank.layer]
            if bank.factor == "active":  # whether the adapter targets the layer
                values = np.array([(i, module) in weights for i in layers], np.int32)
            else:
                part = 0 if bank.factor == "lora_a" else 1
                values = np.stack([
                    repeat_heads(list(bank.names), weights[(i, module)][part],
                                 self.model_config, self.tp) if (i, module) in weights
                    else np.zeros(_slot_shape(leaf, bank), np.float32) for i in layers])
            leaves[bank.index] = _place(leaf, bank, slot, values)
        return leaves

    def commit(self, leaves: list, device) -> list:
        """The leaves with the banks committed to `device`, as a slot write's outputs are
        (jit compiles a function again for committed arguments where it saw uncommitted
        ones: the steps too)."""
        leaves = list(leaves)
        for bank in self.leaves:
            leaves[bank.index] = jax.device_put(leaves[bank.index], device)
        return leaves

    def warm(self, leaves: list) -> None:
        """Compile every bank's slot write at start-up (a compile while serving is a bug):
        slot 0 written with what it holds."""
        for bank in self.leaves:
            leaf = leaves[bank.index]
            values = np.asarray(leaf[:, 0] if bank.layer is None else leaf[0:1])
            jax.block_until_ready(_place(leaf, bank, 0, values))


def _slot_shape(leaf, bank: BankLeaf) -> tuple[int, ...]:
    """A slot's shape in one layer (the leaf without its layer and slot axes)."""
    return leaf.shape[2:] if bank.layer is None else leaf.shape[1:]


def _place(leaf, bank: BankLeaf, slot: int, values: np.ndarray):
    """leaf with slot `slot` set to `values` ([layers, ...]: every layer's, or the one
    layer's), sent where the leaf's slot lives (committed, split as the leaf is: the same
    placement every time, or jit would compile again)."""
    sharding = leaf.sharding
    axis = 1 if bank.layer is None else 0  # the slot axis
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (leaf.ndim - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, P(*(spec[:axis] + spec[axis + 1:])))
    if bank.layer is None:
        return _set_stacked(leaf, slot, jax.device_put(values, sharding))
    return _set(leaf, slot, jax.device_put(values[0], sharding))


@jax.jit
def _set(leaf, slot, values):  # [slots, ...] at slot
    return leaf.at[slot].set(values)


@jax.jit
def _set_stacked(leaf, slot, values):  # [layers, slots, ...] at [:, slot]
    return leaf.at[:, slot].set(values)

