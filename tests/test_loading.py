"""Weight loading (safetensors files, shards and their index, Phi-3's fused tensors), conversion
to orbax and dummy weights, and their error messages. Config parsing: test_config.py."""

import json
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import load_file, save_file
from test_model_hf import full_logits

from jaxserve.cli import main as cli_main
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import is_orbax_checkpoint, load_state

LLAMA_CONFIG = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())


def _copy_model(tmp_path, name="llama"):
    dst = tmp_path / name
    shutil.copytree(HF_FIXTURES / name, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


def test_missing_tensor_is_named(tmp_path):
    path = _copy_model(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    cfg = ModelConfig.from_hf_dir(path)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_state(path, cfg, jnp.float32)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    path = _copy_model(tmp_path)
    cfg = ModelConfig.from_hf_dict(LLAMA_CONFIG | {"intermediate_size": 96})
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has "
                       r"shape \(64, 128\) in the checkpoint but the model expects \(64, 96\)"):
        load_state(path, cfg, jnp.float32)


def test_unexpected_tensor_and_missing_files(tmp_path):
    path = _copy_model(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(
            "'model.layers.0.self_attn.q_norm.weight' in model.safetensors has no place in the "
            "LlamaForCausalLM model")):
        load_state(path, ModelConfig.from_hf_dir(path), jnp.float32)
    with pytest.raises(FileNotFoundError, match=r"no config\.json in model directory"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_state(tmp_path / "empty", ModelConfig.from_hf_dir(path), jnp.float32)


def test_weights_that_are_not_safetensors_name_the_file(tmp_path):
    """A repository cloned without git-lfs holds pointer files where the weights should be."""
    path = _copy_model(tmp_path)
    cfg = ModelConfig.from_hf_dir(path)
    (path / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    with pytest.raises(ValueError, match=r"model\.safetensors: cannot read it as safetensors "
                                         r"\(a git-lfs pointer"):
        load_state(path, cfg, jnp.float32)
    (path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="no 'weight_map'"):
        load_state(path, cfg, jnp.float32)


def test_sharded_checkpoint_loads(tmp_path):
    path = _copy_model(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = ModelConfig.from_hf_dir(path)
    ids = [5, 9, 13]
    a = full_logits(*load_state(path, cfg, jnp.float32), cfg, ids)
    b = full_logits(*load_state(HF_FIXTURES / "llama", cfg, jnp.float32), cfg, ids)
    np.testing.assert_array_equal(a, b)


def test_model_safetensors_is_read_alone_beside_other_safetensors(tmp_path):
    """As transformers: with no index, model.safetensors is the model; an adapter or a
    consolidated copy beside it is not read (its tensors used to have "no place in the
    model"). A directory without model.safetensors still reads every *.safetensors."""
    path = _copy_model(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k != "dtype"}))
    save_file({"base_model.model.lora_A.weight": np.zeros((2, 2), np.float16)},
              str(path / "adapter_model.safetensors"))
    save_file({"tok_embeddings.weight": np.zeros((2, 2), np.float16)},
              str(path / "consolidated.safetensors"))
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.dtype == "float32"  # model.safetensors's dtype, not the adapter's float16
    ids = [5, 9, 13]
    a = full_logits(*load_state(path, cfg, jnp.float32), cfg, ids)
    b = full_logits(*load_state(HF_FIXTURES / "llama", cfg, jnp.float32), cfg, ids)
    np.testing.assert_array_equal(a, b)
    (path / "adapter_model.safetensors").unlink()
    (path / "consolidated.safetensors").unlink()
    (path / "model.safetensors").rename(path / "weights.safetensors")
    np.testing.assert_array_equal(
        full_logits(*load_state(path, cfg, jnp.float32), cfg, ids), b)


def test_shard_missing_from_the_index_is_named(tmp_path):
    path = _copy_model(tmp_path)
    names = sorted(load_file(str(path / "model.safetensors")))
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {name: f"model-0000{1 + (i == 0)}-of-00002.safetensors"
                            for i, name in enumerate(names)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=re.escape(
            "model.safetensors.index.json names shard file(s) missing from ") + r".*: "
            + re.escape("model-00002-of-00002.safetensors")):
        load_state(path, ModelConfig.from_hf_dir(path), jnp.float32)


def test_qwen3_checkpoint_with_attention_bias_loads(tmp_path):
    """attention_bias: q, k, v and o biases, read beside the q/k norms; a missing norm is
    named."""
    path = _copy_model(tmp_path, "qwen3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"attention_bias": True}))
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(0)
    for layer in range(2):
        for proj, size in (("q", 128), ("k", 64), ("v", 64), ("o", 64)):
            tensors[f"model.layers.{layer}.self_attn.{proj}_proj.bias"] = rng.normal(
                size=size).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = ModelConfig.from_hf_dir(path)
    ids = [5, 9, 13]
    biased = full_logits(*load_state(path, cfg, jnp.float32), cfg, ids)
    plain_cfg = ModelConfig.from_hf_dir(HF_FIXTURES / "qwen3")
    plain = full_logits(*load_state(HF_FIXTURES / "qwen3", plain_cfg, jnp.float32), plain_cfg,
                        ids)
    assert np.isfinite(biased).all() and not np.allclose(biased, plain)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): "
                                         r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_state(path, cfg, jnp.float32)


def test_phi3_fused_tensors_are_split_and_a_wrong_shape_is_named(tmp_path):
    """qkv_proj's rows are q, k, v and gate_up_proj's gate, up (test_model_hf holds the logits
    to transformers'); placed (numpy, as for tensor parallelism) they give the same logits; a
    fused tensor of the wrong shape is a ValueError naming it and the rows expected."""
    path = _copy_model(tmp_path, "phi3")
    cfg = ModelConfig.from_hf_dir(path)
    ids = [5, 9, 13, 21]
    want = full_logits(*load_state(path, cfg, jnp.float32), cfg, ids)
    placed = load_state(path, cfg, jnp.float32, place=lambda key, tensor: jnp.asarray(tensor))
    np.testing.assert_array_equal(full_logits(*placed, cfg, ids), want)
    tensors = load_file(str(path / "model.safetensors"))
    good = dict(tensors)
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[qkv] = tensors[qkv][:-16]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(
            f"tensor '{qkv}' has shape (112, 64) in the checkpoint but the model expects "
            "(128, 64) (64 q_proj rows + 32 k_proj rows + 32 v_proj rows)")):
        load_state(path, cfg, jnp.float32)
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    tensors = good | {gate_up: np.ascontiguousarray(good[gate_up].T)}
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(
            f"tensor '{gate_up}' has shape (64, 256) in the checkpoint but the model expects "
            "(256, 64) (128 gate_proj rows + 128 up_proj rows)")):
        load_state(path, cfg, jnp.float32)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi3_longrope"])
def test_convert_to_orbax_and_dummy_weights(tmp_path, name):
    out = tmp_path / "converted"
    assert cli_main(["convert", str(HF_FIXTURES / name), str(out)]) == 0
    assert is_orbax_checkpoint(out)
    cfg = ModelConfig.from_hf_dir(out)
    assert cfg == ModelConfig.from_hf_dir(HF_FIXTURES / name)
    ids = [3, 4, 5, 6, 7]
    a = full_logits(*load_state(out, cfg, jnp.float32), cfg, ids)
    b = full_logits(*load_state(HF_FIXTURES / name, cfg, jnp.float32), cfg, ids)
    np.testing.assert_array_equal(a, b)
    dummy = full_logits(*load_state(None, cfg, jnp.float32, load_format="dummy"), cfg, ids)
    assert np.isfinite(dummy).all() and not np.allclose(dummy, b)
    half = tmp_path / "bf16"  # the written config.json names the dtype written
    assert cli_main(["convert", str(HF_FIXTURES / name), str(half), "--dtype", "bfloat16"]) == 0
    assert ModelConfig.from_hf_dir(half).dtype == "bfloat16"
    # a chat template kept in its own file travels too, and a read-only source's files come
    # out writable (a second convert into the same directory overwrites them)
    source = tmp_path / "with-template"
    shutil.copytree(HF_FIXTURES / name, source)
    (source / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    for file in source.iterdir():
        if file.is_file():
            file.chmod(0o444)
    for _ in range(2):
        assert cli_main(["convert", str(source), str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    assert (out / "chat_template.jinja").stat().st_mode & 0o200  # the owner may write it


def test_a_pool_too_small_for_one_sequence_is_refused():
    from jaxserve import LLM

    with pytest.raises(ValueError, match=r"num_pages 10 holds fewer than the 64 pages one "
                       r"sequence of max_model_len 256 needs"):
        LLM(HF_FIXTURES / "llama", page_size=4, num_pages=10)
    # more top logprobs than the vocabulary has: named, before anything compiles
    with pytest.raises(ValueError, match="max_top_logprobs 200 exceeds the model's vocabulary"):
        LLM(HF_FIXTURES / "llama", max_top_logprobs=200)
