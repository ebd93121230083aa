"""The model's shape, read and checked from a Hugging Face config.json (and the files beside it).

`ModelConfig.from_hf_dir` fills in transformers' defaults per architecture and names the field
of any value it refuses.
"""

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxserve.config.family import (
    GEMMA_ARCHITECTURES,
    RopeScaling,
    positive_int,
    positive_number,
    read_gemma,
    read_moe,
    read_rope,
    read_sliding_window,
)
from jaxserve.config.gguf import ROPE_TENSORS, gguf_file, hf_config, metadata, read_gguf
from jaxserve.config.quant import read_quantization

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (SwiGLU, GeGLU)
# mixture of experts: every layer's MLP is a routed set of experts (jaxserve/model/moe.py)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "fp8", "int4")  # the quantization option's values


# transformers 5's defaults for keys a config.json leaves out, where the architectures differ
# (all: rope_theta 10000); a null num_key_value_heads is one per head, a null head_dim (and an
# absent one, but for Qwen3's 128) hidden_size / num_attention_heads
_HF_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None,
                         "head_dim": None, "rms_norm_eps": 1e-6},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
                         "head_dim": None, "rms_norm_eps": 1e-6},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
                         "head_dim": 128, "rms_norm_eps": 1e-6},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                           "head_dim": None, "rms_norm_eps": 1e-6},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "num_key_value_heads": None,
                        "head_dim": None, "rms_norm_eps": 1e-5},
    "Gemma2ForCausalLM": {"max_position_embeddings": 8192, "num_key_value_heads": 4,
                          "head_dim": 256, "rms_norm_eps": 1e-6},
    "Gemma3ForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 4,
                          "head_dim": 256, "rms_norm_eps": 1e-6},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                           "head_dim": None, "rms_norm_eps": 1e-5, "num_experts": 8,
                           "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 16,
                            "head_dim": None, "rms_norm_eps": 1e-6, "num_experts": 60,
                            "num_experts_per_tok": 4},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4,
                            "head_dim": None, "rms_norm_eps": 1e-6, "num_experts": 128,
                            "num_experts_per_tok": 8},
}
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2/3),
    dense or with mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

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
    partial_rotary_factor: float = 1.0  # Phi-3: RoPE turns the first rotary_dim of each head
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k, before RoPE
    sliding_window: int | None = None
    # each layer's attention, transformers' names: "sliding_attention" (the last
    # sliding_window positions) or "full_attention"; () with a sliding_window: every layer
    # slides
    layer_types: tuple[str, ...] = ()
    # Gemma 2/3: RMSNorm weights stored as w - 1 (the norm multiplies by 1 + w, in float32),
    # a norm after attention and around the MLP too, the embedding scaled by sqrt(hidden),
    # a GeGLU MLP, queries scaled by query_pre_attn_scalar ** -0.5 (not head_dim's), scores and
    # final logits soft-capped (c * tanh(x / c)), and (Gemma 3) the sliding layers' RoPE of
    # base rope_local_theta
    gemma_norms: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's own dtype
    # the linear layers' weights stored int8, fp8 or int4 with a scale per output column
    # (jaxserve/model/quant.py); set from the engine's quantization option or the checkpoint's
    quantization: str | None = None
    # a checkpoint's group-wise scales: one per output column and group of this many input rows
    quantization_group_size: int | None = None
    # how a pre-quantised checkpoint lays its weights out: "compressed-tensors", "gptq" (zero
    # points stored minus one, as AutoGPTQ wrote them), "gptq_v2" or "awq"; None: quantised
    # at load
    quantization_format: str | None = None
    # GPTQ's and AWQ's packed values' width, and whether they carry zero points (asymmetric:
    # value - zero spans twice the width, so a 4-bit one is held as int8)
    quantization_bits: int | None = None
    quantization_zero_points: bool = False
    # GPTQ's act-order (desc_act): its linear layers' input rows are read in group order
    # (QuantizedLinear.input_order)
    quantization_act_order: bool = False
    # the checkpoint's per-layer scales of an fp8 KV cache (compressed-tensors' kv_cache_scheme:
    # self_attn.k_scale / v_scale): stored = k / k_scale, read back times it
    kv_cache_scales: bool = False
    # GGUF's Q4_1 layers: a float minimum a group added to the scaled values (QuantizedLinear's
    # group_min); its token embedding held narrow too (quant.QuantizedEmbed), None: in dtype
    quantization_offsets: bool = False
    embedding_quantization: str | None = None
    embedding_offsets: bool = False
    # mixture of experts (0: a dense MLP): each token's MLP is the weighted sum of its top
    # num_experts_per_tok of num_experts experts (each a SwiGLU MLP of moe_intermediate_size),
    # the weights the router's softmax over all experts at the chosen ones, renormalised to sum
    # to 1 where norm_topk_prob (Mixtral always); Qwen2-MoE adds a shared expert of
    # shared_expert_intermediate_size to every token, scaled by a sigmoid gate
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            positive_int(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):
            positive_number(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        factor = positive_number("partial_rotary_factor", self.partial_rotary_factor)
        if factor > 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"partial_rotary_factor {factor} rotates {self.rotary_dim} of head_dim "
                f"{self.head_dim}; RoPE needs an even number of them, at least 2 and at most all"
            )
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type in ("longrope", "frequency_factors"):
            names = (("short_factor", "long_factor") if scaling.rope_type == "longrope"
                     else ("frequency_factors",))
            for name in names:
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ValueError(
                        f"rope_scaling.{name} must have {self.rotary_dim // 2} entries (one per "
                        f"frequency of {self.rotary_dim} rotary dims), got "
                        f"{len(getattr(scaling, name))}"
                    )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; supported: {SUPPORTED_DTYPES}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got "
                             f"{self.quantization!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        if self.layer_types and (len(self.layer_types) != self.num_layers or any(
                t not in ("full_attention", "sliding_attention") for t in self.layer_types)):
            raise ValueError(f"layer_types must list 'full_attention' or 'sliding_attention' "
                             f"for each of the {self.num_layers} layers, got "
                             f"{list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types names sliding layers but sliding_window is null")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_theta"):
            if getattr(self, name) is not None:
                positive_number(name, getattr(self, name))
        if self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                positive_int(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is more than "
                                 f"the {self.num_experts} experts")
            if self.quantization is not None:
                raise ValueError(f"quantization {self.quantization!r} of a mixture-of-experts "
                                 "model is not supported yet; serve it unquantised")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        """A model directory's config.json, or a GGUF file's metadata (config/gguf.py)."""
        path = Path(path)
        if (gguf := gguf_file(path)) is not None:
            reader = read_gguf(gguf)
            tensors = {t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape))
                       for t in reader.tensors}
            # RoPE's factors are tensors' values (Llama 3.1's scaling, Phi-3's LongRoPE)
            rope = {t.name: t.data for t in reader.tensors if t.name in ROPE_TENSORS}
            hf = hf_config(metadata(reader), tensors, gguf, rope)
            try:
                return cls.from_hf_dict(hf)
            except ValueError as error:
                raise ValueError(f"{gguf}: {error}") from None
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
        gptq = path / "quantize_config.json"  # older GPTQ checkpoints' own file
        if "quantization_config" not in hf and gptq.is_file():
            with contextlib.suppress(json.JSONDecodeError):
                hf = hf | {"quantization_config": {"quant_method": "gptq"}
                           | json.loads(gptq.read_text())}
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
        # Gemma names it hidden_activation (its configs may carry both)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or (
            "gelu_pytorch_tanh" if arch in GEMMA_ARCHITECTURES else "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported; supported: mlp_bias=false")
        quant = read_quantization(hf.get("quantization_config"))
        # each integer is checked here under its config.json name, before any arithmetic on it
        sizes = {key: positive_int(key, hf[key]) for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")}
        defaults = _HF_DEFAULTS[arch]
        num_heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        # transformers: an absent key takes the architecture's default, a null one (and a null
        # head_dim) is derived from the heads
        num_kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
        head_dim = hf.get("head_dim", defaults["head_dim"])
        max_len = positive_int("max_position_embeddings", hf.get(
            "max_position_embeddings", defaults["max_position_embeddings"]))
        theta, scaling, partial = read_rope(arch, hf, max_len)
        # as transformers: Llama's and Qwen3's (and Qwen3-MoE's) attention_bias covers q, k, v
        # and o; Qwen2 and Qwen2-MoE have q, k, v biases and no o bias; Mistral, Mixtral and
        # Phi-3 have none
        attention_bias = bool(hf.get("attention_bias", False)) and arch in (
            "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *GEMMA_ARCHITECTURES)
        qkv_bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or attention_bias
        sliding, layer_types = read_sliding_window(arch, hf)
        gemma = read_gemma(arch, hf) if arch in GEMMA_ARCHITECTURES else {}
        moe = read_moe(arch, hf, defaults) if arch in MOE_ARCHITECTURES else {}
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
            num_kv_heads=positive_int(
                "num_key_value_heads", num_heads if num_kv_heads is None else num_kv_heads),
            head_dim=hidden // num_heads if head_dim is None else head_dim,
            max_position_embeddings=max_len,
            rms_norm_eps=hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding,
            layer_types=layer_types,
            hidden_act=act,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=_TORCH_DTYPES[dtype],
            quantization=quant.quantization,
            quantization_group_size=quant.group_size,
            quantization_format=quant.format,
            quantization_bits=quant.bits,
            quantization_zero_points=quant.zero_points,
            quantization_act_order=quant.act_order,
            kv_cache_scales=quant.kv_cache_scales,
            quantization_offsets=quant.offsets,
            embedding_quantization=quant.embedding,
            embedding_offsets=quant.embedding_offsets,
            **moe,
            **gemma,
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: it sees every earlier position)."""
        if self.sliding_window is None or (
                self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def unquantized(self) -> "ModelConfig":
        """The model with its weights in its dtype: every quantised layout dropped (a GGUF's
        blocks, GPTQ's and AWQ's groups, the narrow embedding)."""
        return dataclasses.replace(
            self, quantization=None, quantization_group_size=None, quantization_format=None,
            quantization_bits=None, quantization_zero_points=False,
            quantization_act_order=False, quantization_offsets=False,
            embedding_quantization=None, embedding_offsets=False)

    @property
    def shared_window(self) -> int | None:
        """The window every layer has (pages behind it are never read again), else None."""
        return self.window(0) if self.uniform_layers else None

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer is built alike (window and RoPE), as jax.lax.scan needs."""
        return len({self.window(i) for i in range(self.num_layers)}) == 1

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE turns (the first ones), as transformers rounds."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += 2 * self.head_dim if self.qk_norm else 0
        attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        attn += self.hidden_size if self.o_bias else 0
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.num_experts:  # the experts, the router, and a shared expert and its gate
            mlp = self.hidden_size * (3 * self.num_experts * self.moe_intermediate_size
                                      + self.num_experts)
            if self.shared_expert_intermediate_size:
                mlp += self.hidden_size * (3 * self.shared_expert_intermediate_size + 1)
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (4 if self.gemma_norms else 2) * self.hidden_size
        return self.num_layers * (attn + mlp + norms) + embed + self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-5 style config.json for this shape (used by saved checkpoints)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor}
        extra: dict[str, Any] = {}
        if self.rope_scaling is not None:
            rope |= {key: list(value) if isinstance(value, tuple) else value  # as JSON reads
                     for key, value in dataclasses.asdict(self.rope_scaling).items()}
            if self.architecture == "Phi3ForCausalLM":  # the one it reads
                extra["original_max_position_embeddings"] = (
                    self.rope_scaling.original_max_position_embeddings)
        if self.gemma_norms:
            extra |= {"query_pre_attn_scalar": self.query_pre_attn_scalar,
                      "attn_logit_softcapping": self.attn_logit_softcapping,
                      "final_logit_softcapping": self.final_logit_softcapping,
                      "rope_local_base_freq": self.rope_local_theta}
        if self.num_experts:
            extra |= {"num_experts": self.num_experts, "num_local_experts": self.num_experts,
                      "num_experts_per_tok": self.num_experts_per_tok,
                      "moe_intermediate_size": self.moe_intermediate_size,
                      "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                      "norm_topk_prob": self.norm_topk_prob}
            if self.architecture == "MixtralForCausalLM":  # its experts are the MLP's size
                extra["intermediate_size"] = self.moe_intermediate_size
        return {
            "architectures": [self.architecture], "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias, "hidden_act": self.hidden_act,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types) or None,
            "use_sliding_window": self.sliding_window is not None,
            "max_window_layers": 0, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids), "dtype": self.dtype,
        } | extra


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


def _id_list(value: Any) -> list[int]:
    """A token id field (an int, a list of them, or null) as a list."""
    return list(value) if isinstance(value, list) else [] if value is None else [value]


