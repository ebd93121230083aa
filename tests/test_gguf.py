"""GGUF checkpoints (issue 52): tiny GGUF files written by the `gguf` package from our Hugging
Face fixtures (tests/gguf_writer.py, as llama.cpp's converter writes them) load into the model
and give transformers' logits for every family; Q8_0, Q4_0 and Q4_1 layers are held as stored
(their bytes, their dequantised values equal to the gguf package's own); bad files are clear
errors naming the file and the problem."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from gguf_writer import permute, write_gguf
from safetensors.numpy import load_file
from test_model_hf import full_logits

from jaxserve import LLM, SamplingParams
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import load_state, state_bytes

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "mixtral",
            "qwen2_moe", "qwen3_moe"]


def _prompts(name):
    return json.loads((HF_FIXTURES / name / "expected.json").read_text())["prompts"]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_gguf_of_each_family_gives_transformers_logits(name, tmp_path):
    """F32 tensors: the names, Llama's interleaved query and key rows, Gemma's norms plus
    one, the experts' stacks all undone, so the logits are the checkpoint's own."""
    file = write_gguf(HF_FIXTURES / name, tmp_path / f"{name}.gguf")
    cfg = ModelConfig.from_hf_dir(file)
    want = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    # Mistral's files say llama (its window, 4096, beyond these prompts, is not in them)
    same = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
            "layer_types", "num_experts", "query_pre_attn_scalar", "rope_theta", "qk_norm",
            "qkv_bias") + (("architecture", "sliding_window") if name != "mistral" else ())
    for field in same:
        assert getattr(cfg, field) == getattr(want, field), field
    graphdef, state = load_state(file, cfg, jnp.float32)
    expected = load_file(str(HF_FIXTURES / name / "reference" / "expected_logits.safetensors"))
    for i, ids in enumerate(_prompts(name)):
        np.testing.assert_allclose(full_logits(graphdef, state, cfg, ids),
                                   expected[f"prompt_{i}"], atol=1e-4, rtol=0)


def test_llama_3_1s_rope_scaling_comes_from_the_files_frequency_factors(tmp_path):
    """A Llama 3.1-3.3 GGUF carries its llama3 RoPE scaling as rope_freqs.weight (a divisor a
    frequency): the model gets the checkpoint's frequencies, and its logits past the original
    context length, from the file as from the checkpoint."""
    from jaxserve.model.llama import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    source = tmp_path / "llama31"
    source.mkdir()
    config = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"rope_scaling": scaling}))
    (source / "model.safetensors").symlink_to(HF_FIXTURES / "llama" / "model.safetensors")
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (HF_FIXTURES / "llama" / extra).is_file():
            (source / extra).symlink_to(HF_FIXTURES / "llama" / extra)
    file = write_gguf(source, tmp_path / "llama31.gguf")
    cfg, want = ModelConfig.from_hf_dir(file), ModelConfig.from_hf_dir(source)
    assert cfg.rope_scaling.rope_type == "frequency_factors"
    assert want.rope_scaling.rope_type == "llama3"
    factors = np.asarray(cfg.rope_scaling.frequency_factors)
    assert factors.max() == 8.0 and 1.0 < factors.min() < 8.0  # long waves, and a blend
    np.testing.assert_allclose(rope_inv_freq(cfg), rope_inv_freq(want), rtol=1e-6)
    ids = [(7 * i) % (cfg.vocab_size - 3) + 3 for i in range(48)]  # 3x the original 16
    np.testing.assert_allclose(full_logits(*load_state(file, cfg, jnp.float32), cfg, ids),
                               full_logits(*load_state(source, want, jnp.float32), want, ids),
                               atol=1e-4, rtol=0)


def test_phi3s_longrope_comes_from_the_files_factors(tmp_path):
    """A Phi-3 128k GGUF carries LongRoPE's short and long factors as tensors and its
    attention factor and original context as metadata: the config is the checkpoint's."""
    from jaxserve.model.llama import rope_inv_freq

    scaling = {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
               "long_factor": [2.0 + i for i in range(8)], "attention_factor": 1.1875}
    source = tmp_path / "phi3_128k"
    source.mkdir()
    config = json.loads((HF_FIXTURES / "phi3" / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {
        "rope_scaling": scaling, "original_max_position_embeddings": 32}))
    for extra in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (HF_FIXTURES / "phi3" / extra).is_file():
            (source / extra).symlink_to(HF_FIXTURES / "phi3" / extra)
    file = write_gguf(source, tmp_path / "phi3.gguf")
    cfg, want = ModelConfig.from_hf_dir(file), ModelConfig.from_hf_dir(source)
    assert cfg.rope_scaling == want.rope_scaling and cfg.rope_scaling.rope_type == "longrope"
    np.testing.assert_array_equal(rope_inv_freq(cfg), rope_inv_freq(want))
    ids = [(5 * i) % (cfg.vocab_size - 3) + 3 for i in range(24)]
    np.testing.assert_allclose(full_logits(*load_state(file, cfg, jnp.float32), cfg, ids),
                               full_logits(*load_state(source, want, jnp.float32), want, ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize(("kind", "held", "offsets"), [
    (T.Q8_0, jnp.int8, False), (T.Q4_0, jnp.int4, False), (T.Q4_1, jnp.uint4, True)])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "phi3"])
def test_quantized_blocks_are_held_as_stored(name, kind, held, offsets, tmp_path):
    """The linear layers and the embedding stay in their blocks' narrow values with float16
    scales (and Q4_1's minima), every one dequantising to what the gguf package gives; the
    model held in about the file's bytes; its logits those of the same file read as floats."""
    file = write_gguf(HF_FIXTURES / name, tmp_path / "q.gguf", linear=kind, embedding=kind)
    cfg = ModelConfig.from_hf_dir(file)
    assert (cfg.quantization_format, cfg.quantization_group_size) == ("gguf", 32)
    assert cfg.quantization_offsets == offsets and cfg.embedding_offsets == offsets
    graphdef, state = load_state(file, cfg, jnp.float32)
    model = nnx.merge(graphdef, state)
    reader = GGUFReader(str(file))
    tensors = {t.name: t for t in reader.tensors}
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.kernel[...].dtype == held
    assert layer.mlp.down_proj.group_scale[...].dtype == jnp.float16
    for ours, gguf_name in ((layer.mlp.down_proj, "blk.0.ffn_down.weight"),
                            (layer.self_attn.o_proj, "blk.0.attn_output.weight")):
        t = tensors[gguf_name]
        np.testing.assert_array_equal(np.asarray(ours.dequantized()),
                                      dequantize(t.data, t.tensor_type).T)
    t = tensors["token_embd.weight"]
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens.table()),
                                  dequantize(t.data, t.tensor_type))
    # about the file's bytes: the blocks' own, the float norms (and an F32 head) beside them
    floats = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == T.F32)
    quantised = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == kind)
    assert state_bytes(state) == pytest.approx(floats + quantised, rel=0.05)
    float_cfg = ModelConfig.from_hf_dict(_float_config(cfg))
    float_graph, float_state = load_state(file, float_cfg, jnp.float32)
    for ids in _prompts(name)[:2]:
        np.testing.assert_allclose(full_logits(graphdef, state, cfg, ids),
                                   full_logits(float_graph, float_state, float_cfg, ids),
                                   atol=2e-4, rtol=1e-4)


def _float_config(cfg: ModelConfig) -> dict:
    """cfg as a float model's config.json (its quantization dropped)."""
    hf = cfg.to_hf_dict()
    hf.pop("quantization_config", None)
    return hf


def test_layers_of_two_block_types_are_held_in_one_layout(tmp_path):
    """Q4_1 layers beside a Q8_0 one: int8 values hold both exactly, with a minimum a group
    (zero for the Q8_0 blocks)."""
    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "mixed.gguf", linear=T.Q4_1,
                      embedding=T.Q8_0, types={"blk.1.ffn_down.weight": T.Q8_0})
    cfg = ModelConfig.from_hf_dir(file)
    assert (cfg.quantization, cfg.quantization_offsets, cfg.embedding_quantization) == (
        "int8", True, "int8")
    graphdef, state = load_state(file, cfg, jnp.float32)
    model = nnx.merge(graphdef, state)
    tensors = {t.name: t for t in GGUFReader(str(file)).tensors}
    for layer in (0, 1):
        t = tensors[f"blk.{layer}.ffn_down.weight"]
        np.testing.assert_array_equal(
            np.asarray(model.model.layers[layer].mlp.down_proj.dequantized()),
            dequantize(t.data, t.tensor_type).T)


def test_other_block_types_load_as_floats(tmp_path, caplog):
    """Float types load as they are; a block type the model does not hold (Q5_0 here, as the
    K-quants) is dequantised by the gguf package as it loads, one log line saying so."""
    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "f16.gguf", linear=T.F16)
    cfg = ModelConfig.from_hf_dir(file)
    assert cfg.quantization is None and cfg.dtype == "float16"
    graphdef, state = load_state(file, cfg, jnp.float32)
    t = {t.name: t for t in GGUFReader(str(file)).tensors}["blk.0.ffn_up.weight"]
    np.testing.assert_array_equal(
        np.asarray(nnx.merge(graphdef, state).model.layers[0].mlp.up_proj.kernel[...]),
        np.asarray(t.data, np.float32).T)
    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "q5.gguf", linear=T.Q5_0,
                      embedding=T.Q8_0)
    cfg = ModelConfig.from_hf_dir(file)
    assert (cfg.quantization, cfg.embedding_quantization) == (None, "int8")
    with caplog.at_level("INFO", logger="jaxserve"):
        graphdef, state = load_state(file, cfg, jnp.float32)
    assert "q5.gguf: 14 tensors (14 Q5_0) dequantised as they load" in caplog.text
    t = {t.name: t for t in GGUFReader(str(file)).tensors}["blk.1.attn_q.weight"]
    want = dequantize(t.data, t.tensor_type)
    kernel = np.asarray(nnx.merge(graphdef, state).model.layers[1].self_attn.q_proj.kernel[...])
    np.testing.assert_array_equal(permute(kernel.T, cfg.num_heads), want)


def test_served_from_the_file_as_from_its_checkpoint(tmp_path):
    """LLM("model.gguf") and a directory holding it generate the checkpoint's greedy ids."""
    name = "qwen3"
    file = write_gguf(HF_FIXTURES / name, tmp_path / "model.gguf")
    expected = json.loads((HF_FIXTURES / name / "expected.json").read_text())["greedy"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(name)]
    for model in (file, tmp_path):
        llm = LLM(str(model), max_num_seqs=4, max_model_len=128, page_size=16,
                  max_num_batched_tokens=64)
        outs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == [g[:8] for g in expected]
        assert llm.get_tokenizer() is not None


def test_bad_files_are_errors_naming_the_file_and_the_problem(tmp_path):
    source = HF_FIXTURES / "llama"
    good = write_gguf(source, tmp_path / "good.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"truncated\.gguf"):
        ModelConfig.from_hf_dir(truncated)
    (tmp_path / "not.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"not\.gguf: not a readable GGUF"):
        ModelConfig.from_hf_dir(tmp_path / "not.gguf")
    unknown = write_gguf(source, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match=r"falcon.gguf: GGUF architecture 'falcon' is not "
                                         r"supported; supported: llama"):
        ModelConfig.from_hf_dir(unknown)
    vocab = write_gguf(source, tmp_path / "vocab.gguf", config={"vocab_size": 64})
    with pytest.raises(ValueError, match=r"vocab\.gguf: the vocabulary does not match the "
                                         "embedding"):
        ModelConfig.from_hf_dir(vocab)
    # a tensor type no GGUF reader knows (the type field of output_norm.weight's entry)
    data = bytearray(good.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name)
    dims = int.from_bytes(data[at:at + 4], "little")
    kind = at + 4 + 8 * dims
    data[kind:kind + 4] = (99).to_bytes(4, "little")
    (tmp_path / "type.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"type\.gguf: not a readable GGUF"):
        ModelConfig.from_hf_dir(tmp_path / "type.gguf")
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a", "b"):
        (two / f"{n}.gguf").write_bytes(good.read_bytes())
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        ModelConfig.from_hf_dir(two)
    with pytest.raises(ValueError, match="not a local model directory or GGUF file"):
        LLM(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_quantization_option_requantises_a_files_blocks(tmp_path, method):
    """quantization= on a GGUF: its blocks load as floats and are quantised as for any float
    checkpoint (a scale a column), the embedding in the model's dtype; int4 too, though the
    file's Q4_1 is held as int4 already."""
    from jaxserve.config.engine import EngineConfig

    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "q.gguf", linear=T.Q4_1,
                      embedding=T.Q8_0)
    cfg = EngineConfig(quantization=method).served_model(ModelConfig.from_hf_dir(file))
    assert (cfg.quantization, cfg.quantization_group_size, cfg.embedding_quantization) == (
        method, None, None)
    graphdef, state = load_state(file, cfg, jnp.float32)
    model = nnx.merge(graphdef, state)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.kernel[...].dtype == jnp.dtype(method) and layer.scale[...].shape == (64,)
    t = {t.name: t for t in GGUFReader(str(file)).tensors}["blk.0.ffn_down.weight"]
    w = dequantize(t.data, t.tensor_type).T
    step = np.abs(w).max(axis=0) / (127.5 if method == "int8" else 7.5)  # a column's
    assert np.all(np.abs(np.asarray(layer.dequantized()) - w) <= step * 0.51 + 1e-6)


def test_the_tokenizer_option_replaces_the_files_own(tmp_path, stories_dir):
    from jaxserve.text.tokenizer import load_tokenizer

    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "model.gguf")
    llm = LLM(str(file), tokenizer=str(stories_dir), max_num_seqs=2, max_model_len=64,
              page_size=16, max_num_batched_tokens=32, prefill_chunk_sizes=(32,))
    assert llm.get_tokenizer().encode("Once upon a time") == load_tokenizer(
        stories_dir).encode("Once upon a time")
    with pytest.raises(ValueError, match=r"no tokenizer\.json, byte_tokenizer\.json or GGUF"):
        LLM(str(file), tokenizer=str(tmp_path / "none"))


def test_bench_serve_reads_a_gguf_models_vocabulary(tmp_path):
    """`jaxserve bench serve` against a server of a GGUF: the served name is the file, whose
    vocabulary and tokenizer the workload is made with."""
    from jaxserve.benchmarks.serve import model_info

    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "model.gguf")
    vocab, tokenizer, max_len = model_info(None, str(file))
    assert (vocab, max_len) == (128, ModelConfig.from_hf_dir(file).max_position_embeddings)
    assert tokenizer is not None and tokenizer.vocab_size == 128


def test_the_plan_counts_the_weights_as_the_backend_holds_them(tmp_path):
    """On the CPU kernels a file's group-wise blocks are dequantised once at load: the plan
    counts them as the float model's bytes; with XLA's matmul they stay blocks."""
    from jaxserve.config.engine import EngineConfig
    from jaxserve.tools.plan import format_plan, plan

    file = write_gguf(HF_FIXTURES / "llama", tmp_path / "q4_1.gguf", linear=T.Q4_1,
                      embedding=T.Q8_0)
    floats = plan(HF_FIXTURES / "llama", EngineConfig(num_pages=64, dtype="float32"))
    held = plan(file, EngineConfig(num_pages=64, dtype="float32"))
    assert held["weight_bytes"]["float32"] == floats["weight_bytes"]["float32"]
    assert held["weight_bytes_per_device"] == floats["weight_bytes_per_device"]
    assert "dequantised to float32" in format_plan(held)
    blocks = plan(file, EngineConfig(num_pages=64, dtype="float32", matmul_impl="xla"))
    assert blocks["weight_bytes"]["float32"] < held["weight_bytes"]["float32"] / 2
    assert "dequantised" not in format_plan(blocks)
