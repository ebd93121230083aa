"""The engine on a tiny model: greedy output never depends on batching, mode, chunking,
preemption or multi-step decode, and every page is free after every run."""

import jax
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
    dict(batching="continuous", row_buckets=(3, 8)),
], ids=["continuous", "static", "dynamic", "two-layer", "multistep", "chunked", "preempt",
        "static-preempt-multistep", "row-buckets"])
def test_greedy_ids_independent_of_batching(workload, alone, overrides):
    prompts, params = workload
    llm = LLM(MODEL, **(BASE | overrides))
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == alone[i], f"request {i}"
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == params[i].max_tokens
    stats = llm.stats()
    if "row_buckets" in overrides:
        assert llm.engine.runner.row_buckets == (3, 8)
        assert llm.engine.runner.prefill_row_buckets == (1, 3, 8)
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
    from jaxserve.config.engine import kv_cache_dtype

    assert kv_cache_dtype("bfloat16", "cpu", "reference") == "float32"
    assert kv_cache_dtype("bfloat16", "cpu", "pallas") == "bfloat16"  # the kernels' contract
    assert kv_cache_dtype("float16", "gpu", "pallas") == "float16"
    assert kv_cache_dtype("bfloat16", "gpu", "reference") == "bfloat16"
    llm = LLM(MODEL, **(BASE | dict(dtype="bfloat16", max_num_seqs=2)))
    runner = llm.engine.runner
    assert runner.kv.pools[0].dtype == np.float32 and runner.dtype == jnp.bfloat16
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_auto_dtype_computes_a_16_bit_checkpoint_in_float32_on_the_cpu(tmp_path):
    """XLA on the CPU converts 16-bit weights on every step (a bf16 matmul ran 7x slower than
    float32 here), so "auto" loads a bf16 checkpoint in float32 there when memory allows."""
    import json
    import shutil

    from jaxserve.config.engine import EngineConfig, compute_dtype
    from jaxserve.config.model import ModelConfig
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.tools.plan import format_plan, plan

    gib = 2**30
    assert compute_dtype("auto", "bfloat16", "cpu", 10**9, host_bytes=16 * gib) == "float32"
    assert compute_dtype("auto", "float16", "cpu", 10**9, host_bytes=16 * gib) == "float32"
    assert compute_dtype("auto", "bfloat16", "cpu", 10**9, host_bytes=6 * gib) == "bfloat16"
    assert compute_dtype("auto", "bfloat16", "cpu", 10**9, reserved_bytes=4 * gib,
                         host_bytes=10 * gib) == "bfloat16"  # the KV cache's share comes first
    assert compute_dtype("auto", "bfloat16", "gpu", 10**9, host_bytes=16 * gib) == "bfloat16"
    assert compute_dtype("bfloat16", "bfloat16", "cpu", 10**9) == "bfloat16"  # asked for
    assert compute_dtype("auto", "float32", "cpu", 10**9) == "float32"

    model = tmp_path / "bf16"
    shutil.copytree(MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    cfg = ModelConfig.from_hf_dir(model)
    assert cfg.dtype == "bfloat16"
    planned = plan(model, EngineConfig(num_pages=64))
    assert (planned["dtype"], planned["checkpoint_dtype"]) == ("float32", "bfloat16")
    assert "the checkpoint is bfloat16" in format_plan(planned)
    runner = ModelRunner(model, cfg, EngineConfig(**(BASE | dict(max_num_seqs=2))))
    assert runner.sampler_state_bytes == plan(model, EngineConfig(
        num_pages=64, max_num_seqs=2))["sampler_state_bytes"]  # the plan's, from the arrays
    assert runner.dtype == jnp.float32
    assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(runner.weights))  # and RoPE
    asked = ModelRunner(model, cfg, EngineConfig(**(BASE | dict(max_num_seqs=2,
                                                                dtype="bfloat16"))))
    assert asked.dtype == jnp.bfloat16


def _assert_same_logprobs(got, want):
    """Same token ids at every position and the same log-probabilities, bit for bit: on the CPU
    the engine's kernels are batch invariant (tests/test_batch_invariance.py)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.keys() == w.keys()
            assert [g[t].logprob for t in w] == [w[t].logprob for t in w]


def test_prompt_and_sample_logprobs_do_not_depend_on_the_batch(workload):
    """Prompt chunks of different lengths run as separate prefill calls in one iteration (and
    are chunked by the budget); each request's prompt logprobs and sampled-token logprobs are
    the ones it gets alone."""
    prompts, _ = workload
    picks = [0, 3, 5, 8, 13, 21]  # prompts of mixed lengths, some over a 64-token chunk
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2,
                             prompt_logprobs=3 if i % 2 == 0 else None)
              for i in range(len(picks))]
    llm = LLM(MODEL, **BASE)
    together = llm.generate([prompts[i] for i in picks], params)
    for out, i, sp in zip(together, picks, params, strict=True):
        alone = llm.generate(prompts[i], sp)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        _assert_same_logprobs(out.outputs[0].logprobs, alone.outputs[0].logprobs)
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == len(prompts[i]["prompt_token_ids"])
            _assert_same_logprobs(out.prompt_logprobs, alone.prompt_logprobs)
    assert llm.stats()["num_compilations_after_warmup"] == 0


def test_freeze_gc_takes_the_warm_heap_out_of_full_collections():
    """In its own process: freezing moves every live object to the permanent generation, so a
    full collection afterwards walks none of them; the youngest generation is collected at
    20,000 objects, not 700."""
    import subprocess
    import sys

    code = ("import gc; from jaxserve.engine.llm_engine import freeze_gc; freeze_gc(); "
            "assert gc.get_freeze_count() > 10_000, gc.get_freeze_count(); "
            "assert sum(gc.get_count()) < 1_000; "
            "assert gc.get_threshold()[0] == 20_000, gc.get_threshold()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_engine_dropped_takes_its_compiled_steps_with_it():
    """Its executables' code (XLA:CPU holds it in memory maps, a bounded resource: see
    conftest's release_compiled_steps) goes when the last reference to the engine does: a
    process that builds engine after engine (a notebook, an evaluation harness) holds no
    more maps after the second than after the first."""
    import gc

    from conftest import _memory_maps

    def build_and_drop() -> tuple[int, int]:
        llm = LLM(MODEL, **BASE)
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4),
                     use_tqdm=False)
        alive = _memory_maps()[0]
        del llm
        gc.collect()
        return alive, _memory_maps()[0]

    alive, first = build_and_drop()
    assert alive - first > 500  # what an engine's steps hold: the count can see them go
    _, second = build_and_drop()
    assert second <= first + 50, (first, second)


def test_n_samples_of_a_prompt_are_its_seeded_requests(workload):
    """SamplingParams(n=3, seed=11): three completions, sample j the request seeded 11 + j alone
    would give; the engine itself takes one sample per request and says so."""
    prompts, _ = workload
    llm = LLM(MODEL, **BASE)
    three = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, n=3)
    outs = llm.generate([prompts[0], prompts[1]], [three, three.for_sample(0)])
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for j, completion in enumerate(outs[0].outputs):
        alone = llm.generate(prompts[0], SamplingParams(max_tokens=6, temperature=1.0,
                                                        seed=11 + j, ignore_eos=True))[0]
        assert completion.token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == llm.generate(prompts[1], three.for_sample(0))[0] \
        .outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    with pytest.raises(ValueError, match=r"^n must be a positive integer"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"^n 2: a request to the engine is one sample"):
        llm.engine.add_request(None, prompts[0], SamplingParams(n=2))
    _all_pages_free(llm)
