"""Config parsing: config.json read as transformers reads it (each family's keys and defaults,
rope scaling and LongRoPE, sliding windows), EngineConfig's options and generation_config.json's
sampling defaults, and their error messages. Weight loading and conversion: test_loading.py."""

import json
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import save_file

from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.engine.model_files import generation_defaults
from jaxserve.model.llama import rope_inv_freq, rope_tables

LLAMA_CONFIG = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())
PHI3_LONGROPE = json.loads((HF_FIXTURES / "phi3_longrope" / "config.json").read_text())


def test_reads_both_config_styles():
    v5 = ModelConfig.from_hf_dir(HF_FIXTURES / "mistral")
    assert "rope_parameters" in json.loads((HF_FIXTURES / "mistral" / "config.json").read_text())
    assert (v5.num_heads, v5.num_kv_heads, v5.head_dim, v5.sliding_window) == (8, 2, 8, 4096)
    v4 = ModelConfig.from_hf_dir(HF_FIXTURES / "llama3")  # rope_theta/rope_scaling/torch_dtype
    assert v4.rope_theta == 500000.0 and v4.rope_scaling.rope_type == "llama3"
    assert v4.rope_scaling.original_max_position_embeddings == 32
    assert v4.tie_word_embeddings and v4.head_dim == 32 and v4.dtype == "float32"
    qwen = ModelConfig.from_hf_dir(HF_FIXTURES / "qwen2")
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    assert not qwen.qk_norm
    qwen3 = ModelConfig.from_hf_dir(HF_FIXTURES / "qwen3")  # layer_types: all full_attention
    assert qwen3.qk_norm and not qwen3.qkv_bias and not qwen3.o_bias
    assert (qwen3.head_dim, qwen3.num_kv_heads, qwen3.sliding_window) == (32, 2, None)
    assert qwen3.tie_word_embeddings
    # the same rope described in the v5 style gives the same frequencies
    hf = json.loads((HF_FIXTURES / "llama3" / "config.json").read_text())
    params = dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta"))
    v5_style = ModelConfig.from_hf_dict(hf | {"rope_parameters": params, "dtype": "float32"})
    np.testing.assert_array_equal(rope_inv_freq(v5_style), rope_inv_freq(v4))
    assert not np.allclose(rope_inv_freq(v4), rope_inv_freq(ModelConfig.from_hf_dict(
        hf | {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})))


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]},
     "architecture 'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "rope type 'yarn' is not supported; supported: default, linear, llama3"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"dtype": "int8"}, "config dtype 'int8' is not supported"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}},
     "quant_method 'bitsandbytes' is not read; supported: compressed-tensors"),
])
def test_unsupported_config_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig.from_hf_dict(LLAMA_CONFIG | change)


def test_config_read_as_transformers_reads_it(tmp_path):
    """Keys that change the model's math are read as transformers reads them, never dropped."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0}
    both = ModelConfig.from_hf_dict(LLAMA_CONFIG | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": llama3})
    assert both.rope_scaling.rope_type == "llama3" and both.rope_theta == 5e5  # scaling wins
    assert both.rope_scaling.original_max_position_embeddings == 256  # the model's length
    with pytest.raises(ValueError, match="'llama3' needs low_freq_factor, high_freq_factor"):
        ModelConfig.from_hf_dict(LLAMA_CONFIG | {"rope_scaling": {"rope_type": "llama3",
                                                                  "factor": 8.0}})
    # Mistral: no sliding_window key is a 4096 window (null: none), no num_key_value_heads 8,
    # and no biases whatever attention_bias says
    mistral = {k: v for k, v in LLAMA_CONFIG.items()
               if k not in ("sliding_window", "num_key_value_heads")} | {
        "architectures": ["MistralForCausalLM"], "num_attention_heads": 8, "attention_bias": True}
    cfg = ModelConfig.from_hf_dict(mistral)
    assert (cfg.sliding_window, cfg.num_kv_heads, cfg.qkv_bias, cfg.o_bias) == (4096, 8, False,
                                                                                False)
    assert ModelConfig.from_hf_dict(mistral | {"sliding_window": None}).sliding_window is None
    # Qwen2 slides only with use_sliding_window, and only the layers from max_window_layers on
    qwen = LLAMA_CONFIG | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                           "sliding_window": 128}
    assert ModelConfig.from_hf_dict(qwen | {"max_window_layers": 0}).sliding_window == 128
    assert ModelConfig.from_hf_dict(qwen).sliding_window is None  # 28 >= its layers
    windowed = ModelConfig.from_hf_dict(qwen | {"max_window_layers": 0})
    assert ModelConfig.from_hf_dict(windowed.to_hf_dict()) == windowed  # jaxserve convert
    assert ModelConfig.from_hf_dict(LLAMA_CONFIG | {"sliding_window": 64}).sliding_window is None
    # a missing key names the key and the file; generation_config's stop ids count
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in LLAMA_CONFIG.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=r"config.json: missing 'hidden_size'"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG | {"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_hf_dir(tmp_path).eos_token_ids == (2, 9)
    # no dtype in config.json: the weights' own
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in LLAMA_CONFIG.items() if k not in ("dtype", "torch_dtype")}))
    save_file({"w": np.zeros(2, np.float16)}, str(tmp_path / "model.safetensors"))
    assert ModelConfig.from_hf_dir(tmp_path).dtype == "float16"


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0}


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": None}},
     "rope_scaling.factor must be a finite number > 0, got None"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "8"}},
     "rope_scaling.factor must be a finite number > 0, got '8'"),
    ({"rope_scaling": LLAMA3_SCALING | {"low_freq_factor": None}},
     "rope_scaling.low_freq_factor must be a finite number > 0, got None"),
    ({"rope_scaling": LLAMA3_SCALING | {"high_freq_factor": "4"}},
     "rope_scaling.high_freq_factor must be a finite number > 0, got '4'"),
    ({"rope_scaling": LLAMA3_SCALING | {"original_max_position_embeddings": 8192.0}},
     "rope_scaling.original_max_position_embeddings must be a positive integer, got 8192.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}},
     "rope_theta must be a finite number > 0, got None"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a finite number > 0, got '1e-6'"),
    ({"rms_norm_eps": True}, "rms_norm_eps must be a finite number > 0, got True"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer, got '2'"),
    ({"head_dim": 16.0}, "head_dim must be a positive integer, got 16.0"),
    ({"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
    ({"intermediate_size": None}, "intermediate_size must be a positive integer, got None"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ({"max_position_embeddings": None},
     "max_position_embeddings must be a positive integer, got None"),
])
def test_malformed_numbers_are_errors_naming_the_field(change, message):
    """A null or a string where a number belongs used to pass here and fail as a TypeError
    inside the model (rope_inv_freq, RMSNorm)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict(LLAMA_CONFIG | change)


def test_absent_keys_take_transformers_defaults_per_architecture():
    """transformers 5's config classes: max_position_embeddings 2048 (Llama), 32768 (Qwen2,
    Qwen3), 131072 (Mistral), 4096 (Phi-3); num_key_value_heads absent: one per head (Llama,
    Phi-3), 32 (Qwen2, Qwen3), 8 (Mistral), and null: one per head for all; rms_norm_eps 1e-6
    (1e-5 for Phi-3), rope_theta 10000."""
    base = {k: v for k, v in LLAMA_CONFIG.items() if k not in (
        "max_position_embeddings", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
        "sliding_window")} | {"num_attention_heads": 32, "head_dim": 16}
    for arch, max_len, kv_heads, eps in (("LlamaForCausalLM", 2048, 32, 1e-6),
                                         ("Qwen2ForCausalLM", 32768, 32, 1e-6),
                                         ("Qwen3ForCausalLM", 32768, 32, 1e-6),
                                         ("MistralForCausalLM", 131072, 8, 1e-6),
                                         ("Phi3ForCausalLM", 4096, 32, 1e-5)):
        hf = base | {"architectures": [arch]}
        cfg = ModelConfig.from_hf_dict(hf)
        assert (cfg.max_position_embeddings, cfg.num_kv_heads, cfg.rms_norm_eps,
                cfg.rope_theta, cfg.rope_scaling) == (max_len, kv_heads, eps, 10000.0, None), arch
        assert ModelConfig.from_hf_dict(hf | {"num_key_value_heads": None}).num_kv_heads == 32
    # Qwen2's 32 is a literal default, not one per head: 4 heads and no key cannot be grouped
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of "
                                         "num_key_value_heads 32"):
        ModelConfig.from_hf_dict(base | {"architectures": ["Qwen2ForCausalLM"],
                                         "num_attention_heads": 4})
    # llama3 rope without original_max_position_embeddings: the model's length, defaulted too
    scaled = ModelConfig.from_hf_dict(base | {"rope_scaling": LLAMA3_SCALING})
    assert scaled.rope_scaling.original_max_position_embeddings == 2048


def test_qwen3_config_read_as_transformers_reads_it():
    """Qwen3Config: q/k norms always; head_dim 128 when absent (not hidden / heads; null:
    hidden / heads, as the other families); attention_bias covers q, k, v and o; the sliding
    window as Qwen2's, and `layer_types`, where given, names the sliding layers."""
    base = LLAMA_CONFIG | {"architectures": ["Qwen3ForCausalLM"]}
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.qk_norm and not (cfg.qkv_bias or cfg.o_bias) and cfg.head_dim == 16
    no_head_dim = {k: v for k, v in base.items() if k != "head_dim"}
    assert ModelConfig.from_hf_dict(no_head_dim).head_dim == 128
    assert ModelConfig.from_hf_dict(base | {"head_dim": None}).head_dim == 16
    biased = ModelConfig.from_hf_dict(base | {"attention_bias": True})
    assert biased.qkv_bias and biased.o_bias
    assert cfg.num_params == ModelConfig.from_hf_dict(
        LLAMA_CONFIG).num_params + 2 * 2 * cfg.head_dim  # two layers' q_norm and k_norm
    # the window: only with use_sliding_window, for the layers from max_window_layers on, or
    # those layer_types names
    sliding = base | {"use_sliding_window": True, "sliding_window": 64}
    assert ModelConfig.from_hf_dict(sliding).sliding_window is None  # 28 >= 2 layers
    assert ModelConfig.from_hf_dict(sliding | {"max_window_layers": 1}).sliding_window == 64
    types = ["full_attention", "sliding_attention"]
    assert ModelConfig.from_hf_dict(sliding | {"layer_types": types}).sliding_window == 64
    assert ModelConfig.from_hf_dict(sliding | {"max_window_layers": 0, "layer_types": [
        "full_attention"] * 2}).sliding_window is None
    assert ModelConfig.from_hf_dict(base | {"sliding_window": 64, "max_window_layers": 0,
                                            "layer_types": types}).sliding_window is None
    windowed = ModelConfig.from_hf_dict(sliding | {"layer_types": types})
    assert ModelConfig.from_hf_dict(windowed.to_hf_dict()) == windowed  # jaxserve convert
    for bad in (["full_attention"], ["full_attention", "chunked_attention"], "sliding"):
        with pytest.raises(ValueError, match="layer_types must list 'full_attention' or "
                                             "'sliding_attention' for each of the 2 layers"):
            ModelConfig.from_hf_dict(sliding | {"layer_types": bad})
    # the window is the sliding layers' alone, and served past it
    assert (windowed.window(0), windowed.window(1), windowed.uniform_layers) == (None, 64, False)
    assert EngineConfig().resolve_max_model_len(windowed) == 256


def test_phi3_config_read_as_transformers_reads_it():
    """Phi3Config: no biases or q/k norms; a sliding window over every layer, none when absent;
    LongRoPE ("su" and "yarn" its old names) with the top-level original_max_position_embeddings
    (4096 when absent), `factor` max / original and the attention factor sqrt(1 + ln factor /
    ln original) when absent, served up to original_max_position_embeddings alone;
    partial_rotary_factor from the rope dict, else the top level."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / "phi3_longrope")  # transformers 4's layout
    scaling = cfg.rope_scaling
    assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.tie_word_embeddings) == (0.75, 12, True)
    assert (scaling.rope_type, scaling.original_max_position_embeddings, scaling.factor) == (
        "longrope", 64, 4.0)
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    assert scaling.short_factor == (1.0, 1.3, 1.9, 2.6, 3.4, 4.5)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm) and cfg.sliding_window is None
    assert rope_inv_freq(cfg).shape == (6,)
    cos, sin = rope_tables(cfg, 2, jnp.float32)  # [2, 12]: position 0 at the attention factor
    assert cos.shape == (2, 12) and np.all(np.asarray(cos[0]) == np.float32(
        scaling.attention_factor)) and not np.asarray(sin[0]).any()
    rope = {k: v for k, v in PHI3_LONGROPE["rope_scaling"].items() if k != "type"}
    v5 = {k: v for k, v in PHI3_LONGROPE.items() if k not in (
        "rope_scaling", "rope_theta", "partial_rotary_factor")} | {"rope_parameters": rope | {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096}}  # Phi-3 reads the top-level one
    assert ModelConfig.from_hf_dict(v5) == cfg
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # jaxserve convert
    assert ModelConfig.from_hf_dict(PHI3_LONGROPE | {"rope_scaling": rope | {"type": "su"}}) == cfg
    given = ModelConfig.from_hf_dict(PHI3_LONGROPE | {"rope_scaling": rope | {
        "type": "longrope", "factor": 2.0, "attention_factor": 1.5}})
    assert (given.rope_scaling.factor, given.rope_scaling.attention_factor) == (2.0, 1.5)
    bare = ModelConfig.from_hf_dict({k: v for k, v in PHI3_LONGROPE.items() if k not in (
        "original_max_position_embeddings", "max_position_embeddings", "rms_norm_eps")})
    assert (bare.rope_scaling.original_max_position_embeddings, bare.rope_scaling.factor,
            bare.rope_scaling.attention_factor, bare.rms_norm_eps) == (4096, 1.0, 1.0, 1e-5)
    plain = ModelConfig.from_hf_dir(HF_FIXTURES / "phi3")  # transformers 5's layout
    assert (plain.rope_scaling, plain.rotary_dim, plain.sliding_window) == (None, 16, None)
    # past original_max_position_embeddings transformers turns the whole sequence by
    # long_factor: refused by name, not served with the short factors
    with pytest.raises(ValueError, match="max_model_len 256 is longer than "
                                         "original_max_position_embeddings 64: past it LongRoPE"):
        EngineConfig().resolve_max_model_len(cfg)
    assert EngineConfig(max_model_len=64).resolve_max_model_len(cfg) == 64
    # a window: every layer's, as Mistral's
    windowed = ModelConfig.from_hf_dict(
        ModelConfig.from_hf_dir(HF_FIXTURES / "phi3").to_hf_dict() | {"sliding_window": 64})
    assert (windowed.sliding_window, windowed.window(1), windowed.uniform_layers) == (64, 64, True)


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope type 'linear' is not supported for Phi3ForCausalLM; supported: default, longrope"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 6}},
     "rope_scaling of type 'longrope' needs short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 6}},
     "rope_scaling.short_factor must have 6 entries (one per frequency of 12 rotary dims), got 8"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": "x"}},
     "rope_scaling.long_factor must be a list of numbers, got 'x'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 5 + [None],
                       "long_factor": [1.0] * 6}},
     "rope_scaling.short_factor must be a finite number > 0, got None"),
    ({"partial_rotary_factor": 0.7},
     "partial_rotary_factor 0.7 rotates 11 of head_dim 16; RoPE needs an even number"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5 rotates 24 of head_dim 16"),
    ({"sliding_window": "64"}, "sliding_window must be a positive integer, got '64'"),
])
def test_unsupported_phi3_config_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict(PHI3_LONGROPE | change)


def test_longrope_is_phi3s_alone():
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported; supported: "
                                         "default, linear, llama3"):
        ModelConfig.from_hf_dict(LLAMA_CONFIG | {"rope_scaling": PHI3_LONGROPE["rope_scaling"]})


def test_sliding_window_shorter_than_max_model_len_is_served():
    cfg = ModelConfig.from_hf_dict(LLAMA_CONFIG | {"architectures": ["MistralForCausalLM"],
                                                   "sliding_window": 64})
    assert EngineConfig().resolve_max_model_len(cfg) == 256
    assert EngineConfig(max_model_len=64).resolve_max_model_len(cfg) == 64
    with pytest.raises(ValueError, match="max_model_len 512 exceeds the model's max_position"):
        EngineConfig(max_model_len=512).resolve_max_model_len(cfg)


def test_engine_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['max_num_seq'\]"):
        EngineConfig.from_overrides(max_num_seq=4)
    with pytest.raises(ValueError, match="batching must be one of"):
        EngineConfig(batching="eager")
    with pytest.raises(ValueError, match="page_size must be a positive integer, got 0"):
        EngineConfig(page_size=0)
    for rows in ((1, 8), (8, 4), (2, 4), (2.0, 8.0)):  # < 2, decreasing, < max_num_seqs, floats
        with pytest.raises(ValueError, match=r"row_buckets must be increasing .* max_num_seqs \(8\)"):
            EngineConfig(max_num_seqs=8, row_buckets=rows)
    assert EngineConfig.from_overrides(max_num_seqs=6, row_buckets=[4, 6]).row_buckets == (4, 6)
    assert EngineConfig(prefill_chunk_sizes=[16, 32]).prefill_chunk_sizes == (16, 32)
    # a YAML scalar or a set: a ValueError naming the field, not a TypeError from inside
    for name, value in (("row_buckets", 8), ("prefill_chunk_sizes", 256),
                        ("prefill_chunk_sizes", {16, 32})):
        with pytest.raises(ValueError, match=f"{name} must be a list of integers, got"):
            EngineConfig(**{name: value})
    # a prompt chunk feeds 2 or more tokens: a size of 1 used to pass here and fail after loading
    with pytest.raises(ValueError, match=r"prefill_chunk_sizes must be increasing sizes of at "
                                         r"least 2 .*got \(1, 8\)"):
        EngineConfig(prefill_chunk_sizes=(1, 8))
    assert EngineConfig(max_num_seqs=6).decode_row_buckets() == (2, 4, 8)


def test_generation_config_gives_the_default_sampling_params(tmp_path, caplog):
    """As vLLM's generation_config="auto": temperature, top_p, top_k and max_new_tokens are the
    defaults of a request that leaves them out; what the sampler would refuse, or has no
    equivalent for, is left out with a warning."""
    assert generation_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 5, "max_new_tokens": 32,
        "eos_token_id": [1, 2]}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 5,
                                             "max_tokens": 32}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": -1, "repetition_penalty": 1.1, "top_p": 1.0}))
    assert generation_defaults(tmp_path) == {"top_p": 1.0}
    assert "ignoring temperature" in caplog.text and "repetition_penalty 1.1" in caplog.text


def test_a_machine_without_an_accelerator_asks_jax_for_the_cpu_alone():
    """With the CUDA plugin and libtpu installed (the test extras) and no GPU or TPU attached,
    jaxserve asks jax for the CPU when JAX_PLATFORMS is unset: no plugin's error or traceback
    on every command; JAX_PLATFORMS set is left as it is."""
    import os
    import subprocess
    import sys

    from jaxserve.config.platform import has_accelerator

    if has_accelerator():  # (a machine with one keeps jax's own choice: nothing to check)
        return
    code = ("import jaxserve, jax, os; "
            "print(repr(os.environ['JAX_PLATFORMS']), jax.default_backend())")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["'cpu'", "cpu"]
    assert "Traceback" not in out.stderr and "Unable to load CUDA" not in out.stderr
    out = subprocess.run([sys.executable, "-c", code], env=env | {"JAX_PLATFORMS": ""},
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["''", "cpu"]  # every platform jax finds, as asked
