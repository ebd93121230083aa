"""jaxserve: an LLM serving engine on JAX/XLA."""

from jaxserve.engine import LLM
from jaxserve.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
