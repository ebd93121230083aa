"""Mixture-of-experts layers (jaxserve/model/moe.py): the router and the grouped matmul against
numpy and a loop over experts, the loader's expert layouts, batch invariance on the CPU
backend, and the settings it refuses. Logits and greedy ids against transformers are in
test_model_hf.py (HF_MODELS), the mesh in test_tensor_parallel.py."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_model_hf import full_logits

from jaxserve import LLM, SamplingParams
from jaxserve.backends import REFERENCE
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import abstract_model, load_state
from jaxserve.model.moe import Experts, dense_experts, grouped_experts, route

MOE_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _config(**overrides) -> ModelConfig:
    shape = dict(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32,
                 intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                 max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                 moe_intermediate_size=24)
    return ModelConfig(**(shape | overrides))


@pytest.mark.parametrize("renormalise", [False, True])
def test_the_router_keeps_the_softmaxs_top_k_as_transformers(renormalise):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(9, 6)).astype(np.float32)
    logits[3, 4] = logits[3, 1]  # a tie goes to the lower expert, as torch.topk
    weights, experts = route(jnp.asarray(logits), 3, renormalise, REFERENCE)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.argsort(-probs, axis=-1, kind="stable")[:, :3]
    top = np.take_along_axis(probs, want, -1)
    if renormalise:
        top /= top.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(experts), want)
    np.testing.assert_allclose(np.asarray(weights), top, rtol=1e-6)


def test_the_grouped_matmul_gives_a_loop_over_experts_outputs():
    """Every (token, choice) pair's expert output, some experts chosen by no token."""
    cfg = _config()
    layers = Experts(cfg, jnp.float32, nnx.Rngs(3))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(11, cfg.hidden_size)), jnp.float32)
    experts = jnp.asarray(rng.choice([0, 2, 3, 5], size=(11, 2)), jnp.int32)
    grouped = grouped_experts(x, experts, layers, cfg.num_experts, REFERENCE)
    np.testing.assert_allclose(np.asarray(grouped),
                               np.asarray(dense_experts(x, experts, layers, cfg.num_experts,
                                                        REFERENCE)), atol=1e-5)
    for t, e in ((0, 0), (7, 1)):  # one pair by hand
        k = experts[t, e]
        h = jax.nn.silu(x[t] @ layers.gate_proj.kernel[k]) * (x[t] @ layers.up_proj.kernel[k])
        np.testing.assert_allclose(np.asarray(grouped[t, e]),
                                   np.asarray(h @ layers.down_proj.kernel[k]), atol=1e-5)


def test_on_the_cpu_backend_grouped_rows_have_the_bits_of_the_loop_over_experts():
    """The C++ grouped matmul runs each row as one chain with its expert's weights: the
    same bits as that expert run on every row (and packed as the engine packs it)."""
    from jaxserve.backends.select import select_backend

    cfg = _config(hidden_size=72, moe_intermediate_size=40)
    backend = select_backend("cpu", "cpu", "float32", cfg.head_dim, 4)
    layers = Experts(cfg, jnp.float32, nnx.Rngs(5))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(13, cfg.hidden_size)), jnp.float32)
    experts = jnp.asarray(np.argsort(rng.random((13, cfg.num_experts)), 1)[:, :2], jnp.int32)
    want = dense_experts(x, experts, layers, cfg.num_experts, backend)
    np.testing.assert_array_equal(
        grouped_experts(x, experts, layers, cfg.num_experts, backend), want)
    graphdef, state = backend.ops.pack_weights(*nnx.split(layers))
    packed = nnx.merge(graphdef, state)
    assert packed.gate_proj.kernel.ndim == 4
    np.testing.assert_array_equal(
        grouped_experts(x, experts, packed, cfg.num_experts, backend), want)
    np.testing.assert_array_equal(
        grouped_experts(x[5:6], experts[5:6], packed, cfg.num_experts, backend), want[5:6])


def test_the_hopper_grouped_matmul_pads_its_rows_and_zeroes_those_past_the_groups():
    """On a Hopper the experts run in JAX's Mosaic GPU ragged_dot, which takes whole tiles of
    rows and leaves rows past the groups' total unwritten: given a stand-in kernel that writes
    NaN there, the wrapper gives jax.lax.ragged_dot's values, and the backend chooses it only
    on compute capability 9.x and for operands the kernel takes."""
    from jaxserve.backends.base import HOPPER_TILES, Ops, hopper_ragged_dot, hopper_ragged_dot_fits
    from jaxserve.backends.select import is_hopper

    seen = []

    def stand_in(x, w, *, group_sizes, **tiles):
        assert tiles == HOPPER_TILES and x.shape[0] % tiles["block_m"] == 0
        seen.append(x.shape[0])
        y = jax.lax.ragged_dot(x, w, group_sizes)
        rows = jnp.arange(x.shape[0])[:, None]
        return jnp.where(rows < jnp.sum(group_sizes), y, jnp.nan)

    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.normal(size=(4, 64, 128)), jnp.bfloat16)
    for m, sizes in ((9, [3, 0, 4, 0]), (70, [10, 20, 30, 10]), (64, [0, 0, 0, 0])):
        x = jnp.asarray(rng.normal(size=(m, 64)), jnp.bfloat16)
        sizes = jnp.asarray(sizes, jnp.int32)
        got = hopper_ragged_dot(x, w, sizes, kernel=stand_in)
        assert got.shape == (m, 128)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(jax.lax.ragged_dot(x, w, sizes), np.float32))
    assert seen == [64, 128, 64]
    assert hopper_ragged_dot_fits(x, w)
    assert not hopper_ragged_dot_fits(x.astype(jnp.float32), w.astype(jnp.float32))
    assert not hopper_ragged_dot_fits(x[:, :32], w[:, :32])  # 32 of the contraction: no tile
    assert not hopper_ragged_dot_fits(x, w[:, :, :96])
    assert [is_hopper(c) for c in ("9.0", "9.0a", "8.0", "8.9", "10.0", None)] == [
        True, True, False, False, False, False]
    assert Ops().hopper_grouped is False  # the CPU and the TPU keep jax.lax.ragged_dot


@pytest.mark.parametrize("name", [*MOE_MODELS, "qwen2", "llama3", "gemma2", "gemma3"])
def test_num_params_counts_the_experts_router_shared_expert_and_biases(name):
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    _, state = abstract_model(cfg, jnp.float32)
    assert cfg.num_params == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def test_transformers_5s_fused_expert_stacks_load_as_the_per_expert_tensors(tmp_path):
    """experts.gate_up_proj [E, 2 I, H] and experts.down_proj [E, H, I], as transformers 5
    holds them in memory, give the logits of the per-expert checkpoint."""
    source = HF_FIXTURES / "qwen3_moe"
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    tensors = load_file(str(source / "model.safetensors"))
    cfg = ModelConfig.from_hf_dir(source)
    fused = {}
    for layer in range(cfg.num_layers):
        stem = f"model.layers.{layer}.mlp.experts"
        per = {proj: [tensors.pop(f"{stem}.{e}.{proj}.weight") for e in range(cfg.num_experts)]
               for proj in ("gate_proj", "up_proj", "down_proj")}
        fused[f"{stem}.gate_up_proj"] = np.stack(
            [np.concatenate([g, u]) for g, u in zip(per["gate_proj"], per["up_proj"],
                                                    strict=True)])
        fused[f"{stem}.down_proj"] = np.stack(per["down_proj"])
    save_file(tensors | fused, str(tmp_path / "model.safetensors"))
    ids = json.loads((source / "expected.json").read_text())["prompts"][2]
    want = full_logits(*load_state(source, cfg, jnp.float32), cfg, ids)
    got = full_logits(*load_state(tmp_path, cfg, jnp.float32), cfg, ids)
    np.testing.assert_array_equal(got, want)


def test_a_checkpoint_short_of_an_expert_names_the_missing_ones(tmp_path):
    source = HF_FIXTURES / "mixtral"
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_hf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"missing experts \[5\] of model\.layers\.1\.mlp\."
                                         r"experts\.up_proj"):
        load_state(tmp_path, cfg, jnp.float32)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_a_prompt_alone_gets_the_bits_it_gets_in_a_batch_on_the_cpu_backend(name):
    """The experts' outputs of a token do not depend on the other tokens of its step (the
    CPU backend's grouped matmul: each row its own chain), so ids and logprobs match."""
    prompts = json.loads((HF_FIXTURES / name / "expected.json").read_text())["prompts"]
    llm = LLM(HF_FIXTURES / name, max_num_seqs=4, page_size=4, prefill_chunk_sizes=(8,),
              max_num_batched_tokens=16, enable_prompt_logprobs=False)
    assert llm.engine.runner.backend.name == "cpu"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, together in zip(prompts, batched, strict=True):
        alone = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        assert alone.token_ids == together.outputs[0].token_ids
        assert alone.logprobs == together.outputs[0].logprobs


def _hf_config(name: str, **changes) -> dict:
    return json.loads((HF_FIXTURES / name / "config.json").read_text()) | changes


@pytest.mark.parametrize("changes, message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 .* only models whose every layer is "
                                 "sparse"),
    ({"mlp_only_layers": [0]}, r"mlp_only_layers \[0\]"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
    ({"num_local_experts": 0}, "num_experts must be a positive integer, got 0"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive integer"),
])
def test_moe_configs_it_cannot_serve_are_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_hf_config("qwen3_moe", **changes))


def test_the_unsupported_architecture_error_lists_the_mixtures_of_experts():
    with pytest.raises(ValueError, match=r"supported: .*MixtralForCausalLM, Qwen2MoeForCausalLM, "
                                         r"Qwen3MoeForCausalLM"):
        ModelConfig.from_hf_dict(_hf_config("qwen3_moe", architectures=["DeepseekV3ForCausalLM"]))


def test_quantising_or_expert_parallelism_where_they_do_not_apply_are_clear_errors():
    with pytest.raises(ValueError, match="quantization 'int8' of a mixture-of-experts model"):
        LLM(HF_FIXTURES / "mixtral", quantization="int8")
    with pytest.raises(ValueError, match="enable_expert_parallel: the LlamaForCausalLM model "
                                         "has no experts"):
        LLM(HF_FIXTURES / "llama", enable_expert_parallel=True)
