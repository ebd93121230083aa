"""What a config.json says family by family, read as transformers reads each: RoPE (scaling
types, Phi-3's LongRoPE, Gemma 3's local base), sliding windows and layer types, Gemma's own
keys, the mixture-of-experts fields. Each refusal names the field. model.py's
ModelConfig reads the rest and calls these."""

import math
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.config.checks import is_finite, is_int, show

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "frequency_factors")
PHI3_ROPE_TYPES = ("default", "longrope")  # Phi-3's own, as transformers' Phi3Config
# Phi3Config's default, and the value Phi-3 reads over one inside rope_scaling
_PHI3_ORIGINAL_MAX_POSITIONS = 4096


def positive_int(name: str, value: Any) -> int:
    """`value` if it is an integer > 0, else a ValueError naming the field."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {show(value)}")
    return int(value)


def positive_number(name: str, value: Any) -> float:
    """`value` as a float if it is a finite number > 0, else a ValueError naming the field (a
    null or a string here used to be a TypeError inside the model)."""
    if not is_finite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {show(value)}")
    return float(value)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type` is one of SUPPORTED_ROPE_TYPES or PHI3_ROPE_TYPES
    other than default.

    longrope (Phi-3): transformers divides each frequency by its `short_factor` while a
    sequence is at most `original_max_position_embeddings` long and by its `long_factor` past
    that (recomputing the whole sequence), and multiplies cos and sin by `attention_factor`.
    Only the first is served: EngineConfig refuses a longer max_model_len.

    frequency_factors (jaxserve's, from a GGUF file's rope_freqs.weight, as llama.cpp's
    converter writes Llama 3.1's llama3 scaling): each frequency divided by its factor, at
    every length."""

    rope_type: Literal["linear", "llama3", "longrope", "frequency_factors"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: one per rotary frequency
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    frequency_factors: tuple[float, ...] = ()  # frequency_factors: one per rotary frequency

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
            positive_number(f"rope_scaling.{name}", getattr(self, name))
        positive_int("rope_scaling.original_max_position_embeddings",
                            self.original_max_position_embeddings)
        for name in ("short_factor", "long_factor", "frequency_factors"):
            for value in getattr(self, name):
                positive_number(f"rope_scaling.{name}", value)


def read_moe(arch: str, hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts config's expert fields, as transformers reads each family: Mixtral's
    experts (num_local_experts) are intermediate_size wide and always renormalised; the Qwen
    MoEs' (num_experts, saved by transformers 5 as num_local_experts too) are
    moe_intermediate_size wide, renormalised where norm_topk_prob, and Qwen2-MoE has a shared
    expert. Every layer must be sparse: a model whose decoder_sparse_step or mlp_only_layers
    leave some layers dense is refused (no released checkpoint of these families has one)."""
    count = hf.get("num_experts", hf.get("num_local_experts", defaults["num_experts"]))
    moe = {"num_experts": positive_int("num_experts", count),
           "num_experts_per_tok": positive_int("num_experts_per_tok", hf.get(
               "num_experts_per_tok", defaults["num_experts_per_tok"]))}
    if arch == "MixtralForCausalLM":
        return moe | {"moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True}
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(f"decoder_sparse_step {show(step)} with mlp_only_layers {show(dense)}: "
                         "only models whose every layer is sparse (step 1, no mlp_only_layers) "
                         "are supported")
    moe |= {"moe_intermediate_size": positive_int(
                "moe_intermediate_size", hf.get("moe_intermediate_size")),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}
    if arch == "Qwen2MoeForCausalLM":
        moe["shared_expert_intermediate_size"] = positive_int(
            "shared_expert_intermediate_size", hf.get("shared_expert_intermediate_size"))
    return moe


def read_sliding_window(arch: str, hf: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """The attention window and which layers it applies to (layer_types; () when every
    layer's), as transformers reads each architecture: Llama has none; Mistral's (every
    layer's) defaults to 4096 when the key is absent (null: none), Phi-3's and Mixtral's (every
    layer's) to none; the Qwen families' (dense and MoE) applies only with use_sliding_window
    (4096 when absent), to the layers that `layer_types` names "sliding_attention", or when it
    is absent to the layers from max_window_layers (default 28) on. Gemma 2's and 3's (4096
    when absent) applies to the layers `layer_types` names, else Gemma 2's even layers and
    Gemma 3's all but every sliding_window_pattern-th (default 6)."""
    layers = hf["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        window = hf.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
        return (None if window is None else positive_int("sliding_window", window)), ()
    if arch in GEMMA_ARCHITECTURES:
        window = positive_int("sliding_window", hf.get("sliding_window", 4096))
        pattern = 2 if arch == "Gemma2ForCausalLM" else hf.get(
            "sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        pattern = positive_int("sliding_window_pattern", pattern)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(layers)]
        return window, _layer_types(hf.get("layer_types", default), layers)
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                    "Qwen3MoeForCausalLM"):
        return None, ()
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if window is None:
        return None, ()
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        if not is_int(first):
            raise ValueError(f"max_window_layers must be an integer, got {show(first)}")
        layer_types = ["full_attention" if i < first else "sliding_attention"
                       for i in range(layers)]
    types = _layer_types(layer_types, layers)
    if "sliding_attention" not in types:
        return None, ()
    return positive_int("sliding_window", window), types


def _layer_types(layer_types: Any, layers: int) -> tuple[str, ...]:
    if (isinstance(layer_types, list) and len(layer_types) == layers
            and all(t in ("full_attention", "sliding_attention") for t in layer_types)):
        return tuple(layer_types)
    raise ValueError(f"layer_types must list 'full_attention' or 'sliding_attention' for "
                     f"each of the {layers} layers, got {show(layer_types)}")


def read_gemma(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's own keys, transformers' defaults where absent (query_pre_attn_scalar
    256; Gemma 2 caps scores at 50 and logits at 30, Gemma 3 neither; Gemma 3's sliding layers
    turn RoPE at base 10000: rope_local_base_freq, or transformers 5's rope_parameters
    sliding_attention)."""
    gemma2 = arch == "Gemma2ForCausalLM"
    out = {"gemma_norms": True,
           "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
           "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0 if gemma2 else None),
           "final_logit_softcapping": hf.get("final_logit_softcapping",
                                             30.0 if gemma2 else None)}
    if not gemma2:
        local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
        out["rope_local_theta"] = local.get("rope_theta", hf.get("rope_local_base_freq",
                                                                  10000.0))
    return out


def read_rope(arch: str, hf: dict[str, Any], max_position_embeddings: int
               ) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling, partial_rotary_factor) from `rope_parameters` (transformers 5) or
    `rope_theta`/`rope_scaling` (4). As transformers 5 reads them, a non-empty `rope_scaling`
    wins over `rope_parameters`. Phi-3 alone reads longrope (its old names "su" and "yarn"
    too) and a partial_rotary_factor (the rope dict's, else the top-level key's)."""
    base = dict(hf.get("rope_parameters") or {})
    if isinstance(base.get("full_attention"), dict):  # per layer type (Gemma 3): the global
        base = dict(base["full_attention"])           # layers'; the sliding ones' is local
    params = dict(hf.get("rope_scaling") or {}) or base
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = positive_number("rope_theta", params.get(
        "rope_theta", hf.get("rope_theta", base.get("rope_theta", 10000.0))))
    partial, supported, where = 1.0, SUPPORTED_ROPE_TYPES, ""
    if arch == "Phi3ForCausalLM":
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
        partial = positive_number("partial_rotary_factor", params.get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        supported, where = PHI3_ROPE_TYPES, f" for {arch}"
    if rope_type not in supported:
        raise ValueError(f"rope type {rope_type!r} is not supported{where}; supported: "
                         f"{', '.join(supported)}")
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "longrope":
        return theta, _longrope(hf, params, max_position_embeddings), partial
    if rope_type == "frequency_factors":
        factors = params.get("frequency_factors")
        if not isinstance(factors, list) or not factors:
            raise ValueError("rope_scaling of type 'frequency_factors' needs frequency_factors, "
                             f"a list of numbers, got {show(factors)}")
        return theta, RopeScaling(rope_type=rope_type, factor=1.0, frequency_factors=tuple(
            positive_number("rope_scaling.frequency_factors", x) for x in factors)), partial
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
    return theta, RopeScaling(rope_type=rope_type, **values), partial


def _longrope(hf: dict[str, Any], params: dict[str, Any],
              max_position_embeddings: int) -> RopeScaling:
    """Phi-3's LongRoPE as transformers reads it: the top-level original_max_position_embeddings
    (4096 when absent), `factor` max_position_embeddings / that when absent, and the attention
    factor sqrt(1 + ln(factor) / ln(original)) (1 for a factor <= 1) when absent."""
    missing = [k for k in ("short_factor", "long_factor") if k not in params]
    if missing:
        raise ValueError(f"rope_scaling of type 'longrope' needs {', '.join(missing)}")
    lists = {}
    for key in ("short_factor", "long_factor"):
        if not isinstance(params[key], list):
            raise ValueError(f"rope_scaling.{key} must be a list of numbers, "
                             f"got {show(params[key])}")
        lists[key] = tuple(positive_number(f"rope_scaling.{key}", x) for x in params[key])
    original = positive_int("original_max_position_embeddings", hf.get(
        "original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITIONS))
    if original < 2:  # its logarithm divides
        raise ValueError(f"original_max_position_embeddings must be at least 2, got {original}")
    factor = params.get("factor")
    factor = max_position_embeddings / original if factor is None else positive_number(
        "rope_scaling.factor", factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor,
                       original_max_position_embeddings=original,
                       attention_factor=attention, **lists)
