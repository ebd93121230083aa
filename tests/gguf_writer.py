"""Tiny GGUF files for the tests, written by the `gguf` package's writer from our Hugging Face
fixtures (tests/fixtures/hf) as llama.cpp's converter (convert_hf_to_gguf.py) writes real
ones: its architecture names and metadata keys, its tensor names, Llama's query and key rows
interleaved for its RoPE, Gemma's norms stored plus one, the experts stacked, linear layers in
a chosen block type (F32, F16, Q8_0, Q4_0, Q4_1: `gguf.quants.quantize`). Its tokenizer: a
byte-level "gpt2" vocabulary of the model's size, one merge."""

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
        "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_GEMMA_BLOCK = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_NAMES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}


def byte_vocabulary(size: int) -> list[str]:
    """GPT-2's byte-level alphabet's first `size` characters (bytes 33.. as themselves)."""
    chars = [chr(b) for b in range(33, 127)] + [chr(b) for b in range(161, 173)] + [
        chr(b) for b in range(174, 256)]
    chars += [chr(256 + n) for n in range(256 - len(chars))]
    return chars[:size] + [f"<extra_{i}>" for i in range(size - min(size, len(chars)))]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a head's rows (halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama3_factors(theta: float, rotary: int, scaling: dict) -> np.ndarray:
    """Llama 3.1's RoPE scaling as one divisor a frequency: long wavelengths `factor`, short
    ones 1, a smooth blend between (what a GGUF's rope_freqs.weight holds)."""
    freqs = 1.0 / theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(source: Path, out: Path, linear: T = T.F32, embedding: T | None = None,
               types: dict[str, T] | None = None, config: dict | None = None,
               arch: str | None = None) -> Path:
    """`source` (an HF fixture directory) as a GGUF file at `out`: its linear layers' weights
    of type `linear`, the token embedding of `embedding` (F32 when None), the rest F32, and
    `types` GGUF tensor name -> its type; `config` keys over the fixture's config.json; `arch`
    the architecture the file names (default: the model's)."""
    config = json.loads((source / "config.json").read_text()) | (config or {})
    tensors = load_file(str(source / "model.safetensors"))
    named = arch
    arch = ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config.get(
        "num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), named or arch)
    writer.add_name(source.name)
    writer.add_block_count(layers)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(config["vocab_size"])
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if arch != "llama":
            writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)))
    window = config.get("sliding_window")
    if window and (arch.startswith("gemma") or config.get("use_sliding_window")):
        writer.add_sliding_window(window)
    if arch.startswith("gemma"):
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_attention_scale(config["query_pre_attn_scalar"] ** -0.5)
        writer.add_sliding_window_pattern(
            [t == "sliding_attention" for t in config["layer_types"]])
    _tokenizer(writer, config)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "longrope":  # Phi-3's: both lists, as llama.cpp writes them
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        if "attention_factor" in scaling:
            writer.add_rope_scaling_attn_factors(scaling["attention_factor"])
        for kind in ("short", "long"):
            _add(writer, f"rope_factors_{kind}.weight",
                 np.asarray(scaling[f"{kind}_factor"], np.float32), T.F32)
    if kind == "llama3":  # as llama.cpp's converter: a factor a frequency
        rotary = int(head_dim * config.get("partial_rotary_factor", 1.0))
        _add(writer, "rope_freqs.weight", llama3_factors(
            rope.get("rope_theta", config.get("rope_theta", 10000.0)), rotary, scaling), T.F32)
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, value in tensors.items():
        match = _EXPERT.fullmatch(name)
        if match:
            layer, index, proj = match.groups()
            stacks.setdefault((int(layer), _EXPERT_NAMES[proj]), {})[int(index)] = value
            continue
        gguf_name, value = _tensor(name, value, arch, heads, kv_heads)
        kind = embedding if gguf_name == "token_embd.weight" else (
            linear if re.fullmatch(r"blk\.\d+\.(attn_(q|k|v|output|qkv)|ffn_(gate|up|down))"
                                   r"\.weight", gguf_name) else None)
        _add(writer, gguf_name, value, (types or {}).get(gguf_name, kind or T.F32))
    for (layer, proj), by_index in sorted(stacks.items()):
        stack = np.stack([by_index[i] for i in range(len(by_index))])  # [E, out, in]
        _add(writer, f"blk.{layer}.ffn_{proj}_exps.weight", stack, T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _tensor(name: str, value: np.ndarray, arch: str, heads: int, kv_heads: int):
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        out = top[name]
    else:
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        layer, module, leaf = match.groups()
        table = _GEMMA_BLOCK if arch.startswith("gemma") and module in _GEMMA_BLOCK else _BLOCK
        out = f"blk.{layer}.{table[module]}.{leaf}"
        if module == "mlp.shared_expert_gate":  # llama.cpp's is [hidden]
            value = value.reshape(-1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            value = permute(value, heads if module.endswith("q_proj") else kv_heads)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        value = value + np.float32(1.0)
    return out, value


def _add(writer, name: str, value: np.ndarray, kind: T) -> None:
    value = np.ascontiguousarray(value, np.float32)
    if kind == T.F32:
        writer.add_tensor(name, value)
    elif kind == T.F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)


def _tokenizer(writer, config: dict) -> None:
    vocab = config["vocab_size"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = byte_vocabulary(vocab)
    types = [1] * vocab
    for i in (1, 2):  # BOS and EOS: control tokens
        tokens[i], types[i] = ("<s>", "</s>")[i - 1], 3
    tokens[-1] = "$%"  # one merge, of two of the bytes
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["$ %"])
    writer.add_bos_token_id(1)
    eos = config.get("eos_token_id", 2)
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos if eos is not None else 2)
    writer.add_add_bos_token(False)
