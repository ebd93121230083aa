"""Weight-only quantisation (quantization="int8" | "fp8" | "int4") and the fp8 KV pool
(kv_cache_dtype="fp8"): the scales' error bound, the dequantised twin, the bytes, batch
invariance on the CPU kernels, and quality against the independent references (stories260K's C
implementation, transformers on compressed-tensors checkpoints, the demo's held-out text)."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from safetensors.numpy import load_file
from test_model_hf import full_logits

from jaxserve import LLM, SamplingParams
from jaxserve.backends import REFERENCE
from jaxserve.backends.cpu import CpuOps
from jaxserve.backends.select import fp8_matmul_capable
from jaxserve.config.engine import EngineConfig, kv_cache_dtype
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import load_state, state_bytes
from jaxserve.model.quant import QuantizedLinear, dequantize, quantize_weight
from jaxserve.tools.plan import plan

METHODS = ("int8", "fp8", "int4")
EIGHT_BITS = ("int8", "fp8")  # the quality goals' (int4 is measured by bench/quantization.py)
# what a column's absmax maps to (qwix: int8's whole range, -128..127, hence 127.5; int4's
# -8..7, 7.5)
QMAX = {"int8": 127.5, "fp8": 448.0, "int4": 7.5}
BITS = {"int8": 8, "fp8": 8, "int4": 4}


def _element_bound(w: np.ndarray, scale: np.ndarray, method: str) -> np.ndarray:
    """How far a weight may move when quantised, from its column's scale: half a step of
    int8 or int4; for e4m3 (3 mantissa bits) 2^-4 of its magnitude, or half its smallest subnormal
    step (2^-9 of the scale)."""
    if method in ("int8", "int4"):
        return np.broadcast_to(scale / 2, w.shape)
    return np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10)


@pytest.mark.parametrize("method", METHODS)
def test_quantised_weights_stay_within_their_scales_bound(method):
    w = np.array(jax.random.normal(jax.random.key(0), (96, 80)) * 0.05)
    w[:, 3] = 0.0  # a column of zeros: scale 1, zeros back
    w[5, 7] = 2.0  # an outlier sets its column's scale
    q, scale = quantize_weight(jnp.asarray(w), method)
    q, scale = np.asarray(q.astype(jnp.float32)), np.asarray(scale)
    assert scale.shape == (80,) and scale.dtype == np.float32
    np.testing.assert_allclose(scale[7], 2.0 / QMAX[method], rtol=1e-6)
    assert np.all(np.abs(q).max(axis=0)[np.arange(80) != 3] >= math.floor(QMAX[method]))
    error = np.abs(q * scale - w)
    assert np.all(error <= _element_bound(w, scale, method) * (1 + 2e-5))
    assert np.all(q[:, 3] == 0)


def _linear_pair(method: str, in_features=72, out_features=136, bias=True):
    """A float32 nnx.Linear and its quantised twin (QuantizedLinear)."""
    full = nnx.Linear(in_features, out_features, use_bias=bias, rngs=nnx.Rngs(1),
                      kernel_init=nnx.initializers.normal(0.05),
                      bias_init=nnx.initializers.normal(0.05))
    quant = QuantizedLinear(in_features, out_features, bias, jnp.float32, method)
    q, scale = quantize_weight(full.kernel[...], method)
    quant.kernel.set_value(q)
    quant.scale.set_value(scale)
    if bias:
        quant.bias.set_value(full.bias[...])
    return full, quant


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ops", [REFERENCE.ops, CpuOps()], ids=["xla", "cpu"])
def test_a_quantised_layer_is_within_the_bound_its_scales_give(method, ops):
    """|x @ w - x @ q * scale| <= sum_k |x_k| * bound(w_kj): per element and per backend
    (qwix's dot on XLA; the C++ kernel reading the narrow weights, in place and packed)."""
    full, quant = _linear_pair(method)
    x = jax.random.normal(jax.random.key(2), (5, 3, 72))
    exact = np.asarray(full(x))
    w, scale = np.asarray(full.kernel[...]), np.asarray(quant.scale[...])
    bound = np.abs(np.asarray(x)) @ _element_bound(w, scale, method) + 1e-5
    got = np.asarray(ops.linear(quant, x))
    assert got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= bound)
    # and it is the product with the dequantised weights, to float32 rounding
    twin = np.asarray(x) @ np.asarray(dequantize(quant.kernel[...], quant.scale[...])) + \
        np.asarray(full.bias[...])
    np.testing.assert_allclose(got, twin, atol=2e-6, rtol=1e-5)
    if isinstance(ops, CpuOps):  # the packed panels the engine stores: the same bits
        graphdef, state = ops.pack_weights(*nnx.split(quant))
        packed = nnx.merge(graphdef, state)
        assert packed.kernel[...].ndim == 3
        np.testing.assert_array_equal(np.asarray(ops.linear(packed, x)), got)


def test_fp8_weights_times_fp8_activations_stay_within_the_activations_bound():
    """Ops(native_fp8=True), the GPUs that multiply fp8 by fp8 (select.py): each row of x
    scaled into e4m3 by its own largest magnitude and multiplied in one fp8 x fp8 dot. Off the
    weight-only product by at most what rounding x to e4m3 moves it, sum_k bound(x_k) *
    |w_kj| (rows a million apart in magnitude each keep their precision); other layers, and
    fp8 layers with group scales, take the weight-only product."""
    _, quant = _linear_pair("fp8")
    x = np.array(jax.random.normal(jax.random.key(3), (4, 5, 72)))
    x[0, 0] *= 1e3
    x[1, 2] *= 1e-3
    x[2, 1] = 0.0
    weight_only = np.asarray(REFERENCE.ops.linear(quant, jnp.asarray(x)))
    native = dataclasses.replace(REFERENCE.ops, native_fp8=True)
    got = np.asarray(native.linear(quant, jnp.asarray(x)))
    w = np.abs(np.asarray(dequantize(quant.kernel[...], quant.scale[...])))
    row_scale = np.abs(x).max(axis=-1, keepdims=True) / 448.0
    x_bound = np.maximum(np.abs(x) * 2.0**-4, row_scale * 2.0**-10)
    bound = x_bound @ w + 1e-5 * (np.abs(x) @ w) + 1e-6
    assert np.all(np.abs(got - weight_only) <= bound)
    assert np.abs(got - weight_only).max() > 1e-4  # the activations were rounded
    np.testing.assert_array_equal(got[2, 1], np.asarray(quant.bias[...]))  # a zero row
    hlo = jax.jit(native.linear).lower(quant, jnp.asarray(x)).as_text()
    assert re.search(r"dot_general.*\(tensor<[0-9x]+xf8E4M3FN>, tensor<[0-9x]+xf8E4M3FN>\)",
                     hlo), "one fp8 x fp8 dot"
    _, int8 = _linear_pair("int8")
    np.testing.assert_array_equal(np.asarray(native.linear(int8, jnp.asarray(x))),
                                  np.asarray(REFERENCE.ops.linear(int8, jnp.asarray(x))))
    grouped = QuantizedLinear(72, 136, False, jnp.float32, "fp8", group_size=24)
    grouped.kernel.set_value(quant.kernel[...])
    assert not grouped.takes_fp8_activations
    np.testing.assert_array_equal(np.asarray(native.linear(grouped, jnp.asarray(x))),
                                  np.asarray(REFERENCE.ops.linear(grouped, jnp.asarray(x))))
    # packed for it, the fp8 kernel is held [out, in] (int8 ones as they were): the same
    # product, the same dequantised weights
    graphdef, state = native.pack_weights(*nnx.split(nnx.List([quant, int8])))
    packed_fp8, packed_int8 = nnx.merge(graphdef, state)
    assert packed_fp8.out_major and packed_fp8.kernel[...].shape == (136, 72)
    assert not packed_int8.out_major and packed_int8.kernel[...].shape == (72, 136)
    np.testing.assert_allclose(np.asarray(native.linear(packed_fp8, jnp.asarray(x))), got,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(packed_fp8.dequantized()), np.asarray(
        _linear_pair("fp8")[1].dequantized()))
    np.testing.assert_allclose(np.asarray(packed_fp8(jnp.asarray(x))), weight_only,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("capability", "native"), [
    ("9.0", True), ("8.9", True), ("10.0", True), ("8.6", False), ("8.0", False),
    ("gfx942", False), (None, False)])
def test_fp8_matmuls_are_native_from_compute_capability_8_9(capability, native):
    assert fp8_matmul_capable(capability) is native


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_a_quantised_model_is_its_dequantised_twin(name, method):
    """Every linear layer quantised as it loads (qwen2: with biases; phi3: fused tensors
    split first); the logits are those of the float32 model whose weights are the dequantised
    ones, and the embedding and LM head are the checkpoint's own."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    qcfg = dataclasses.replace(cfg, quantization=method)
    qgraph, qstate = load_state(HF_FIXTURES / name, qcfg, jnp.float32)
    graph, state = load_state(HF_FIXTURES / name, cfg, jnp.float32)
    qmodel, model = nnx.merge(qgraph, qstate), nnx.merge(graph, state)
    layers = 0
    for (path, qlayer), (_, layer) in zip(nnx.iter_modules(qmodel), nnx.iter_modules(model),
                                          strict=True):
        if isinstance(qlayer, QuantizedLinear):
            layers += 1
            layer.kernel.set_value(dequantize(qlayer.kernel[...], qlayer.scale[...]))
        elif isinstance(layer, nnx.Linear | nnx.Embed):
            assert "lm_head" in path or "embed_tokens" in path
    assert layers == 7 * cfg.num_layers
    twin_graph, twin_state = nnx.split(model)
    ids = json.loads((HF_FIXTURES / name / "expected.json").read_text())["prompts"][0]
    np.testing.assert_allclose(full_logits(qgraph, qstate, qcfg, ids),
                               full_logits(twin_graph, twin_state, cfg, ids),
                               atol=2e-5, rtol=0)


@pytest.fixture(scope="module")
def llama_engines():
    """The CPU backend's engines on the tiny Llama: float32, int8 and fp8."""
    return {method: LLM(HF_FIXTURES / "llama", quantization=method, max_num_seqs=4,
                        max_num_batched_tokens=64, num_pages=80, page_size=4,
                        prefill_chunk_sizes=(16,))
            for method in (None, *METHODS)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantised_weights_take_a_byte_an_element_int4_half(dtype):
    """Read from the arrays: each linear layer's weights one byte an element (a quarter of
    float32's, half of bfloat16's; int4 half a byte, as an accelerator holds it) plus a
    float32 scale per column; the embedding and the LM head as they were. `jaxserve plan`
    reports the same bytes."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / "llama")
    full = state_bytes(load_state(HF_FIXTURES / "llama", cfg, dtype, "dummy")[1])
    linear = cfg.num_layers * (cfg.hidden_size * cfg.head_dim * (
        2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * cfg.hidden_size * cfg.intermediate_size)
    columns = cfg.num_layers * (cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads)
                                + 2 * cfg.hidden_size + 2 * cfg.intermediate_size)
    width = jnp.dtype(dtype).itemsize
    for method in METHODS:
        qcfg = dataclasses.replace(cfg, quantization=method)
        _, state = load_state(HF_FIXTURES / "llama", qcfg, dtype, "dummy")
        narrow_bytes = linear * BITS[method] // 8
        assert state_bytes(state) == full - width * linear + narrow_bytes + 4 * columns
        narrow = [x for x in jax.tree.leaves(state) if x.dtype.itemsize == 1]
        assert sum(x.size for x in narrow) == linear
        report = plan(HF_FIXTURES / "llama", EngineConfig.from_overrides(quantization=method))
        assert report["weight_bytes"][jnp.dtype(dtype).name] == state_bytes(state)


@pytest.mark.parametrize("method", METHODS)
def test_the_cpu_kernels_quantised_outputs_do_not_depend_on_the_batch(llama_engines, method):
    """The C++ kernel's chain per output element is fixed by the row alone: a prompt's greedy
    ids and logprobs are the same bits alone and among others."""
    llm = llama_engines[method]
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    batched = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched, strict=True):
        alone = llm.generate(prompt, params)[0].outputs[0]
        assert alone.token_ids == out.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(alone.logprobs, alone.token_ids, strict=True)] \
            == [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs,
                                               out.outputs[0].token_ids, strict=True)]


@pytest.mark.parametrize("method", METHODS)
def test_the_cpu_kernel_and_xlas_dot_agree(llama_engines, method):
    """The CPU backend (the C++ kernel) and plain XLA (qwix's dot) on the same quantised
    weights: prompt logprobs within float32 rounding."""
    ids = list(range(5, 45))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ours = llama_engines[method].generate({"prompt_token_ids": ids}, params)[0]
    xla = LLM(HF_FIXTURES / "llama", quantization=method, matmul_impl="xla", num_pages=80,
              page_size=4, prefill_chunk_sizes=(64,), max_num_seqs=2)
    theirs = xla.generate({"prompt_token_ids": ids}, params)[0]
    for a, b, token in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], ids[1:],
                           strict=True):
        np.testing.assert_allclose(a[token].logprob, b[token].logprob, atol=1e-4)


def _teacher_forced_agreement(llm: LLM, cases: list[dict]) -> float:
    """The share of the reference's generated tokens that are the model's top token given the
    reference's own tokens before them (greedy under teacher forcing: no divergence cascades)."""
    agree = total = 0
    for case in cases:
        ids = case["prompt_ids"] + case["generated_ids"]
        out = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        for position in range(len(case["prompt_ids"]), len(ids)):
            ranks = out.prompt_logprobs[position]
            agree += ranks[ids[position]].rank == 1
            total += 1
    return agree / total


@pytest.mark.parametrize("method", EIGHT_BITS)
def test_stories260k_quantised_follows_the_c_reference(stories_dir, method):
    """The real pretrained model (hidden size 64: a hard case for a column's one scale): under
    teacher forcing the quantised model's top token is the C reference's greedy token at least
    90% of the time (float32: every time)."""
    cases = json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]
    llm = LLM(stories_dir, quantization=method, page_size=4, prefill_chunk_sizes=(64,),
              max_num_seqs=2, max_num_batched_tokens=256, num_pages=256)
    assert _teacher_forced_agreement(llm, cases) >= 0.9


def test_an_fp8_kv_pool_takes_a_quarter_of_float32s_bytes_and_follows_the_c_reference(
        stories_dir):
    """kv_cache_dtype="fp8": keys and values as float8_e4m3fn (held as bytes on the CPU), a
    quarter of float32's bytes a page (plan says so too); stories260K's top token under teacher
    forcing is still the C reference's at least 90% of the time, with int8 weights as well; the
    outputs do not depend on the batch; the cpu kernels and plain XLA agree."""
    cases = json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]
    engine = dict(page_size=4, prefill_chunk_sizes=(64,), max_num_seqs=4,
                  max_num_batched_tokens=256, num_pages=256)
    llm = LLM(stories_dir, kv_cache_dtype="fp8", quantization="int8", **engine)
    runner = llm.engine.runner
    m = runner.model_config
    full = 2 * m.num_layers * 4 * m.num_kv_heads * m.head_dim * 4  # float32 K and V, a page
    assert runner.kv.pools[0].dtype == np.uint8 and runner.kv_bytes_per_page * 4 == full
    report = plan(stories_dir, EngineConfig.from_overrides(kv_cache_dtype="fp8"))
    assert report["kv_bytes_per_token"] * 4 * 4 == full and report["kv_dtype"] == "fp8"
    assert _teacher_forced_agreement(llm, cases) >= 0.9
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in cases[:3]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    batched = llm.generate(prompts, params)
    xla = LLM(stories_dir, kv_cache_dtype="fp8", quantization="int8", attention_impl="reference",
              enable_prompt_logprobs=False, **engine)
    for prompt, out, other in zip(prompts, batched, xla.generate(prompts, params), strict=True):
        alone = llm.generate(prompt, params)[0].outputs[0]
        assert alone.token_ids == out.outputs[0].token_ids
        assert alone.logprobs == out.outputs[0].logprobs
        ours = [lp[t].logprob for lp, t in zip(alone.logprobs, alone.token_ids, strict=True)]
        if other.outputs[0].token_ids == alone.token_ids:
            theirs = [lp[t].logprob for lp, t in zip(other.outputs[0].logprobs,
                                                     alone.token_ids, strict=True)]
            np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_the_demos_bits_per_byte_stay_within_2_percent():
    """The demo model on held-out standard-library text (its validation files): bits per
    byte with int8 and fp8 weights within 2% of float32's."""
    from jaxserve.demo import demo_model_dir
    from jaxserve.demo.data import evenly_spaced_windows, load_corpus
    from jaxserve.demo.train import validation_bpb

    demo = demo_model_dir()
    cfg = ModelConfig.from_hf_dir(demo)
    windows = evenly_spaced_windows(load_corpus().val, 12, cfg.max_position_embeddings)
    bpb = {}
    for method in (None, *EIGHT_BITS):
        graphdef, state = load_state(demo, dataclasses.replace(cfg, quantization=method),
                                     jnp.float32)
        bpb[method] = validation_bpb(graphdef, state, windows, batch_size=4)
    assert math.isfinite(bpb[None]) and bpb[None] < 2.5
    for method in EIGHT_BITS:
        assert bpb[method] <= bpb[None] * 1.02, bpb


@pytest.mark.parametrize(("name", "method"), [
    ("llama_fp8", "fp8"), ("llama_fp8_tensor", "fp8"), ("llama_int8", "int8"),
    ("llama_w4a16", "int4"), ("llama_w4a16_g32", "int4")])
def test_compressed_tensors_checkpoints_give_transformers_dequantised_logits(name, method):
    """Checkpoints written by compressed-tensors (make_quantized_fixtures.py: fp8 or int8
    weights, or int4 packed eight to an int32 word (W4A16's pack-quantized), a scale per
    channel, per tensor or per group of 32 input columns, dynamic or static activation
    settings) read as
    vLLM reads them; the logits are transformers' on the same checkpoint, weights dequantised.
    The CPU engine's greedy ids are transformers' too."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    assert cfg.quantization == method
    graphdef, state = load_state(HF_FIXTURES / name, cfg, jnp.float32)
    expected = load_file(str(HF_FIXTURES / name / "reference" / "expected_logits.safetensors"))
    reference = json.loads((HF_FIXTURES / name / "expected.json").read_text())
    for i, ids in enumerate(reference["prompts"]):
        np.testing.assert_allclose(full_logits(graphdef, state, cfg, ids),
                                   expected[f"prompt_{i}"], atol=1e-4, rtol=0)
    llm = LLM(HF_FIXTURES / name, num_pages=80, page_size=4, max_num_seqs=4,
              prefill_chunk_sizes=(16,))
    params = SamplingParams(max_tokens=len(reference["greedy"][0]), temperature=0.0,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in reference["prompts"]], params)
    assert [o.outputs[0].token_ids for o in outs] == reference["greedy"]


@pytest.mark.parametrize(("name", "method"), [("llama_fp8", "fp8"), ("llama_w4a16", "int4")])
def test_a_compressed_tensors_checkpoint_holds_our_own_quantisation_of_its_weights(name, method):
    """llama_fp8 and llama_w4a16 were quantised from the float llama fixture by
    compressed-tensors: the same narrow weights as quantization="fp8" or "int4" makes of that
    fixture (int4 unpacked from its int32 words), and scales within a rounding. A negative
    absmax lands on -7.5 steps in int4, a tie that each library's rounding (and its scale's
    last bit) breaks its own way: -8 or -7, both half a step away; only there may they differ,
    once a column at most."""
    checkpoint = load_state(HF_FIXTURES / name, ModelConfig.from_hf_dir(HF_FIXTURES / name),
                            jnp.float32)[1]
    ours = load_state(HF_FIXTURES / "llama", dataclasses.replace(
        ModelConfig.from_hf_dir(HF_FIXTURES / "llama"), quantization=method), jnp.float32)[1]
    theirs, mine = jax.tree.leaves(checkpoint), jax.tree.leaves(ours)
    assert len(theirs) == len(mine)
    for a, b in zip(theirs, mine, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == jnp.int4:
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            ties = a != b  # [in, out]
            assert np.all(np.abs(a - b)[ties] == 1) and np.all(np.minimum(a, b)[ties] == -8)
            assert ties.sum(axis=0).max() <= 1
        elif a.dtype == jnp.float8_e4m3fn:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-7)


def _edited_checkpoint(path, config: dict | None = None, drop: str | None = None):
    """A copy of llama_fp8 at `path` with its quantization_config changed or a tensor left
    out."""
    from safetensors import safe_open
    from safetensors.flax import save_file

    from jaxserve.model.loader import _get_tensor

    src = HF_FIXTURES / "llama_fp8"
    path.mkdir()
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = hf["quantization_config"] | (config or {})
    (path / "config.json").write_text(json.dumps(hf))
    file = src / "model.safetensors"
    with safe_open(file, framework="numpy") as f:
        names = [name for name in f.keys() if name != drop]  # noqa: SIM118
        save_file({name: jnp.asarray(_get_tensor(f, file, name)) for name in names},
                  str(path / "model.safetensors"))
    return path


def test_bad_quantization_settings_are_clear_errors(tmp_path):
    missing = "model.layers.1.mlp.down_proj.weight_scale"
    with pytest.raises(ValueError, match=missing):
        LLM(_edited_checkpoint(tmp_path / "no_scale", drop=missing), num_pages=80, page_size=4)
    bad_configs = [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        ({"quant_method": "awq"}, r"\(awq\): bits None"),
        ({"quant_method": "gptq"}, r"\(gptq\): bits None"),
        ({"format": "pack-quantized"}, "differs from the checkpoint"),  # its groups fp8
        ({"format": "nvfp4-pack-quantized"}, "'nvfp4-pack-quantized'"),
        ({"format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
            "actorder": "group"}}}}, "no actorder"),
        ({"format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "strategy": "group"}}}}, "positive group_size"),
        ({"format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}}}},
         "is not read"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "unquantised"),
        ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "num_bits"),
        ({"config_groups": {"g": {"format": "pack-quantized"}}}, "differs"),
        ({"config_groups": ["g"]}, "must be a mapping"),
    ]
    for case, (config, words) in enumerate(bad_configs):
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_hf_dir(_edited_checkpoint(tmp_path / f"case{case}", config))
    with pytest.raises(ValueError, match="already quantised"):
        LLM(HF_FIXTURES / "llama_fp8", quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not read by the tpu"):
        kv_cache_dtype("bfloat16", "tpu", "tpu", "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_overrides(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.from_overrides(quantization="int2")
    with pytest.raises(ValueError, match="quantization"):
        dataclasses.replace(ModelConfig.from_hf_dir(HF_FIXTURES / "llama"), quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        quantize_weight(jnp.ones((4, 4)), "nf4")
