"""A GGUF file's model settings (llama.cpp's format, read with its `gguf` package) as the
transformers config.json our ModelConfig reads: the file found, its metadata read once, its
architecture and hyperparameters mapped (`hf_config`). The tensors load in
jaxserve/model/gguf_tensors.py, the tokenizer in jaxserve/text/gguf_tokenizer.py.

The keys read, `{arch}.` before each (llama.cpp's names; docs/DESIGN.md lists them too):
block_count, embedding_length, feed_forward_length, context_length, attention.head_count,
attention.head_count_kv, attention.key_length, attention.layer_norm_rms_epsilon,
rope.freq_base, rope.dimension_count, rope.scaling.{type,factor,original_context_length},
attention.sliding_window, attention.sliding_window_pattern, attention.scale,
attn_logit_softcapping, final_logit_softcapping, expert_count,
expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length,
expert_weights_norm, vocab_size; and tokenizer.ggml.{bos,eos,eot}_token_id.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

# GGUF's architecture -> transformers' (a llama file with experts is Mixtral; Mistral's files
# say llama)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
GEMMA = ("gemma2", "gemma3")
# the float types a file's tensors may hold, as the model's dtype
_FLOAT_TYPES = {0: "float32", 1: "float16", 30: "bfloat16"}  # GGMLQuantizationType values


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one *.gguf in a directory without a
    config.json. None where it is neither (a Hugging Face or orbax directory)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}):"
                         " name the one to serve")
    return files[0] if files else None


def read_gguf(file: str | Path):
    """The `gguf` package's reader of `file`, or a ValueError naming the file and the problem
    (not GGUF, truncated, a tensor type the package does not know). One reader a file (its
    size and time unchanged): opening SmolLM2-135M's takes 3.6 s here (its 49,152 tokens'
    fields), and the config, the tokenizer and the weights each read it."""
    path = Path(file).resolve()
    stat = path.stat() if path.is_file() else None
    return _reader(path, stat and (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _reader(file: Path, _version):
    try:
        from gguf import GGUFReader
    except ImportError as error:  # a dependency; an environment may lack it
        raise ValueError(f"{file}: reading GGUF needs the gguf package (pip install gguf)") \
            from error
    try:
        return GGUFReader(str(file))
    except (ValueError, KeyError, IndexError, OSError, TypeError) as error:
        raise ValueError(f"{file}: not a readable GGUF file ({type(error).__name__}: "
                         f"{error})") from None


def metadata(reader) -> dict[str, Any]:
    """The file's key-value metadata as Python values (arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


# RoPE's factors held as tensors: Llama 3.1's scaling, Phi-3's LongRoPE (short and long)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def hf_config(meta: dict[str, Any], tensors: dict[str, tuple], file: str | Path,
              rope: dict[str, Any] | None = None) -> dict:
    """A transformers config.json for the file's model (`tensors`: name -> (GGUF type value,
    shape as the file lists it, fastest axis first); `rope`: the values of its ROPE_TENSORS).
    A ValueError naming the file and the key where the file lacks what the model needs or
    holds an architecture we do not serve."""
    rope = rope or {}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is KeyError:
            raise ValueError(f"{file}: GGUF metadata lacks {arch}.{key}")
        return value

    layers, hidden = get("block_count"), get("embedding_length")
    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    for key, value in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("feed_forward_length", get("feed_forward_length", 0))):
        if isinstance(value, list):  # llama.cpp allows one a layer; our layers are alike
            raise ValueError(f"{file}: {arch}.{key} differs between layers ({value[:4]}...): "
                             "not supported")
    head_dim = get("attention.key_length", hidden // heads)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{file}: no token_embd.weight tensor")
    vocab = get("vocab_size", None) or embed[1][1]
    tokens = meta.get("tokenizer.ggml.tokens")
    if embed[1][1] != vocab or (tokens is not None and len(tokens) > vocab):
        raise ValueError(f"{file}: the vocabulary does not match the embedding: "
                         f"{len(tokens) if tokens is not None else vocab} tokens, "
                         f"token_embd.weight has {embed[1][1]} rows")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": get("feed_forward_length", 0) or get(
            "expert_feed_forward_length", 0),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)),
        "dtype": _dtype(tensors),
    }
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        hf["partial_rotary_factor"] = rotary / head_dim
    scaling = get("rope.scaling.type", None)
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor"),
                              "original_max_position_embeddings": get(
                                  "rope.scaling.original_context_length", None)}
        if scaling not in ("linear",):
            raise ValueError(f"{file}: {arch}.rope.scaling.type {scaling!r} is not supported "
                             "in GGUF files yet; supported: linear")
    factors = {}
    for name in ROPE_TENSORS:  # one factor a rotary frequency
        if name not in tensors:
            continue
        if name not in rope:
            raise ValueError(f"{file}: {name}'s values are needed for its RoPE")
        factors[name] = [float(x) for x in np.asarray(rope[name], np.float32).reshape(-1)]
        if len(factors[name]) != rotary // 2:
            raise ValueError(f"{file}: {name} has {len(factors[name])} factors; the {rotary} "
                             f"rotary dims have {rotary // 2} frequencies")
    if "rope_freqs.weight" in factors:  # Llama 3.1-3.3's llama3 scaling
        hf["rope_scaling"] = {"rope_type": "frequency_factors",
                              "frequency_factors": factors["rope_freqs.weight"]}
    if "rope_factors_long.weight" in factors or "rope_factors_short.weight" in factors:
        if arch != "phi3" or len(factors) != 2:
            raise ValueError(f"{file}: LongRoPE's factors (rope_factors_short.weight and "
                             "rope_factors_long.weight, both) belong to a phi3 model")
        hf["rope_scaling"] = {"rope_type": "longrope",
                              "short_factor": factors["rope_factors_short.weight"],
                              "long_factor": factors["rope_factors_long.weight"]}
        attention = get("rope.scaling.attn_factor", None)
        if attention is not None:  # else transformers' default from the lengths
            hf["rope_scaling"]["attention_factor"] = attention
    window = get("attention.sliding_window", None)
    if window:
        hf["sliding_window"] = window
        if arch.startswith("qwen"):
            hf["use_sliding_window"] = True
    experts = get("expert_count", 0)
    if experts:
        if arch == "llama":
            hf["architectures"] = ["MixtralForCausalLM"]
            hf["num_local_experts"] = experts
        else:
            hf["num_experts"] = experts
            hf["moe_intermediate_size"] = get("expert_feed_forward_length")
            hf["norm_topk_prob"] = bool(get("expert_weights_norm", arch == "qwen3moe"))
            shared = get("expert_shared_feed_forward_length", 0)
            if shared:
                hf["shared_expert_intermediate_size"] = shared
        hf["num_experts_per_tok"] = get("expert_used_count")
    if arch in GEMMA:
        # attention.scale where the file says it, else llama.cpp's rule: the 27B models scale
        # queries by 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim)
        big = layers == (46 if arch == "gemma2" else 62)
        scale = get("attention.scale", None)
        hf["query_pre_attn_scalar"] = (hidden // heads if big else head_dim) if not scale \
            else round(scale ** -2, 3)
        hf["hidden_activation"] = "gelu_pytorch_tanh"
        hf["attn_logit_softcapping"] = get("attn_logit_softcapping", None)
        hf["final_logit_softcapping"] = get("final_logit_softcapping", None)
        if arch == "gemma3":  # llama.cpp's: every 6th layer global, the local base 10,000
            hf["rope_local_base_freq"] = 10000.0
            hf["sliding_window_pattern"] = 6
        pattern = get("attention.sliding_window_pattern", None)
        if isinstance(pattern, list):  # a layer's true: it slides
            hf["layer_types"] = ["sliding_attention" if p else "full_attention"
                                 for p in pattern]
        elif pattern:
            hf["sliding_window_pattern"] = pattern
    if arch == "phi3" and get("rope.scaling.original_context_length", None):
        hf["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    held = quantization(tensors, bool(experts))
    if held is not None:
        hf["quantization_config"] = held
    _check_positive(hf, file)
    return hf


# GGML's block types the model holds as stored: Q8_0 (int8), Q4_0 (int4, value - 8) and Q4_1
# (uint4 plus a minimum a block); each block 32 weights of a row with a float16 scale
Q8_0, Q4_0, Q4_1 = 8, 2, 3
_LINEAR = re.compile(r"blk\.\d+\.(attn_(q|k|v|output|qkv)|ffn_(gate|up|down))\.weight")


def _held(types: set[int]) -> tuple[str, bool] | None:
    """The narrow type (and whether a minimum a group is needed) that holds every block of
    these types exactly; None: some type is none of the three."""
    if not types or not types <= {Q8_0, Q4_0, Q4_1}:
        return None
    return ("int8" if Q8_0 in types else "int4"), Q4_1 in types


def quantization(tensors: dict[str, tuple], experts: bool) -> dict | None:
    """The quantization_config (config/quant.py's "gguf") of the blocks the model keeps as
    they are: the decoder's linear layers when all are Q8_0, Q4_0 or Q4_1 (not a mixture of
    experts', whose layers are float), the token embedding when it is. Others dequantise to
    the model's dtype as they load."""
    linear = {kind for name, (kind, _) in tensors.items() if _LINEAR.fullmatch(name)}
    weights = None if experts else _held(linear)
    embedding = _held({tensors["token_embd.weight"][0]})
    if weights is None and embedding is None:
        return None
    return {"quant_method": "gguf", "weights": weights and weights[0],
            "offsets": bool(weights and weights[1]), "embedding": embedding and embedding[0],
            "embedding_offsets": bool(embedding and embedding[1])}


def _dtype(tensors: dict[str, tuple]) -> str:
    """The model's dtype: the float type its layers' weights are stored in, bfloat16 where
    they are quantised (as vLLM serves GGUF; "auto" on the CPU computes in float32 where
    memory allows, as transformers dequantises them)."""
    kinds = {kind for name, (kind, _) in tensors.items()
             if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name}
    return _FLOAT_TYPES.get(kinds.pop(), "bfloat16") if len(kinds) == 1 else "bfloat16"


def _check_positive(hf: dict, file) -> None:
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings"):
        value = hf[key]
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{file}: GGUF {key} must be a positive integer, got {value!r}")
    if not (isinstance(hf["rms_norm_eps"], float) and math.isfinite(hf["rms_norm_eps"])):
        raise ValueError(f"{file}: GGUF layer_norm_rms_epsilon must be a number")
