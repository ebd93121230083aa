"""The runner built for devices it does not run on (jaxserve/runner/compile_only.py) and the
planner over it (jaxserve/tools/compile_plan.py, targets.py). Here the compile-only runner is
built on this machine's CPU devices: the same build, warm-up and reports as for an H100 or a
TPU slice, whose compilers (the aot-gpu and aot-tpu extras) CI does not install; the targets'
own tables and errors are checked as they are."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from conftest import HF_FIXTURES

from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.tools import targets
from jaxserve.tools.compile_plan import KV_STEPS, estimate
from jaxserve.tools.targets import parse_target, target_devices

ROOT = Path(__file__).resolve().parents[1]
MODEL = HF_FIXTURES / "llama"
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_sizes=(32, 64),
                      page_size=8, num_pages=64, max_model_len=128)


@pytest.fixture(scope="module")
def runner():
    model_config = CONFIG.served_model(ModelConfig.from_hf_dir(MODEL))
    runner = ModelRunner(MODEL, model_config, CONFIG, devices=jax.devices()[:1],
                         compile_only=True)
    runner.warmup()
    return runner


def test_nothing_is_read_or_allocated(runner):
    for tree in (runner.state, runner.kv, runner.weights, runner.controls.state):
        leaves = jax.tree.leaves(tree)
        assert leaves and not any(isinstance(x, jax.Array) for x in leaves)
        assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                   for x in leaves)


def test_the_warm_up_compiles_every_step_shape_with_the_kernels_in_place(runner):
    compiled = {c.name: c for c in runner.fns.compiled}
    kinds = {name.split("[")[0] for name in compiled}
    assert {"decode", "ragged", "ragged_head", "prefill_with_prompt_logprobs", "decode_hidden",
            "head", "write_slot"} <= kinds  # the cpu backend's ragged prefill
    decode = sorted(n for n in compiled if n.startswith("decode["))
    assert len(decode) == len(runner.row_buckets)  # one per row bucket
    kv_bytes = sum(pool.size * pool.dtype.itemsize for pool in runner.kv.pools)
    for c in compiled.values():
        assert c.seconds >= 0 and c.argument_bytes > 0 and c.host_calls == 0, c
        if c.name.split("[")[0] in KV_STEPS:
            assert c.kernels > 0, c  # the C++ attention kernels, not a fallback
            assert c.alias_bytes >= kv_bytes, c  # the pool donated: updated in place
    assert runner.num_compilations_after_warmup == 0


def test_a_compiled_shape_is_compiled_once(runner):
    compiles, records = runner.num_compilations, len(runner.fns.compiled)
    runner.warmup()  # every shape again: each lowered again, compiled by XLA no more
    assert len(runner.fns.compiled) == 2 * records
    assert runner.num_compilations == compiles > 0


def test_tensor_parallel_compiles_with_two_all_reduces_a_layer():
    """Under tp=2 over two host devices (a subprocess: the device count is fixed at start)."""
    script = textwrap.dedent(f"""
        import json, jax
        from jaxserve.config.engine import EngineConfig
        from jaxserve.config.model import ModelConfig
        from jaxserve.runner.model_runner import ModelRunner
        config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32,
                              prefill_chunk_sizes=(32,), page_size=8, num_pages=32,
                              max_model_len=64, tensor_parallel_size=2, scan_layers=False,
                              attention_impl="reference", matmul_impl="xla")
        path = {str(MODEL)!r}
        model = config.served_model(ModelConfig.from_hf_dir(path))
        runner = ModelRunner(path, model, config, devices=jax.devices()[:2], compile_only=True)
        runner.warmup()
        print(json.dumps({{"layers": model.num_layers, "steps": [
            [c.name, c.all_reduces, c.alias_bytes] for c in runner.fns.compiled]}}))
    """)
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                        "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    decode = [s for s in report["steps"] if s[0].startswith("decode[")]
    assert decode
    # each layer's attention and MLP outputs summed once, and the embedding's gather
    assert all(s[1] == 2 * report["layers"] + 1 for s in decode), decode


def test_targets_parse_and_refuse_with_the_choices():
    h100 = parse_target("h100")
    assert (h100.platform, h100.count) == ("gpu", 0)
    assert h100.usable_bytes == int(0.75 * h100.memory_bytes)  # JAX's preallocation
    slice_ = parse_target("v5e-8")
    assert (slice_.platform, slice_.count, slice_.device_kind) == ("tpu", 8, "TPU v5 lite")
    for bad, words in (("h1000", "expected one of"), ("v5e-3", "v5e slice of"),
                       ("h100-2", "give -tp"), ("", "expected one of")):
        with pytest.raises(ValueError, match=words):
            parse_target(bad)


def test_a_target_without_its_compiler_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # as where the aot-tpu extra is absent
    with pytest.raises(ValueError, match=r"aot-tpu"):
        target_devices(parse_target("v5e-4"), 4)


def test_every_gpu_target_gives_a_device_description():
    for chip, spec in targets.SPECS.items():
        if spec["platform"] == "gpu":
            text = targets._gpu_target_config(spec)
            for field in ("cuda_compute_capability", "core_count", "shared_memory_per_block_optin",
                          "device_memory_size", "memory_bandwidth", "threads_per_warp"):
                assert field in text, (chip, field)


def test_the_estimate_is_the_roofline_of_bytes_read_and_flops():
    target = parse_target("h200")
    p = {"tensor_parallel_size": 1, "max_model_len": 8192, "page_size": 16,
         "concurrency": [{"context": 8192, "sequences_that_fit": 100}], "usable_pages": 0,
         "max_num_seqs": 64, "weight_bytes_per_device": 16e9, "kv_bytes_per_token": 131072,
         "num_params": 8e9}
    e = estimate(p, target)
    one = 1 / ((16e9 + 8192 * 131072) / target.bandwidth)
    assert e["decode_tok_s_batch1"] == pytest.approx(one, rel=1e-3)
    assert e["max_batch"] == 64  # max_num_seqs bounds it, not the 100 that fit
    assert e["decode_tok_s_max"] > e["decode_tok_s_batch1"]


def test_a_moe_step_reads_the_experts_its_rows_route_to():
    """30B parameters of which 29B are 128 experts, 8 a token: one row reads 1/16 of them;
    16 rows touch 1 - (15/16)^16 of them, expected; with every expert touched, all weights."""
    target = parse_target("h200")
    p = {"tensor_parallel_size": 1, "max_model_len": 1, "page_size": 16,
         "concurrency": [{"context": 1, "sequences_that_fit": 100}], "usable_pages": 0,
         "max_num_seqs": 16, "weight_bytes_per_device": 60e9, "kv_bytes_per_token": 0,
         "num_params": 30e9, "expert_params": 29e9, "num_experts": 128,
         "experts_per_token": 8}
    e = estimate(p, target)
    read = 2e9 + 58e9 / 16  # the dense part, and 8 of 128 experts
    assert e["decode_tok_s_batch1"] == pytest.approx(target.bandwidth / read, rel=1e-3)
    touched = 1 - (15 / 16) ** 16
    assert e["decode_tok_s_max"] == pytest.approx(
        16 * target.bandwidth / (2e9 + 58e9 * touched), rel=1e-3)
    dense = estimate(p | {"num_experts": 0, "expert_params": 0}, target)
    assert dense["decode_tok_s_batch1"] == pytest.approx(target.bandwidth / 60e9, rel=1e-3)


def test_plan_for_a_target_without_compiling(capsys):
    from jaxserve.cli import main

    assert main(["plan", str(MODEL), "--target", "v6e-4", "-tp", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "v6e-4" and result["device"]["backend"] == "tpu"
    assert result["estimate"]["decode_tok_s_batch1"] > 0
    assert main(["plan", str(MODEL), "--compile"]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["plan", str(MODEL), "--target", "tpu9"]) == 2
    assert "expected one of h100" in capsys.readouterr().err


def test_a_step_xla_refuses_is_reported_and_the_warm_up_goes_on():
    from dataclasses import dataclass

    from jaxserve.runner.compile_only import CompilingFns

    class Refused:  # a jitted step whose compile XLA refuses
        def lower(self, *args, **static):
            return self

        out_info = (jax.ShapeDtypeStruct((2, 3), jax.numpy.int32),)

        def compile(self, **options):
            raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: no\nmore lines")

    @dataclass(frozen=True)
    class Fns:
        head: object

    device = jax.devices()[0]
    fns = CompilingFns(Fns(Refused()), "gpu", device, device)
    out, = fns.head(None, None, jax.ShapeDtypeStruct((2,), jax.numpy.float32), rows=2)
    assert out.shape == (2, 3) and out.sharding.device_set == {device}
    assert fns.failed == {"head[2,rows=2]": "INVALID_ARGUMENT: no"} and not fns.compiled
