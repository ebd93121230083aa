"""The engine on a tiny model: greedy output never depends on batching, mode, chunking,
preemption or multi-step decode, and every page is free after every run."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES

from jaxserve import LLM, SamplingParams

MODEL = HF_FIXTURES / "llama"
BASE = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_sizes=(16, 64),
            num_pages=400)


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, size=int(n)).tolist()}
               for n in rng.integers(4, 201, size=32)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in rng.integers(2, 65, size=32)]
    return prompts, params


@pytest.fixture(scope="module")
def alone(workload):
    llm = LLM(MODEL, **BASE)
    prompts, params = workload
    outs = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    _all_pages_free(llm)
    assert llm.stats()["num_compilations_after_warmup"] == 0
    return outs


def _all_pages_free(llm):
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


@pytest.mark.parametrize("overrides", [
    dict(batching="continuous"),
    dict(batching="static", max_batch_size=8),
    dict(batching="dynamic", window_ms=5.0, max_batch_size=6),
    dict(batching="continuous", window_ms=2.0, min_batch_size=3),
    dict(batching="continuous", decode_steps=4),
    dict(batching="continuous", max_num_batched_tokens=16, prefill_chunk_sizes=(8, 16)),
    dict(batching="continuous", num_pages=48),
    dict(batching="static", num_pages=48, decode_steps=4),
], ids=["continuous", "static", "dynamic", "two-layer", "multistep", "chunked", "preempt",
        "static-preempt-multistep"])
def test_greedy_ids_independent_of_batching(workload, alone, overrides):
    prompts, params = workload
    llm = LLM(MODEL, **(BASE | overrides))
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == alone[i], f"request {i}"
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == params[i].max_tokens
    stats = llm.stats()
    if overrides.get("num_pages") == 48:
        assert stats["num_preemptions"] > 0
    assert stats["num_compilations_after_warmup"] == 0
    _all_pages_free(llm)


def test_pallas_kernels_in_the_engine_match_the_reference(workload, alone):
    """attention_impl="pallas" runs the kernels (interpret mode on CPU) inside the jitted steps."""
    prompts, params = workload
    llm = LLM(MODEL, **(BASE | dict(attention_impl="pallas", max_num_seqs=4,
                                    prefill_chunk_sizes=(64,))))
    outs = llm.generate(prompts[:6], params[:6])
    assert [o.outputs[0].token_ids for o in outs] == alone[:6]
    _all_pages_free(llm)


def test_a_16_bit_model_keeps_a_float32_kv_cache_on_the_cpu():
    """XLA on the CPU has no 16-bit float gather/scatter and would convert the whole pool every
    layer and step; kv_cache_dtype keeps the pool in float32 there, and only there."""
    from jaxserve.config import kv_cache_dtype

    assert kv_cache_dtype("bfloat16", "cpu", "reference") == "float32"
    assert kv_cache_dtype("bfloat16", "cpu", "pallas") == "bfloat16"  # the kernels' contract
    assert kv_cache_dtype("float16", "gpu", "pallas") == "float16"
    assert kv_cache_dtype("bfloat16", "gpu", "reference") == "bfloat16"
    llm = LLM(MODEL, **(BASE | dict(dtype="bfloat16", max_num_seqs=2)))
    runner = llm.engine.runner
    assert runner.kv.k[0].dtype == np.float32 and runner.dtype == jnp.bfloat16
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
