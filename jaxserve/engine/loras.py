"""The LoRA adapters an engine serves (vLLM's add_lora, remove_lora, list_loras): the names
requests may use, each adapter read and checked once and handed to every replica's runner
(runner/lora_slots.py, which gives it a device slot when a step runs it). An adapter removed
while requests use it stays until they end ("retiring"); the scheduler's stats name the
adapters running and waiting (vLLM's lora_requests_info).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxserve.config.checks import show
from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.request import LoRARequest

if TYPE_CHECKING:
    from jaxserve.core.scheduler import Scheduler
    from jaxserve.model.lora_files import LoraAdapter


class UnknownLoRAError(ValueError):
    """A request names an adapter the engine has not loaded (the server's 404)."""


class Adapters:
    """`schedulers()`: every replica's scheduler (what unfinished requests use)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, runners: list,
                 schedulers: Callable[[], "list[Scheduler]"]):
        self.config, self.model_config = config, model_config
        self.runners, self.schedulers = runners, schedulers
        self.loras: dict[str, LoRARequest] = {}  # the adapters requests may name, by name
        # a request naming an adapter not loaded loads it (vLLM's offline LLM); the server
        # turns it off: its adapters are loaded by name, and an unknown one is a 404
        self.auto_load = True
        self.retiring: set[str] = set()  # removed, and still used by unfinished requests

    def _slots(self) -> list:
        """Every replica's adapters (runner/lora_slots.py)."""
        if not self.config.enable_lora:
            raise ValueError("lora_request: the engine runs without LoRA adapters; start it "
                             "with enable_lora (--enable-lora)")
        return [r.loras for r in self.runners if getattr(r, "loras", None) is not None]

    def check(self, lora: LoRARequest) -> None:
        """A request's adapter: loaded (first, if new and auto_load), as it names it."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {show(lora)}")
        known = self.loras.get(lora.lora_name)
        if known is None and not self.auto_load:
            raise UnknownLoRAError(f"the LoRA adapter {lora.lora_name!r} is not loaded")
        if known is None:
            self.add(lora)
        elif known != lora:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} is loaded as {known}; "
                             "remove it first to load another under its name")

    def read(self, lora: LoRARequest) -> "LoraAdapter":
        """The adapter's weights read and checked against the model (any thread: it touches
        no engine state); a bad one is a ValueError naming what is wrong."""
        from jaxserve.model.lora_files import read_adapter

        self._slots()
        if not lora.lora_path:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: no lora_path")
        return read_adapter(lora.lora_path, self.model_config, self.config.max_lora_rank,
                            lora.lora_name)

    def add(self, lora: LoRARequest, adapter: "LoraAdapter | None" = None) -> bool:
        """Load an adapter (read and checked now, unless `adapter` is read's of it: a
        bad one is a ValueError naming what is wrong); requests name it from then on."""
        slots = self._slots()
        for name, other in self.loras.items():
            if other.lora_int_id == lora.lora_int_id and name != lora.lora_name:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter {name!r}'s")
        if lora.lora_name in self.loras:
            if self.loras[lora.lora_name] == lora:
                return True
            raise ValueError(f"adapter {lora.lora_name!r} is loaded already: remove it first")
        if lora.lora_name in self.retiring:
            raise ValueError(f"adapter {lora.lora_name!r} is being unloaded: requests still "
                             "run with it; load it again once they finish")
        adapter = self.read(lora) if adapter is None else adapter
        for s in slots:
            s.add(lora, adapter)
        self.loras[lora.lora_name] = lora
        self.retiring.discard(lora.lora_name)
        return True

    def remove(self, name: str) -> bool:
        """Unload an adapter: new requests cannot name it; those already queued or running
        with it finish with it, and its weights go once they have. False if unknown."""
        self._slots()
        if self.loras.pop(name, None) is None:
            return False
        self.retiring.add(name)
        self.retire()
        return True

    def retire(self) -> None:
        """Drop the removed adapters no unfinished request uses any more."""
        used = {r.lora_name for s in self.schedulers() for r in s.requests.values()}
        for name in self.retiring - used:
            for s in self._slots():
                s.remove(name)
            self.retiring.discard(name)

    def stats(self) -> dict[str, Any]:
        """The adapters of running requests and of waiting ones that none runs (vLLM's
        lora_requests_info); {} without LoRA."""
        if not self.config.enable_lora:
            return {}
        running = {r.lora_name for s in self.schedulers() for r in s.running}
        waiting = {r.lora_name for s in self.schedulers() for r in s.waiting} - running
        return {"lora_running": sorted(running - {None}), "lora_waiting": sorted(waiting - {None}),
                "max_loras": self.config.max_loras}
