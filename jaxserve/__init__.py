"""jaxserve: an LLM serving engine on JAX/XLA.

`LLM` is imported on first use, so that the host-only parts (`jaxserve.core`, `jaxserve.sim`)
load without jax (DESIGN.md section 1). On a machine with no accelerator attached, jax is asked
for the CPU alone (config/platform.py) unless JAX_PLATFORMS says otherwise.
"""

from jaxserve.config.platform import default_to_cpu

default_to_cpu()  # before jax starts: no accelerator plugin's errors on a machine without one

from jaxserve.request import (  # noqa: E402
    CompletionOutput,
    LoRARequest,
    RequestOutput,
    SamplingParams,
)

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
