"""Sliding-window attention and the Gemma families: each layer's window read from the config,
the pages behind a window given back while a request runs (core/kv_manager.py), and the
Gemma details (norms of 1 + w, soft caps, local RoPE) shown to matter. Logits and greedy ids
against transformers are in test_model_hf.py (HF_MODELS: gemma2, gemma3, whose window of 8 is
shorter than their prompts); each kernel's window against its twin in the kernels' tests."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from test_model_hf import full_logits

from jaxserve import LLM, SamplingParams
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import load_state

PAGE_SIZE = 4


def _hf(name: str) -> dict:
    return json.loads((HF_FIXTURES / name / "config.json").read_text())


def test_gemma_layer_types_follow_transformers_defaults():
    """Gemma 2: the even layers slide; Gemma 3: all but every sliding_window_pattern-th (6),
    its sliding layers' RoPE base rope_local_base_freq (transformers 4) or rope_parameters'
    sliding_attention (5); the soft caps' defaults: 50 and 30 for Gemma 2, none for Gemma 3."""
    gemma2 = {k: v for k, v in _hf("gemma2").items()
              if k not in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping")}
    cfg = ModelConfig.from_hf_dict(gemma2 | {"num_hidden_layers": 4})
    assert [cfg.window(i) for i in range(4)] == [8, None, 8, None]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    v4 = {k: v for k, v in _hf("gemma3").items() if k not in ("layer_types", "rope_parameters")}
    v4 |= {"num_hidden_layers": 7, "rope_theta": 1e6, "rope_local_base_freq": 20000.0,
           "sliding_window_pattern": 6}
    cfg = ModelConfig.from_hf_dict(v4)
    assert [cfg.window(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attn_logit_softcapping) == (1e6, 20000.0,
                                                                                None)
    fixture = ModelConfig.from_hf_dir(HF_FIXTURES / "gemma3")
    assert (fixture.rope_theta, fixture.rope_local_theta, fixture.qk_norm) == (1e6, 1e4, True)
    assert ModelConfig.from_hf_dict(fixture.to_hf_dict()) == fixture  # jaxserve convert


@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported; supported: silu, "
                                    "gelu_pytorch_tanh"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must list 'full_attention' or "
                                             "'sliding_attention' for each of the 3 layers"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar must be a finite number > 0"),
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping must be a finite number > 0"),
])
def test_gemma_configs_it_cannot_read_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_hf("gemma2") | change)


@pytest.mark.parametrize("name, change", [
    ("gemma2", {"sliding_window": None, "layer_types": ()}),  # every layer full
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma3", {"rope_local_theta": 1e6}),  # the global base on the sliding layers too
])
def test_each_gemma_detail_changes_the_logits_transformers_matched(name, change):
    """The fixtures exercise each detail: without it the logits leave transformers'."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / name)
    ids = json.loads((HF_FIXTURES / name / "expected.json").read_text())["prompts"][3]
    want = full_logits(*load_state(HF_FIXTURES / name, cfg, jnp.float32), cfg, ids)
    other = dataclasses.replace(cfg, **change)
    got = full_logits(*load_state(HF_FIXTURES / name, other, jnp.float32), other, ids)
    assert np.abs(got - want).max() > 1e-3


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    """The tiny Mistral with a window of 8: every layer slides, so its pages can go back."""
    path = tmp_path_factory.mktemp("mistral_window")
    for f in (HF_FIXTURES / "mistral").iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps(_hf("mistral") | {"sliding_window": 8}))
    return path


def _fragmentation(requests, size: int) -> float:
    """Allocated slots not holding a token over allocated slots, counted page by page: a
    released page (0) held its tokens."""
    held = sum(1 for r in requests for page in r.pages if page)
    used = sum(min(r.num_computed_tokens, len(r.pages) * size)
               - sum(1 for page in r.pages if not page) * size for r in requests)
    return 0.0 if not held else 1.0 - used / (held * size)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_pages_behind_the_window_go_back_and_the_ids_stay(mistral_window, prefix_caching):
    """A 120-token generation with a window of 8 (pages of 4) holds at most 4 pages at any
    step (the window's 8 positions span 3, plus the one being filled), the others given back
    as it runs; its greedy ids are those a full forward of the whole text argmaxes (every
    position attending to its window, recomputed)."""
    llm = LLM(mistral_window, page_size=PAGE_SIZE, prefill_chunk_sizes=(8,), max_num_seqs=2,
              max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    assert engine.sliding_window == 8
    prompt = [5, 17, 33, 2, 90, 41, 7, 64, 12, 100, 3, 55, 71]
    engine.add_request("a", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    most, final = 0, None
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        for request in running:
            most = max(most, sum(1 for page in request.pages if page))
        # the stats' per-request count against one page by page (released pages are 0s)
        assert engine.scheduler.kv.fragmentation(running) == pytest.approx(
            _fragmentation(running, PAGE_SIZE))
        for output in engine.step():
            final = output if output.finished else final
    assert most <= 4, most
    stats = engine.scheduler.stats()
    assert stats["kv_pages_released_by_window"] >= (len(prompt) + 120) // PAGE_SIZE - 4
    assert stats["kv_pages_free"] == stats["kv_pages_total"] or prefix_caching
    ids = final.outputs[0].token_ids
    cfg = ModelConfig.from_hf_dir(mistral_window)
    logits = full_logits(*load_state(mistral_window, cfg, jnp.float32), cfg, prompt + ids[:-1])
    np.testing.assert_array_equal(logits[len(prompt) - 1:].argmax(-1), ids)


def test_a_model_with_full_layers_keeps_its_pages():
    """Gemma's full-attention layers read every page: nothing is given back."""
    llm = LLM(HF_FIXTURES / "gemma3", page_size=PAGE_SIZE, prefill_chunk_sizes=(8,),
              max_num_seqs=2, max_num_batched_tokens=16)
    assert llm.engine.sliding_window is None
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}],
                 SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.stats()["kv_pages_released_by_window"] == 0
