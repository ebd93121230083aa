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
from pathlib import Path

import jax
import numpy as np

from jaxserve.config.model import ModelConfig
from jaxserve.model.lora_files import LoraAdapter, read_adapter
from jaxserve.request import LoRARequest, Request

log = logging.getLogger("jaxserve")


def bank_leaves(paths: list[tuple]) -> dict[tuple[str, str], list[tuple[int, int | None]]]:
    """The banks among a state's leaves, from each leaf's path (jax.tree_util's keys):
    (module, "lora_a" | "lora_b" | "active") -> [(leaf index, layer)], layer None where the
    layers are stacked (the leaf [num_layers, slots, ...])."""
    found: dict[tuple[str, str], list[tuple[int, int | None]]] = {}
    for index, path in enumerate(paths):
        names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if "lora" not in names:
            continue
        at = names.index("lora")
        module, factor = names[at + 1], names[at + 2]
        after = names[names.index("layers") + 1]
        layer = int(after) if after.isdigit() else None
        found.setdefault((module, factor), []).append((index, layer))
    return found


class LoraSlots:
    """Adapters by name: known (registered), on the host, and in device slots 1..max_loras."""

    def __init__(self, model_config: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_loras: int | None, leaves: dict):
        self.model_config = model_config
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
        for (module, factor), places in self.leaves.items():
            for index, layer in places:
                leaf = leaves[index]
                shape = leaf.shape[2:] if layer is None else leaf.shape[1:]
                layers = range(leaf.shape[0]) if layer is None else [layer]
                if factor == "active":  # whether the adapter targets the layer
                    values = np.array([(i, module) in adapter.weights for i in layers],
                                      np.int32)
                else:
                    part = 0 if factor == "lora_a" else 1
                    values = np.stack([
                        adapter.weights[(i, module)][part] if (i, module) in adapter.weights
                        else np.zeros(shape, np.float32) for i in layers])
                # (committed where the bank is, as the warm-up's: jit keys on it)
                if layer is None:
                    leaves[index] = _set_stacked(leaf, slot,
                                                 jax.device_put(values, leaf.sharding))
                else:
                    leaves[index] = _set(leaf, slot, jax.device_put(values[0], leaf.sharding))
        return leaves

    def commit(self, leaves: list, device) -> list:
        """The leaves with the banks committed to `device`, as a slot write's outputs are
        (jit compiles a function again for committed arguments where it saw uncommitted
        ones: the steps too)."""
        leaves = list(leaves)
        for places in self.leaves.values():
            for index, _ in places:
                leaves[index] = jax.device_put(leaves[index], device)
        return leaves

    def warm(self, leaves: list) -> None:
        """Compile every bank's slot write at start-up (a compile while serving is a bug):
        slot 0 written with what it holds."""
        for places in self.leaves.values():
            for index, layer in places:
                leaf = leaves[index]
                if layer is None:
                    jax.block_until_ready(_set_stacked(leaf, 0, leaf[:, 0]))
                else:
                    jax.block_until_ready(_set(leaf, 0, leaf[0]))


@jax.jit
def _set(leaf, slot, values):  # [slots, ...] at slot
    return leaf.at[slot].set(values)


@jax.jit
def _set_stacked(leaf, slot, values):  # [layers, slots, ...] at [:, slot]
    return leaf.at[:, slot].set(values)

