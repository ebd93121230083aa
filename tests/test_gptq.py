"""GPTQ checkpoints (quant_method "gptq": AutoGPTQ's and GPTQModel's layout), read into
QuantizedLinear layers: 4- and 8-bit symmetric weights, scales per group of input rows or per
column, the "gptq" (zero points stored minus one) and "gptq_v2" formats.

No GPTQ tool runs here, so `write_gptq` lays the float llama fixture's weights out in the
format as its description gives it (round-to-nearest where GPTQ would use its Hessian: the
layout is what a loader reads), and writes beside it the float twin: the same model with each
layer's weights dequantised in numpy, scale x (value - zero), from the stored integers and the
float16 scales. The twin is the reference: the engine on the GPTQ checkpoint gives its logits
and greedy ids, on the XLA and the CPU backends."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import load_file, save_file
from test_model_hf import full_logits

from jaxserve import LLM, SamplingParams
from jaxserve.model.loader import load_state
from jaxserve.model_config import ModelConfig

SOURCE = HF_FIXTURES / "llama"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned `bits`-bit values packed into int32 words along `axis`, the first value in
    the lowest bits."""
    per_word = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    v = v.reshape(v.shape[0] // per_word, per_word, *v.shape[1:])
    words = np.zeros(v.shape[:1] + v.shape[2:], np.uint32)
    for k in range(per_word):
        words |= v[:, k] << np.uint32(bits * k)
    return np.moveaxis(words.view(np.int32), 0, axis)


def write_gptq(path: Path, bits: int = 4, group_size: int = 32, fmt: str = "gptq",
               config_file: str = "config.json") -> Path:
    """The llama fixture as a GPTQ checkpoint at `path`, its float twin at path / "twin"."""
    tensors = load_file(str(SOURCE / "model.safetensors"))
    gptq, twin = {}, dict(tensors)
    maxq, zero = 2**bits - 1, 2 ** (bits - 1)
    for name, w in tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR:
            continue
        stem = name[: -len(".weight")]
        wt = w.T.astype(np.float32)  # [in, out]
        rows, columns = wt.shape
        group = rows if group_size == -1 else group_size
        absmax = np.abs(wt).reshape(rows // group, group, columns).max(axis=1)
        scales = (2 * absmax / maxq).astype(np.float16)  # GPTQ's symmetric (xmax - xmin) / maxq
        scales[scales == 0] = 1
        full = np.repeat(scales.astype(np.float32), group, axis=0)
        q = np.clip(np.round(wt / full) + zero, 0, maxq).astype(np.int64)
        stored_zero = zero - 1 if fmt == "gptq" else zero
        gptq[f"{stem}.qweight"] = pack(q, bits, axis=0)
        gptq[f"{stem}.qzeros"] = pack(np.full((rows // group, columns), stored_zero), bits, 1)
        gptq[f"{stem}.scales"] = scales
        gptq[f"{stem}.g_idx"] = (np.arange(rows) // group).astype(np.int32)
        twin[name] = ((q - zero).astype(np.float32) * full).T
    for name, w in tensors.items():
        if name.split(".")[-2] not in LINEAR:
            gptq[name] = w
    for where, weights in ((path, gptq), (path / "twin", twin)):
        where.mkdir(parents=True)
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},  # its bytes as laid
                  str(where / "model.safetensors"))
        for file in ("config.json", "generation_config.json"):
            shutil.copyfile(SOURCE / file, where / file)
    quant = {"bits": bits, "group_size": group_size, "desc_act": False, "sym": True,
             "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}
    if config_file == "config.json":
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq"} | quant
        (path / "config.json").write_text(json.dumps(config))
    else:  # older checkpoints: quantize_config.json beside a plain config.json
        (path / config_file).write_text(json.dumps(quant))
    return path


def prompts() -> list[list[int]]:
    return json.loads((SOURCE / "expected.json").read_text())["prompts"]


@pytest.mark.parametrize(("bits", "group_size", "fmt", "config_file"), [
    (4, 32, "gptq", "config.json"), (4, -1, "gptq", "config.json"),
    (8, 32, "gptq_v2", "config.json"), (4, 64, "gptq", "quantize_config.json")])
def test_a_gptq_checkpoint_gives_its_dequantised_twins_logits(tmp_path, bits, group_size, fmt,
                                                              config_file):
    path = write_gptq(tmp_path / "gptq", bits, group_size, fmt, config_file)
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.quantization == ("int4" if bits == 4 else "int8")
    assert cfg.quantization_group_size == (None if group_size == -1 else group_size)
    graphdef, state = load_state(path, cfg, jnp.float32)
    twin_cfg = ModelConfig.from_hf_dir(path / "twin")
    twin = load_state(path / "twin", twin_cfg, jnp.float32)
    for ids in prompts():
        np.testing.assert_allclose(full_logits(graphdef, state, cfg, ids),
                                   full_logits(*twin, twin_cfg, ids), atol=1e-5, rtol=0)


def test_the_engine_on_a_gptq_checkpoint_gives_its_twins_greedy_ids(tmp_path):
    """The CPU backend (group-wise layers dequantised before its matmul: the twin's weights
    bit for bit) and XLA's (qwix's dot): the twin's ids, logprobs equal on the CPU."""
    path = write_gptq(tmp_path / "gptq")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    engine = dict(max_num_seqs=4, page_size=8, num_pages=80, prefill_chunk_sizes=(16,),
                  max_num_batched_tokens=32, enable_prompt_logprobs=False)
    batch = [{"prompt_token_ids": ids} for ids in prompts()]
    twin = LLM(path / "twin", **engine).generate(batch, params)
    for options in ({}, {"matmul_impl": "xla", "attention_impl": "reference"}):
        outs = LLM(path, **engine, **options).generate(batch, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in twin]
        if not options:
            assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in twin]


def test_gptq_checkpoints_jaxserve_does_not_read_are_clear_errors(tmp_path):
    path = write_gptq(tmp_path / "gptq")
    config = json.loads((path / "config.json").read_text())
    for change, words in (({"desc_act": True}, "desc_act true"),
                          ({"sym": False}, "sym false"), ({"bits": 3}, "bits 3"),
                          ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'")):
        edited = tmp_path / f"edited{len(words)}"
        shutil.copytree(path, edited)
        (edited / "config.json").write_text(json.dumps(
            config | {"quantization_config": config["quantization_config"] | change}))
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_hf_dir(edited)
    # the tensors themselves: act-order rows, asymmetric zero points
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    for key, value, words in (
            (f"{name}.g_idx", tensors[f"{name}.g_idx"][::-1].copy(), "act-order"),
            (f"{name}.qzeros", tensors[f"{name}.qzeros"] + 1, "asymmetric")):
        broken = tmp_path / f"broken_{key.rsplit('.', 1)[1]}"
        shutil.copytree(path, broken)
        save_file(tensors | {key: np.ascontiguousarray(value)},
                  str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=words):
            load_state(broken, ModelConfig.from_hf_dir(broken), jnp.float32)
