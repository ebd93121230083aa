"""The model against Hugging Face transformers' real outputs (fixtures from make_hf_fixtures.py)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES, HF_MODELS
from flax import nnx
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams
from jaxserve.backends import REFERENCE
from jaxserve.config.model import ModelConfig
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.llama import rope_tables, stack_layers
from jaxserve.model.loader import load_state


def _expected(name):
    return json.loads((HF_FIXTURES / name / "expected.json").read_text())


def full_logits(graphdef, state, cfg: ModelConfig, ids: list[int], dtype=jnp.float32):
    """All prompt logits [len, vocab] in one chunk through the paged path (page_size 4)."""
    n, page_size = len(ids), 4
    pages = -(-n // page_size)
    kv = REFERENCE.attention.zeros(cfg.num_layers, pages + 1, page_size, cfg.num_kv_heads,
                                   cfg.head_dim, jnp.dtype(dtype).name)
    md = AttentionMetadata(
        positions=jnp.arange(n, dtype=jnp.int32)[None],
        query_lens=jnp.array([n], jnp.int32),
        seq_lens=jnp.array([n], jnp.int32),
        page_table=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
    )
    return np.asarray(_forward_logits(graphdef, state, kv, jnp.array([ids], jnp.int32), md)[0])


@functools.partial(jax.jit, static_argnums=0)
def _forward_logits(graphdef, state, kv, tokens, md):
    model = nnx.merge(graphdef, state)
    hidden, _ = model(tokens, kv, md, REFERENCE)
    return model.logits(hidden, REFERENCE)


@pytest.mark.parametrize("name", HF_MODELS)
@pytest.mark.parametrize("layers", ["list", "stacked"])
def test_prompt_logits_match_transformers(name, layers):
    """The layers as loaded (a list, unrolled) and stacked under jax.lax.scan (the engine's)."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    graphdef, state = load_state(HF_FIXTURES / name, cfg, jnp.float32)
    if layers == "stacked" and not cfg.uniform_layers:  # Gemma: sliding and full layers
        with pytest.raises(ValueError, match="the model's layers differ"):
            stack_layers(graphdef, state)
        return
    if layers == "stacked":
        graphdef, state = stack_layers(graphdef, state)
    expected = load_file(str(HF_FIXTURES / name / "reference" / "expected_logits.safetensors"))
    for i, ids in enumerate(_expected(name)["prompts"]):
        ours = full_logits(graphdef, state, cfg, ids)
        np.testing.assert_allclose(ours, expected[f"prompt_{i}"], atol=1e-4, rtol=0)


# default, llama3-scaled and LongRoPE over 3/4 of each head (its attention factor on cos, sin)
@pytest.mark.parametrize("name", ["llama", "llama3", "phi3_longrope"])
def test_rope_tables_give_the_bits_computed_in_the_step(name):
    """The engine's steps read cos and sin from rope_tables; a step computing them itself (the
    model's default) gives the same hidden states, bit for bit, past the table clipped."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    graphdef, state = load_state(HF_FIXTURES / name, cfg, jnp.float32)
    n, page_size = 20, 4
    kv = REFERENCE.attention.zeros(cfg.num_layers, n // page_size + 1, page_size,
                                   cfg.num_kv_heads, cfg.head_dim, "float32")
    md = AttentionMetadata(positions=jnp.arange(n, dtype=jnp.int32)[None],
                           query_lens=jnp.array([n], jnp.int32),
                           seq_lens=jnp.array([n], jnp.int32),
                           page_table=jnp.arange(1, n // page_size + 1, dtype=jnp.int32)[None])
    tokens = jnp.array([_expected(name)["prompts"][3][:n]], jnp.int32)

    @jax.jit
    def hidden(state, rope):
        return nnx.merge(graphdef, state)(tokens, kv, md, REFERENCE, rope=rope)[0]

    computed = hidden(state, None)
    tables = rope_tables(cfg, n, jnp.float32)
    assert np.array_equal(np.asarray(hidden(state, tables)), np.asarray(computed))
    cos, sin = rope_tables(cfg, n - 4, jnp.float32)  # the last four positions read row n - 5
    clipped = np.asarray(hidden(state, (cos, sin)))
    assert np.array_equal(clipped[0, :n - 4], np.asarray(computed)[0, :n - 4])
    assert np.isfinite(clipped).all()


@pytest.mark.parametrize("name", HF_MODELS)
def test_greedy_paged_chunked_matches_transformers(name):
    exp = _expected(name)
    # LongRoPE is served up to original_max_position_embeddings (64 there) alone
    limit = {"phi3_longrope": 64}.get(name)
    llm = LLM(HF_FIXTURES / name, page_size=4, prefill_chunk_sizes=(8,), max_num_seqs=4,
              max_num_batched_tokens=16, num_pages=128, max_model_len=limit)
    params = SamplingParams(max_tokens=len(exp["greedy"][0]), temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in exp["prompts"]], params)
    for out, want in zip(outputs, exp["greedy"], strict=True):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
    # the same request alone gives the same tokens as inside the batch
    alone = llm.generate({"prompt_token_ids": exp["prompts"][3]}, params)
    assert alone[0].outputs[0].token_ids == exp["greedy"][3]


def test_bfloat16_close_to_float32():
    name = "llama"
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    ids = _expected(name)["prompts"][3]
    ref = load_file(str(HF_FIXTURES / name / "reference" / "expected_logits.safetensors"))["prompt_3"]
    graphdef, state = load_state(HF_FIXTURES / name, cfg, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state))
    ours = full_logits(graphdef, state, cfg, ids, jnp.bfloat16)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() < 0.05 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9
