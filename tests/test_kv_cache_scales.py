"""An fp8 KV cache's per-tensor scales read from the checkpoint (compressed-tensors'
`kv_cache_scheme`, each layer's `self_attn.k_scale` / `v_scale`, or the older
`k_proj.output_scale` / `v_proj.output_scale`), as vLLM reads them: keys and values stored
divided by their scale and read back times it.

`write_scaled` makes the llama fixture's keys and values F times larger (k_proj, v_proj times F)
and its queries and outputs F times smaller (q_proj, o_proj over F), F a power of two: the same
function, bit for bit in float arithmetic, but with keys and values F times past what an fp8
pool holds at scale 1, and with scales F the stored bytes are the unscaled model's. So the
checkpoint with its scales gives the unscaled model's fp8-cache logits exactly, and without
them it clamps."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.backends import REFERENCE
from jaxserve.config.model import ModelConfig
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.loader import load_state

SOURCE = HF_FIXTURES / "llama"
F = 1024.0  # a power of two: the weights' scaling and the scales' round trip are exact
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
          "symmetric": True}
ENGINE = dict(max_num_seqs=4, page_size=8, num_pages=80, prefill_chunk_sizes=(16,),
              max_num_batched_tokens=32, enable_prompt_logprobs=False, kv_cache_dtype="fp8")


def write_scaled(path: Path, scales: bool = True, names: str = "k_scale",
                 scheme: dict | None = None) -> Path:
    """The scaled llama fixture at `path`; with `scales` its kv_cache_scheme and F as every
    layer's scales, named `names` ("k_scale": self_attn.k_scale; "output_scale":
    k_proj.output_scale)."""
    tensors = load_file(str(SOURCE / "model.safetensors"))
    config = json.loads((SOURCE / "config.json").read_text())
    factor = {"k_proj": F, "v_proj": F, "q_proj": 1 / F, "o_proj": 1 / F}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in factor:
            tensors[name] = (tensor * np.float32(factor[parts[-2]])).astype(tensor.dtype)
    if scales:
        for i in range(config["num_hidden_layers"]):
            for kv in "kv":
                name = (f"model.layers.{i}.self_attn.{kv}_scale" if names == "k_scale"
                        else f"model.layers.{i}.self_attn.{kv}_proj.output_scale")
                tensors[name] = np.array([F], np.float32)
        config["quantization_config"] = {"quant_method": "compressed-tensors",
                                         "format": "dense", "config_groups": {},
                                         "kv_cache_scheme": scheme or SCHEME}
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    shutil.copyfile(SOURCE / "generation_config.json", path / "generation_config.json")
    return path


def logits(path: Path, kv_dtype: str) -> np.ndarray:
    """A prompt's logits [len, vocab] through the paged path of the XLA backend, the KV pool
    of `kv_dtype`."""
    cfg = ModelConfig.from_hf_dir(path)
    graphdef, state = load_state(path, cfg, jnp.float32)
    ids = json.loads((SOURCE / "expected.json").read_text())["prompts"][0]
    n, page_size = len(ids), 4
    pages = -(-n // page_size)
    kv = REFERENCE.attention.zeros(cfg.num_layers, pages + 1, page_size, cfg.num_kv_heads,
                                   cfg.head_dim, kv_dtype)
    md = AttentionMetadata(positions=jnp.arange(n, dtype=jnp.int32)[None],
                           query_lens=jnp.array([n], jnp.int32),
                           seq_lens=jnp.array([n], jnp.int32),
                           page_table=jnp.arange(1, pages + 1, dtype=jnp.int32)[None])

    @jax.jit
    def forward(state, kv, tokens):
        model = nnx.merge(graphdef, state)
        hidden, _ = model(tokens, kv, md, REFERENCE)
        return model.logits(hidden, REFERENCE)

    return np.asarray(forward(state, kv, jnp.array([ids], jnp.int32))[0])


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Path:
    return write_scaled(tmp_path_factory.mktemp("kv") / "scaled")


@pytest.mark.parametrize("names", ["k_scale", "output_scale"])
def test_the_scales_give_the_unscaled_models_fp8_logits_bit_for_bit(tmp_path, names):
    path = write_scaled(tmp_path / names, names=names)
    assert ModelConfig.from_hf_dir(path).kv_cache_scales
    want = logits(SOURCE, "fp8")
    np.testing.assert_array_equal(logits(path, "fp8"), want)
    # without its scales the same checkpoint's keys and values clamp at fp8's largest value
    unscaled = write_scaled(tmp_path / "unscaled", scales=False)
    assert np.abs(logits(unscaled, "fp8") - want).max() > 0.1
    # a float pool holds keys and values as they are: the scales are not used
    np.testing.assert_allclose(logits(path, "float32"), logits(SOURCE, "float32"), atol=1e-5)


@pytest.mark.parametrize("backend", [{}, {"attention_impl": "reference", "matmul_impl": "xla"}])
def test_the_engine_on_a_checkpoint_with_scales_gives_the_unscaled_models_outputs(scaled,
                                                                                  backend):
    """The CPU backend (a uint8 pool) and XLA's: the unscaled model's fp8-cache greedy ids and
    logprobs."""
    prompts = [{"prompt_token_ids": ids}
               for ids in json.loads((SOURCE / "expected.json").read_text())["prompts"]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    want = LLM(SOURCE, **ENGINE, **backend).generate(prompts, params)
    outs = LLM(scaled, **ENGINE, **backend).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in want]


def test_schemes_and_scales_jaxserve_does_not_read_are_clear_errors(tmp_path, scaled):
    for i, change in enumerate(({"strategy": "channel"}, {"num_bits": 4, "type": "int"},
                                {"dynamic": True})):
        path = write_scaled(tmp_path / f"scheme{i}", scheme=SCHEME | change)
        with pytest.raises(ValueError, match="kv_cache_scheme"):
            ModelConfig.from_hf_dir(path)
    tensors = load_file(str(scaled / "model.safetensors"))
    name = "model.layers.0.self_attn.v_scale"
    for i, (edit, words) in enumerate((({name: None}, f"missing tensor.*{name}"),
                                       ({name: np.array([0.0], np.float32)},
                                        "one positive number"))):
        broken = tmp_path / f"broken{i}"
        shutil.copytree(scaled, broken)
        kept = {k: v for k, v in (tensors | edit).items() if v is not None}
        save_file(kept, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=words):
            load_state(broken, ModelConfig.from_hf_dir(broken), jnp.float32)
