"""Frozen, validated engine configuration (the model's shape is `model_config.ModelConfig`).

Every engine override, config-file key and CLI flag shares one name (CLI flags use dashes), listed
by `EngineConfig`'s fields. Derived values are computed by properties, never written back.
"""

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jaxserve.config.checks import is_finite, is_int, show
from jaxserve.config.model import QUANTIZATIONS, SUPPORTED_DTYPES, ModelConfig

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8")  # the kv_cache_dtype option's values


def kv_cache_dtype(dtype: str, backend: str, attention_impl: str,
                   requested: str = "auto") -> str:
    """The KV pool's dtype for a model computing in `dtype`; `requested` is the
    kv_cache_dtype option. "auto" is the model's dtype, except float32 for a 16-bit model under
    the reference or cpu attention on the CPU: XLA on the CPU has no 16-bit float gather or
    scatter, and its steps converted a bfloat16 pool to float32 and back, every layer of every
    step (2026-11-30: a 2-row decode step of a 32-layer bf16 model took 214 ms with 4096 pages
    and 45 ms with 512; bench/kv_dtype_cpu.py).
    "bfloat16" on the CPU is read by the cpu attention's kernels, which hold it as uint16 bits
    (XLA scatters those in place) and widen each key and value as they load it: half the bytes
    a decode step reads from the pool, keys and values rounded to bfloat16. On an accelerator
    the pool takes the model's dtype (the Pallas kernels read q's dtype). "fp8" (vLLM's name):
    float8_e4m3fn keys and values (a quarter of float32's bytes, half of bfloat16's), on every
    attention but the tpu one; the kernels widen them as they load. A combination that cannot
    run raises a ValueError naming kv_cache_dtype."""
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {requested!r}")
    if requested == "auto":
        if backend == "cpu" and attention_impl in ("reference", "cpu") and dtype != "float32":
            return "float32"
        return dtype
    if requested == "fp8":  # read by every attention but JAX's TPU kernel
        if attention_impl == "tpu":
            raise ValueError("kv_cache_dtype='fp8' is not read by the tpu attention; leave it "
                             "'auto' there")
        return requested
    if backend != "cpu":
        if requested != dtype:
            raise ValueError(f"kv_cache_dtype={requested!r}: on {backend!r} the KV pool takes "
                             f"the model's dtype ({dtype}); leave it 'auto'")
        return requested
    if requested == "bfloat16" and attention_impl != "cpu":
        raise ValueError(f"kv_cache_dtype='bfloat16' on the CPU is read by the cpu attention "
                         f"kernels, not attention_impl={attention_impl!r}")
    return requested


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


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` and its keys): a proposer guesses up to
    `num_speculative_tokens` tokens a row will generate, one step of the model verifies them all
    and keeps the longest run it would have generated itself (exactly: rejection sampling when
    the row samples). `ngram` proposes by prompt lookup: the tokens that followed the latest
    earlier occurrence of the context's last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min. `draft_model` proposes with a smaller model sharing the target's
    tokenizer (`model`: its directory; the demo's own draft when the target is the demo and
    `model` is left out). Speculation turns itself off in iterations whose batch holds more than
    `disable_by_batch_size` running requests (vLLM's speculative_disable_by_batch_size): a large
    batch already keeps the device busy, and the verification's extra tokens would only cost."""

    method: str | None = None  # None: "draft_model" when `model` is given, else "ngram"
    num_speculative_tokens: int = 0
    model: str | None = None  # the draft model's directory (draft_model)
    prompt_lookup_min: int | None = None  # None: prompt_lookup_max (both None: 5 and 5, vLLM's)
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = 8  # None: speculate whatever the batch

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """The option's value as given (a mapping, its JSON text, or None: off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} "
                                 f"({error})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping of its keys, got {show(value)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(names)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required (tokens "
                             f"proposed per step, 1 to {MAX_SPECULATIVE_TOKENS})")
        return cls(**value)

    def __post_init__(self):
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model must be a model directory, "
                             f"got {show(self.model)}")
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                             f"got {show(self.method)}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is the draft model of method "
                             f"'draft_model', not of {self.method!r}")
        k = self.num_speculative_tokens
        if not (is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError("speculative_config.num_speculative_tokens must be an integer from 1 "
                             f"to {MAX_SPECULATIVE_TOKENS} (the verification step is compiled at "
                             f"k + 1 tokens a row), got {show(k)}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"speculative_config.{name} must be a positive integer, "
                                 f"got {show(value)}")
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must not exceed "
                             f"prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        b = self.disable_by_batch_size
        if b is not None and not (is_int(b) and b >= 1):
            raise ValueError("speculative_config.disable_by_batch_size must be a positive integer "
                             f"or None, got {show(b)}")


Batching = Literal["static", "dynamic", "continuous"]
AttentionImpl = Literal["auto", "pallas", "tpu", "cpu", "reference"]
_CHOICES = {
    "batching": ("static", "dynamic", "continuous"),
    "attention_impl": ("auto", "pallas", "tpu", "cpu", "reference"),
    "matmul_impl": ("auto", "cpu", "amx", "xla"),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "dtype": ("auto", *SUPPORTED_DTYPES),
    "policy": ("fcfs", "priority", "sjf", "mlfq", "edf", "lpm"),
    "load_format": ("auto", "dummy"),
    "quantization": (None, *QUANTIZATIONS),
}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; the field names are the overrides, config-file keys and CLI flags."""

    dtype: str = "auto"  # auto: the checkpoint's (16-bit: float32 on the CPU if memory allows)
    load_format: str = "auto"  # dummy: random weights of the checkpoint's shape
    # a directory (or GGUF file) whose tokenizer and chat template replace the model's own
    tokenizer: str | None = None
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.9  # of free device memory (CPU: of kv_cache_bytes_cpu)
    kv_cache_bytes_cpu: int = 1 << 30
    # the KV pool's dtype. auto: the model's (float32 on the CPU); bfloat16 on the CPU (cpu
    # attention): half the bytes per token, keys and values rounded to bfloat16
    kv_cache_dtype: str = "auto"
    attention_impl: str = "auto"
    matmul_impl: str = "auto"  # auto: the CPU's batch-invariant kernel for float32, else XLA's dot
    # (amx: that kernel on AMX tiles in three bf16 passes, opt-in: not float32's bits)
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
    # an iteration's prompt chunks packed into one row of tokens, the call padded as a whole
    # (no row padded to a chunk bucket). None: where the attention impl can (cpu, tpu)
    ragged_prefill: bool | None = None
    # the padded row counts the steps are compiled for (vLLM's cuda_graph_sizes); fewer buckets
    # compile faster and pad more. None: 2, 4, 8 ... up to the first >= max_num_seqs
    row_buckets: tuple[int, ...] | None = None
    max_top_logprobs: int = 20
    # a prompt's full pages already computed (by any request) are reused, not recomputed
    # (vLLM V1's automatic prefix caching, on by default as there)
    enable_prefix_caching: bool = True
    enable_prompt_logprobs: bool = True  # False: no prompt-logprob step variants to compile
    compilation_cache_dir: str | None = None  # None: $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve/xla
    # the decoder layers stacked under jax.lax.scan: one layer compiled whatever the depth;
    # false unrolls them (compile time grows with depth). None: the backend's choice (scan,
    # except the CPU's matmul kernels, which run faster unrolled)
    scan_layers: bool | None = None
    # tensor parallelism (vLLM's name, -tp): the model's heads, MLP columns, vocabulary and KV
    # pool split over this many devices of one mesh (jaxserve/parallel/sharding.py)
    tensor_parallel_size: int = 1
    # data parallelism (vLLM's name, -dp): this many replicas of the model, each on its own
    # tensor_parallel_size devices with its own scheduler and KV pool; each request goes to the
    # least-loaded replica (LLMEngine)
    data_parallel_size: int = 1
    # a mixture-of-experts model's experts split whole over the tensor-parallel devices
    # (vLLM's name), each device num_experts / tensor_parallel_size of them; else each expert
    # is split like a dense MLP
    enable_expert_parallel: bool = False
    # the decoder's linear layers quantised as they load (vLLM's option and flag): int8, fp8
    # (e4m3) or int4 weights with a float32 scale per output column, dequantised inside the matmul;
    # the embedding table and the LM head keep the model's dtype (jaxserve/model/quant.py)
    quantization: str | None = None
    # speculative decoding (vLLM's option; the CLI takes its JSON): None off, else a mapping of
    # SpeculativeConfig's keys, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    speculative_config: SpeculativeConfig | dict | None = None
    # LoRA adapters served beside the base (vLLM's options; jaxserve/model/lora.py): a request
    # names its adapter; at most max_loras adapters share a step, each of rank up to
    # max_lora_rank; max_cpu_loras adapters' weights are kept on the host (None: max_loras),
    # the least recently used dropped past it
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_value(self.speculative_config))
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "min_batch_size",
                     "decode_steps", "kv_cache_bytes_cpu", "tensor_parallel_size",
                     "data_parallel_size", "max_loras", "max_lora_rank"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, "
                                 f"got {show(getattr(self, name))}")
        for name in ("max_model_len", "num_pages", "max_batch_size", "max_cpu_loras"):
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
        for name in ("adaptive_window", "length_bucketing", "enable_prompt_logprobs",
                     "enable_prefix_caching", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {show(getattr(self, name))}")
        for name in ("ragged_prefill", "scan_layers"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true, false or None, "
                                 f"got {show(getattr(self, name))}")
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
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")

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

    def served_model(self, model: ModelConfig) -> ModelConfig:
        """The checkpoint's model as this engine serves it: quantised when the option says."""
        if self.quantization is None:
            return model
        if model.quantization_format == "gguf":  # the file's blocks load as floats, requantised
            return dataclasses.replace(model.unquantized(), quantization=self.quantization)
        if model.quantization == self.quantization:
            return model
        if model.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r}, but the checkpoint is already "
                             f"quantised as {model.quantization!r}: leave the option unset")
        return dataclasses.replace(model, quantization=self.quantization)

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """The context limit: the override, bounded by the model, checked against LongRoPE's
        short factors' range."""
        limit = self.max_model_len or model.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        scaling = model.rope_scaling
        original = None if scaling is None else scaling.original_max_position_embeddings
        if scaling is not None and scaling.rope_type == "longrope" and limit > original:
            raise ValueError(
                f"max_model_len {limit} is longer than original_max_position_embeddings "
                f"{original}: past it LongRoPE turns every position by rope_scaling.long_factor "
                f"(transformers recomputes the whole sequence), which is not supported: set "
                f"max_model_len <= {original}"
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
