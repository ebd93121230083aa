"""Frozen, validated configuration: the model (from a Hugging Face config.json) and the engine.

Every engine override, config-file key and CLI flag shares one name (CLI flags use dashes), listed
by `EngineConfig`'s fields. Derived values are computed by properties, never written back.
"""

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jaxserve.checks import is_finite, is_int, show

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def kv_cache_dtype(dtype: str, backend: str, attention_impl: str) -> str:
    """The KV pool's dtype: the model's, except float32 for a 16-bit model under the reference
    attention on the CPU. XLA on the CPU has no 16-bit float gather or scatter: it converts the
    whole pool to float32 and back, every layer of every step (a 2-row decode step of a
    32-layer bf16 model took 214 ms with 4096 pages and 45 ms with 512)."""
    if backend == "cpu" and attention_impl == "reference" and dtype != "float32":
        return "float32"
    return dtype


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's keys (configs/*.yaml: engine and server options side by side)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option keys")
    return data


def host_memory_bytes() -> int:
    """This process's memory: the machine's, or its cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def compute_dtype(requested: str, checkpoint: str, backend: str, num_params: int,
                  reserved_bytes: int = 0, host_bytes: int | None = None) -> str:
    """The dtype the engine loads the weights in and computes with. An explicit `requested`
    dtype wins. "auto" is the checkpoint's, except on the CPU: a 16-bit checkpoint runs in
    float32 there when float32 weights take at most half of the host's memory (its cgroup's
    limit, if lower) left after `reserved_bytes` (the KV cache). XLA on the CPU has no fast
    16-bit matmul: it converts every weight on every step (a 2 x 2048 @ 2048 x 8192 product
    took 116 ms in bf16 and 17 ms in float32 on a 2-core x86; `bench/weights_dtype_cpu.py`
    times whole decode steps)."""
    if requested != "auto":
        return requested
    if backend != "cpu" or checkpoint == "float32":
        return checkpoint
    if host_bytes is None:
        host_bytes = host_memory_bytes()
    return "float32" if 4 * num_params <= (host_bytes - reserved_bytes) // 2 else checkpoint


# transformers 5's defaults for keys a config.json leaves out, where the architectures differ
# (all three: rms_norm_eps 1e-6, rope_theta 10000); a null num_key_value_heads is one per head
_HF_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8},
}

_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type` is one of SUPPORTED_ROPE_TYPES other than default."""

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_positive_number(f"rope_scaling.{name}", getattr(self, name))
        _check_positive_int("rope_scaling.original_max_position_embeddings",
                            self.original_max_position_embeddings)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, Qwen2, Mistral)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's own dtype

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):
            _check_positive_number(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; supported: {SUPPORTED_DTYPES}")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        try:
            hf = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file}: not valid JSON ({error})") from None
        # generation_config.json's stop ids stop generation too (Llama-3's <|eot_id|>), with or
        # without a tokenizer in the directory
        generation = path / "generation_config.json"
        if generation.is_file():
            with contextlib.suppress(json.JSONDecodeError):
                extra = json.loads(generation.read_text()).get("eos_token_id")
                hf = hf | {"eos_token_id": _id_list(hf.get("eos_token_id")) + [
                    i for i in _id_list(extra) if i not in _id_list(hf.get("eos_token_id"))]}
        if not (hf.get("dtype") or hf.get("torch_dtype")):  # as transformers: the weights' own
            hf = hf | {"dtype": _safetensors_dtype(path) or "float32"}
        try:
            return cls.from_hf_dict(hf)
        except KeyError as error:
            raise ValueError(f"{config_file}: missing {error.args[0]!r}") from None
        except ValueError as error:
            raise ValueError(f"{config_file}: {error}") from None

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a transformers config.json, in the transformers 4 or 5 style."""
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(
                f"config.json 'architectures' must name one architecture, got {archs!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: 'silu'")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported; supported: mlp_bias=false")
        quant = hf.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ValueError(f"quantization_config ({method}): quantized checkpoints are not "
                             "supported; use the model's float16/bfloat16/float32 weights")
        # each integer is checked here under its config.json name, before any arithmetic on it
        sizes = {key: _check_positive_int(key, hf[key]) for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")}
        defaults = _HF_DEFAULTS[arch]
        num_heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        # transformers: an absent key takes the architecture's default, a null one (and a null
        # head_dim) is derived from the heads
        num_kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
        head_dim = hf.get("head_dim")
        max_len = _check_positive_int("max_position_embeddings", hf.get(
            "max_position_embeddings", defaults["max_position_embeddings"]))
        theta, scaling = _read_rope(hf, max_len)
        # as transformers: Llama's attention_bias covers q, k, v and o; Qwen2 has q, k, v biases
        # and no o bias; Mistral has none
        attention_bias = bool(hf.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
        sliding = _sliding_window(arch, hf)
        eos_ids = tuple(_id_list(hf.get("eos_token_id")))
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"config dtype {dtype!r} is not supported; supported: {SUPPORTED_DTYPES}")
        return cls(
            architecture=arch,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=_check_positive_int(
                "num_key_value_heads", num_heads if num_kv_heads is None else num_kv_heads),
            head_dim=hidden // num_heads if head_dim is None else head_dim,
            max_position_embeddings=max_len,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=_TORCH_DTYPES[dtype],
        )

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-5 style config.json for this shape (used by saved checkpoints)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope |= dataclasses.asdict(self.rope_scaling)
        return {
            "architectures": [self.architecture], "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias, "hidden_act": "silu",
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "max_window_layers": 0, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids), "dtype": self.dtype,
        }


def _safetensors_dtype(path: Path) -> str | None:
    """The dtype of the first floating-point tensor in the directory's safetensors (read from
    the file's header alone), or None. The model's own files (model*.safetensors) come first:
    an adapter_model.safetensors beside them, which the loader skips, may hold another dtype."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    files = sorted(path.glob("*.safetensors"), key=lambda f: (not f.name.startswith("model"), f))
    for file in files:
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if 0 < size < 1 << 26 else {}
        except (OSError, ValueError):
            continue
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in names:
                return names[entry["dtype"]]
    return None


def _check_positive_int(name: str, value: Any) -> int:
    """`value` if it is an integer > 0, else a ValueError naming the field."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {show(value)}")
    return int(value)


def _check_positive_number(name: str, value: Any) -> float:
    """`value` as a float if it is a finite number > 0, else a ValueError naming the field (a
    null or a string here used to be a TypeError inside the model)."""
    if not is_finite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {show(value)}")
    return float(value)


def _id_list(value: Any) -> list[int]:
    """A token id field (an int, a list of them, or null) as a list."""
    return list(value) if isinstance(value, list) else [] if value is None else [value]


def _sliding_window(arch: str, hf: dict[str, Any]) -> int | None:
    """The attention window, None for full attention, as transformers reads each architecture:
    Llama has none; Mistral's defaults to 4096 when the key is absent (null: none); Qwen2's
    applies only with use_sliding_window, to the layers from max_window_layers (default 28)
    on, 4096 when absent."""
    if arch == "MistralForCausalLM":
        return hf.get("sliding_window", 4096)
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window", False):
        if hf.get("max_window_layers", 28) >= hf["num_hidden_layers"]:
            return None  # no layer slides
        return hf.get("sliding_window", 4096)
    return None


def _read_rope(hf: dict[str, Any], max_position_embeddings: int
               ) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`
    (4). As transformers 5 reads them, a non-empty `rope_scaling` wins over `rope_parameters`."""
    base = dict(hf.get("rope_parameters") or {})
    params = dict(hf.get("rope_scaling") or {}) or base
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = _check_positive_number("rope_theta", params.get(
        "rope_theta", hf.get("rope_theta", base.get("rope_theta", 10000.0))))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    needed = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in needed if k not in params]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {', '.join(missing)}")
    values = {k: params[k] for k in needed}
    if rope_type == "llama3":  # as transformers: the top-level key, else the model's length
        values["original_max_position_embeddings"] = params.get(
            "original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                       max_position_embeddings))
    return theta, RopeScaling(rope_type=rope_type, **values)


Batching = Literal["static", "dynamic", "continuous"]
AttentionImpl = Literal["auto", "pallas", "reference"]
_CHOICES = {
    "batching": ("static", "dynamic", "continuous"),
    "attention_impl": ("auto", "pallas", "reference"),
    "dtype": ("auto", *SUPPORTED_DTYPES),
    "policy": ("fcfs", "priority", "sjf", "mlfq", "edf"),
    "load_format": ("auto", "dummy"),
}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; the field names are the overrides, config-file keys and CLI flags."""

    dtype: str = "auto"  # auto: the checkpoint's (16-bit: float32 on the CPU if memory allows)
    load_format: str = "auto"  # dummy: random weights of the checkpoint's shape
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.9  # of free device memory (CPU: of kv_cache_bytes_cpu)
    kv_cache_bytes_cpu: int = 1 << 30
    attention_impl: str = "auto"
    batching: str = "continuous"
    policy: str = "fcfs"
    window_ms: float = 0.0
    adaptive_window: bool = False  # window_ms follows arrivals, within [window_ms_min, window_ms_max]
    window_ms_min: float = 0.0
    window_ms_max: float = 50.0
    slo_ms: float = 1000.0  # edf: the time-to-first-token target of requests that set none
    sjf_predictor: str = "prompt"  # sjf: "oracle" | "prompt" | a learned predictor's JSON file
    length_bucketing: bool = False  # new prompt chunks of one iteration share a prefill bucket
    min_batch_size: int = 1
    max_batch_size: int | None = None  # None: max_num_seqs
    decode_steps: int = 1
    prefill_chunk_sizes: tuple[int, ...] = (16, 32, 64, 128, 256)  # prefill buckets, tokens per row
    # the padded row counts the steps are compiled for (vLLM's cuda_graph_sizes); fewer buckets
    # compile faster and pad more. None: 2, 4, 8 ... up to the first >= max_num_seqs
    row_buckets: tuple[int, ...] | None = None
    max_top_logprobs: int = 20
    enable_prompt_logprobs: bool = True  # False: no prompt-logprob step variants to compile
    compilation_cache_dir: str | None = None  # None: $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve/xla

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "min_batch_size",
                     "decode_steps", "kv_cache_bytes_cpu"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, "
                                 f"got {show(getattr(self, name))}")
        for name in ("max_model_len", "num_pages", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {show(value)}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the null page), got {self.num_pages}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {show(self.seed)}")
        if not is_int(self.max_top_logprobs) or self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be an integer >= 0, "
                             f"got {show(self.max_top_logprobs)}")
        for name in ("adaptive_window", "length_bucketing", "enable_prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {show(getattr(self, name))}")
        for name in ("kv_cache_memory_fraction", "window_ms", "window_ms_min", "window_ms_max",
                     "slo_ms"):  # NaN or inf would stall the window or the edf order
            if not is_finite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {show(getattr(self, name))}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {self.window_ms}")
        if not 0 <= self.window_ms_min <= self.window_ms_max:
            raise ValueError(f"need 0 <= window_ms_min ({self.window_ms_min}) <= window_ms_max "
                             f"({self.window_ms_max})")
        if not self.slo_ms > 0:
            raise ValueError(f"slo_ms must be > 0, got {self.slo_ms}")
        for name in ("prefill_chunk_sizes", "row_buckets"):  # a YAML scalar, a set: not a list
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif not isinstance(value, tuple) and (value is not None or name != "row_buckets"):
                raise ValueError(f"{name} must be a list of integers, got {show(value)}")
        sizes = self.prefill_chunk_sizes
        if (not sizes or any(not is_int(s) or s < 2 for s in sizes)
                or list(sizes) != sorted(set(sizes))):
            raise ValueError(f"prefill_chunk_sizes must be increasing sizes of at least 2 (a "
                             f"prompt chunk feeds 2 or more tokens), got {sizes!r}")
        rows = self.row_buckets
        if rows is not None and (not rows or any(not is_int(r) for r in rows)
                                 or list(rows) != sorted(set(rows)) or rows[0] < 2
                                 or rows[-1] < self.max_num_seqs):
            raise ValueError(f"row_buckets must be increasing sizes of at least 2, the last >= "
                             f"max_num_seqs ({self.max_num_seqs}), got {rows!r}")

    @classmethod
    def from_overrides(cls, **overrides: Any) -> "EngineConfig":
        """Build from keyword overrides; an unknown key is a ValueError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        return cls(**overrides)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "EngineConfig":
        """Read a YAML file of engine keys; `overrides` win over the file."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of engine keys")
        return cls.from_overrides(**(data | overrides))

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """The context limit: the override, bounded by the model, checked against its window."""
        limit = self.max_model_len or model.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        if model.sliding_window is not None and model.sliding_window < limit:
            raise ValueError(
                f"sliding_window {model.sliding_window} is shorter than max_model_len {limit}; "
                f"sliding-window attention is not supported: set max_model_len <= {model.sliding_window}"
            )
        return limit

    def pages_per_seq(self, max_model_len: int) -> int:
        return math.ceil(max_model_len / self.page_size)

    def decode_row_buckets(self) -> tuple[int, ...]:
        """Row counts a decode step is padded to (a prefill call may also run 1 row)."""
        if self.row_buckets is not None:
            return self.row_buckets
        return tuple(2**i for i in range(1, max(1, math.ceil(math.log2(self.max_num_seqs))) + 1))

    def chunk_buckets(self, max_model_len: int) -> tuple[int, ...]:
        """Prompt-chunk lengths a prefill step is padded to; the last is the longest chunk."""
        buckets = tuple(c for c in self.prefill_chunk_sizes if c <= max_model_len)
        if not buckets:
            raise ValueError(f"prefill_chunk_sizes {list(self.prefill_chunk_sizes)}: none fits "
                             f"max_model_len {max_model_len}")
        return buckets
