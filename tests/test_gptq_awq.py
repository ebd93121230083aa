"""GPTQ checkpoints (quant_method "gptq": AutoGPTQ's and GPTQModel's layout) and AWQ ones
(quant_method "awq": AutoAWQ's GEMM layout), read into QuantizedLinear layers: 4- and 8-bit
weights, scales per group of input rows or per column, GPTQ's symmetric weights (the "gptq"
format's zero points stored minus one, "gptq_v2"'s as they are) and 4-bit weights with zero
points (GPTQ sym false; AWQ), held as value - zero; GPTQ's act-order (desc_act: each group's
rows scattered over the input, a row's group its g_idx).

No GPTQ or AWQ tool runs here, so `write_packed` lays the float llama fixture's weights out in
each format as its description gives it (round-to-nearest where GPTQ and AWQ would search: the
layout is what a loader reads), and writes beside it the float twin: the same model with each
layer's weights dequantised in numpy, scale x (value - zero), from the stored integers and the
float16 scales. The twin is the reference: the engine on the checkpoint gives its logits and
greedy ids, on the XLA and the CPU backends."""

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
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import load_state
from jaxserve.model.quant import array_bytes
from jaxserve.parallel.sharding import check_tensor_parallel

SOURCE = HF_FIXTURES / "llama"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's: word bits 4k hold the word's column AWQ_ORDER[k]


def pack(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Unsigned `bits`-bit values packed into int32 words along `axis`, the first value in
    the lowest bits (`order`: word bits bits * k hold the word's value order[k])."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    v = v.reshape(v.shape[0] // per_word, per_word, *v.shape[1:])
    words = np.zeros(v.shape[:1] + v.shape[2:], np.uint32)
    for k in range(per_word):
        words |= v[:, order[k]] << np.uint32(bits * k)
    return np.moveaxis(words.view(np.int32), 0, axis)


def write_packed(path: Path, method: str = "gptq", bits: int = 4, group_size: int = 32,
                 fmt: str = "gptq", sym: bool = True, config_file: str = "config.json",
                 act_order: bool = False) -> Path:
    """The llama fixture as a GPTQ or AWQ checkpoint at `path`, its float twin at path /
    "twin". Symmetric: scale 2 absmax / maxq, zero 2^(bits - 1); with zero points: scale
    (max - min) / maxq over the group and 0, zero round(-min / scale). act_order (GPTQ): each
    group a random set of group_size rows (g_idx), as desc_act's order of the rows by their
    activations scatters them."""
    tensors = load_file(str(SOURCE / "model.safetensors"))
    packed, twin = {}, dict(tensors)
    maxq = 2**bits - 1
    awq = method == "awq"
    for name, w in tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR:
            continue
        stem = name[: -len(".weight")]
        wt = w.T.astype(np.float32)  # [in, out]
        rows, columns = wt.shape
        group = rows if group_size == -1 else group_size
        g_idx = np.arange(rows) // group  # each row's group
        if act_order:
            g_idx[np.random.default_rng(rows + columns).permutation(rows)] = g_idx.copy()
        grouped = wt[np.argsort(g_idx, kind="stable")].reshape(rows // group, group, columns)
        if sym:
            scales = 2 * np.abs(grouped).max(axis=1) / maxq
            zeros = np.full(scales.shape, 2 ** (bits - 1))
        else:
            low, high = np.minimum(grouped.min(axis=1), 0), np.maximum(grouped.max(axis=1), 0)
            scales = (high - low) / maxq
        scales = scales.astype(np.float16)  # as both store them
        scales[scales == 0] = 1
        full = scales.astype(np.float32)[g_idx]  # [rows, columns]: each row's group's
        if not sym:
            zeros = np.clip(np.round(-low / scales.astype(np.float32)), 0, maxq)
        zeros = zeros.astype(np.int64)
        q = np.clip(np.round(wt / full) + zeros[g_idx], 0, maxq)
        q = q.astype(np.int64)
        if awq:
            packed[f"{stem}.qweight"] = pack(q, bits, 1, AWQ_ORDER)
            packed[f"{stem}.qzeros"] = pack(zeros, bits, 1, AWQ_ORDER)
        else:
            packed[f"{stem}.qweight"] = pack(q, bits, 0)
            packed[f"{stem}.qzeros"] = pack(zeros - (fmt == "gptq"), bits, 1)
            packed[f"{stem}.g_idx"] = g_idx.astype(np.int32)
        packed[f"{stem}.scales"] = scales
        twin[name] = ((q - zeros[g_idx]).astype(np.float32) * full).T
    for name, w in tensors.items():
        if name.split(".")[-2] not in LINEAR:
            packed[name] = w
    for where, weights in ((path, packed), (path / "twin", twin)):
        where.mkdir(parents=True)
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},  # its bytes as laid
                  str(where / "model.safetensors"))
        for file in ("config.json", "generation_config.json"):
            shutil.copyfile(SOURCE / file, where / file)
    quant = ({"bits": bits, "group_size": group_size, "zero_point": True, "version": "GEMM"}
             if awq else {"bits": bits, "group_size": group_size, "desc_act": act_order,
                          "sym": sym, "checkpoint_format": fmt, "damp_percent": 0.01})
    if config_file == "config.json":
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method} | quant
        (path / "config.json").write_text(json.dumps(config))
    else:  # older GPTQ checkpoints: quantize_config.json beside a plain config.json
        (path / config_file).write_text(json.dumps(quant))
    return path


def prompts() -> list[list[int]]:
    return json.loads((SOURCE / "expected.json").read_text())["prompts"]


@pytest.mark.parametrize(("method", "bits", "group_size", "fmt", "sym", "config_file"), [
    ("gptq", 4, 32, "gptq", True, "config.json"), ("gptq", 4, -1, "gptq", True, "config.json"),
    ("gptq", 8, 32, "gptq_v2", True, "config.json"),
    ("gptq", 4, 64, "gptq", True, "quantize_config.json"),
    ("gptq", 4, 32, "gptq", False, "config.json"), ("gptq", 4, 32, "gptq_v2", False, "config.json"),
    ("gptq", 4, -1, "gptq_v2", False, "config.json"), ("awq", 4, 32, "awq", False, "config.json"),
    ("awq", 4, -1, "awq", False, "config.json")])
def test_a_checkpoint_gives_its_dequantised_twins_logits(tmp_path, method, bits, group_size,
                                                         fmt, sym, config_file):
    path = write_packed(tmp_path / method, method, bits, group_size, fmt, sym, config_file)
    cfg = ModelConfig.from_hf_dir(path)
    # 4-bit weights with zero points: uint4 values and zero points, but the "gptq" format's
    # (stored minus one: a zero of 0 reads back as 16), held as value - zero in int8
    apart = bits == 4 and not sym and fmt != "gptq"
    assert cfg.quantization == ("int4" if bits == 4 and (sym or apart) else "int8")
    assert cfg.quantization_group_size == (None if group_size == -1 else group_size)
    graphdef, state = load_state(path, cfg, jnp.float32)
    layer = state["model"]["layers"][0]["mlp"]["down_proj"]
    assert (layer["kernel"][...].dtype == jnp.uint4) == apart
    if apart:  # half a byte a weight, the zero points beside the scales
        kernel = layer["kernel"][...]
        zero = layer["zero" if group_size == -1 else "group_zero"][...]
        assert zero.dtype == jnp.uint4 and zero.shape[-1] == kernel.shape[1]
        assert array_bytes(kernel.shape, kernel.dtype) * 2 == kernel.size  # as the plan counts
    twin_cfg = ModelConfig.from_hf_dir(path / "twin")
    twin = load_state(path / "twin", twin_cfg, jnp.float32)
    for ids in prompts():
        np.testing.assert_allclose(full_logits(graphdef, state, cfg, ids),
                                   full_logits(*twin, twin_cfg, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_engine_on_a_checkpoint_gives_its_twins_greedy_ids(tmp_path, method):
    """The CPU backend (group-wise layers dequantised before its matmul: the twin's weights
    bit for bit) and XLA's (qwix's dot): the twin's ids, logprobs equal on the CPU. GPTQ
    symmetric (int4), AWQ with zero points (uint4 and its zero points)."""
    path = write_packed(tmp_path / method, method, sym=method == "gptq",
                        fmt="awq" if method == "awq" else "gptq")
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


@pytest.mark.parametrize("sym", [True, False])
def test_an_act_order_checkpoint_gives_its_twins_logits_and_ids(tmp_path, sym):
    """GPTQ desc_act: the kernel holds the rows sorted by group and the layer gathers its
    input in that order (QuantizedLinear.input_order): the twin's logits through the model,
    and the engine's greedy ids on the CPU backend and XLA's (the logprobs within float
    rounding: the matmul sums the rows in the kernel's order, not the twin's)."""
    path = write_packed(tmp_path / "gptq", sym=sym, act_order=True)
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.quantization_act_order and cfg.quantization_group_size == 32
    graphdef, state = load_state(path, cfg, jnp.float32)
    twin_cfg = ModelConfig.from_hf_dir(path / "twin")
    twin = load_state(path / "twin", twin_cfg, jnp.float32)
    g_idx = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.g_idx"]
    order = np.asarray(state["model"]["layers"][0]["self_attn"]["q_proj"]["input_order"][...])
    assert not np.array_equal(order, np.arange(len(order)))  # scattered groups, read in order
    assert np.array_equal(g_idx[order], np.sort(g_idx))
    for ids in prompts():
        np.testing.assert_allclose(full_logits(graphdef, state, cfg, ids),
                                   full_logits(*twin, twin_cfg, ids), atol=1e-5, rtol=0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    engine = dict(max_num_seqs=4, page_size=8, num_pages=80, prefill_chunk_sizes=(16,),
                  max_num_batched_tokens=32, enable_prompt_logprobs=False)
    batch = [{"prompt_token_ids": ids} for ids in prompts()]
    want = LLM(path / "twin", **engine).generate(batch, params)
    for options in ({}, {"matmul_impl": "xla", "attention_impl": "reference"}):
        outs = LLM(path, **engine, **options).generate(batch, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        for out, ref in zip(outs, want, strict=True):
            np.testing.assert_allclose(
                [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs,
                                                out.outputs[0].token_ids, strict=True)],
                [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs,
                                                ref.outputs[0].token_ids, strict=True)],
                atol=1e-4)


def test_checkpoints_jaxserve_does_not_read_are_clear_errors(tmp_path):
    path = write_packed(tmp_path / "gptq")
    config = json.loads((path / "config.json").read_text())
    for change, words in (({"bits": 3}, "bits 3"),
                          ({"bits": 8, "sym": False}, "8-bit weights with zero points"),
                          ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
                          ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
                          ({"quant_method": "awq", "zero_point": False}, "zero_point false")):
        edited = tmp_path / f"edited{len(words)}"
        shutil.copytree(path, edited)
        (edited / "config.json").write_text(json.dumps(
            config | {"quantization_config": config["quantization_config"] | change}))
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_hf_dir(edited)
    # the tensors themselves: scattered rows where desc_act is false, asymmetric zero points
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    for key, value, words in (
            (f"{name}.g_idx", tensors[f"{name}.g_idx"][::-1].copy(), "desc_act false"),
            (f"{name}.qzeros", tensors[f"{name}.qzeros"] + 1, "sym true")):
        broken = tmp_path / f"broken_{key.rsplit('.', 1)[1]}"
        shutil.copytree(path, broken)
        save_file(tensors | {key: np.ascontiguousarray(value)},
                  str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=words):
            load_state(broken, ModelConfig.from_hf_dir(broken), jnp.float32)
    # act-order: a g_idx whose groups are not group_size rows each, or none at all; more than
    # one device per replica
    ordered = write_packed(tmp_path / "ordered", act_order=True)
    tensors = load_file(str(ordered / "model.safetensors"))
    uneven = tensors[f"{name}.g_idx"].copy()
    uneven[uneven == 1] = 0
    for change, words in (({f"{name}.g_idx": uneven}, "g_idx must give each"),
                          ({}, f"missing {name}.g_idx")):
        broken = tmp_path / f"ordered_{len(change)}"
        shutil.copytree(ordered, broken)
        kept = {k: v for k, v in tensors.items() if change or k != f"{name}.g_idx"}
        save_file(kept | change, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=words):
            load_state(broken, ModelConfig.from_hf_dir(broken), jnp.float32)
    with pytest.raises(ValueError, match="act-order"):
        check_tensor_parallel(ModelConfig.from_hf_dir(ordered), 2, 2)
    # an AWQ layer without its zero points
    awq = write_packed(tmp_path / "awq", "awq", sym=False, fmt="awq")
    tensors = load_file(str(awq / "model.safetensors"))
    del tensors[f"{name}.qzeros"]
    save_file(tensors, str(awq / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"missing .*{name}\.qzeros"):
        load_state(awq, ModelConfig.from_hf_dir(awq), jnp.float32)
