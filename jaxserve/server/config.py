"""The server's settings: config-file keys and `jaxserve serve` flags."""

from dataclasses import dataclass

from jaxserve.config.checks import is_finite, is_int, show
from jaxserve.request import LoRARequest
from jaxserve.text.reasoning import check_parser
from jaxserve.text.tool_parsers import get_parser


@dataclass(frozen=True)
class ServerConfig:
    """Server settings; the field names are config-file keys and `jaxserve serve` flags.

    `max_waiting_requests` and `request_timeout_s` are enforced by the AsyncEngine, which
    `serve` builds with them (they are not engine options: `LLM.generate` has no use for them).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no key; else /v1/* need "Authorization: Bearer KEY"
    served_model_name: str | None = None  # None: the MODEL argument
    # more waiting requests get 429; None: as many as the KV pool has pages (AsyncEngine)
    max_waiting_requests: int | None = None
    max_seqs_per_request: int = 4096  # prompts x n of one request; more: 400, nothing queued
    request_timeout_s: float | None = None  # unfinished this long after arrival: aborted, 504
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    shutdown_grace_s: float = 30.0  # on SIGTERM/SIGINT, in-flight requests get this long
    stall_timeout_s: float = 60.0  # work waiting this long with no engine iteration: /health 503
    header_timeout_s: float = 10.0  # request line and headers must arrive within this: else 408
    body_timeout_s: float = 60.0  # the whole request body must arrive within this: else 408
    max_connections: int = 1000  # open connections; one more is answered 503 and closed
    max_concurrent_requests: int = 1000  # /v1 requests in flight; one more is a 503
    # usage.prompt_tokens_details.cached_tokens (the prompt tokens found in the prefix cache)
    # in every response; off: null, as vLLM's --enable-prompt-tokens-details
    enable_prompt_tokens_details: bool = False
    # a reasoning model's <think>...</think> as message.reasoning_content (vLLM's
    # --reasoning-parser): qwen3 or deepseek_r1 (jaxserve/text/reasoning.py); None: all content
    reasoning_parser: str | None = None
    # tool_choice "auto" (and tools sent without a tool_choice): the answer's calls read by
    # tool_call_parser (hermes, llama3_json, mistral or pythonic: jaxserve/text/tool_parsers.py),
    # as vLLM's --enable-auto-tool-choice --tool-call-parser; off: such requests get a 400
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # LoRA adapters loaded at start-up, each NAME=PATH (a PEFT directory), as vLLM's
    # --lora-modules; requests name one as their model (the engine needs enable_lora)
    lora_modules: tuple[str, ...] = ()

    def __post_init__(self):
        # a config file may hold any YAML value: types first, so every mistake is a ValueError
        # naming its key before the model loads
        for name in ("host", "api_key", "served_model_name"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name != "host")):
                raise ValueError(f"{name} must be a string, got {show(value)}")
        if not (is_int(self.port) and 0 <= self.port < 65536):
            raise ValueError(f"port must be an integer in [0, 65536), got {show(self.port)}")
        if self.max_waiting_requests is not None and not (
                is_int(self.max_waiting_requests) and self.max_waiting_requests >= 0):
            raise ValueError("max_waiting_requests must be an integer >= 0, got "
                             f"{show(self.max_waiting_requests)}")
        if self.request_timeout_s is not None and not (
                is_finite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ValueError(f"request_timeout_s must be a number > 0, got "
                             f"{show(self.request_timeout_s)}")
        for name in ("max_body_bytes", "max_seqs_per_request", "max_connections",
                     "max_concurrent_requests"):
            if not (is_int(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive integer, got "
                                 f"{show(getattr(self, name))}")
        for name in ("stall_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not (is_finite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a number > 0, got {show(getattr(self, name))}")
        if not isinstance(self.enable_prompt_tokens_details, bool):
            raise ValueError(f"enable_prompt_tokens_details must be true or false, got "
                             f"{show(self.enable_prompt_tokens_details)}")
        if self.reasoning_parser is not None:
            check_parser(self.reasoning_parser)
        if not isinstance(self.enable_auto_tool_choice, bool):
            raise ValueError(f"enable_auto_tool_choice must be true or false, got "
                             f"{show(self.enable_auto_tool_choice)}")
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: the format the "
                             "model writes its calls in")
        if isinstance(self.lora_modules, list):  # a config file's list
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        if not isinstance(self.lora_modules, tuple) or any(
                not isinstance(m, str) or m.count("=") < 1 or not m.split("=", 1)[0]
                or not m.split("=", 1)[1] for m in self.lora_modules):
            raise ValueError(f"lora_modules must be a list of NAME=PATH entries, got "
                             f"{show(self.lora_modules)}")
        names = [m.split("=", 1)[0] for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: a name appears twice in {names}")
        if not (is_finite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise ValueError(f"shutdown_grace_s must be a number >= 0, got "
                             f"{show(self.shutdown_grace_s)}")

    def lora_requests(self) -> list[LoRARequest]:
        """lora_modules as the engine takes them (ids 1, 2, ... in order)."""
        return [LoRARequest(name, i, path) for i, (name, path) in enumerate(
            (m.split("=", 1) for m in self.lora_modules), start=1)]
