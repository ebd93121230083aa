"""The engine compiled, on every commit, for the accelerators users serve on (issue 51): tiny
Llama, Qwen3, Gemma 3 (sliding windows) and Qwen3-MoE (experts split across devices) configs,
head_dim 128 as the TPU kernel takes, through `jaxserve plan --target T --compile`, each in a
process of its own (JAX_PLATFORMS=cpu: the CUDA plugin registers its compiler only then). Every
step shape compiles, our kernels are in every step that attends (no fallback to plain XLA
attention), the KV pool is donated, no host transfer sits inside a step, and under tensor
parallelism the decode step sums as the design says. Needs the aot-tpu and aot-gpu extras (the
test extra installs them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HF_FIXTURES

FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--prefill-chunk-sizes", "32",
         "--page-size", "16", "--max-model-len", "128", "--num-pages", "32",
         "--no-enable-prompt-logprobs"]
CASES = [  # (fixture, target, tensor_parallel_size, extra flags)
    ("llama", "h100", 1, []),
    ("gemma3", "h100", 1, []),
    ("llama", "v5e-1", 1, []),
    ("qwen3", "v5e-4", 4, []),
    ("qwen3_moe", "v5e-4", 4, ["--enable-expert-parallel"]),
    ("llama:64", "v5e-1", 1, []),  # SmolLM2's head_dim: padded to the kernel's 128 lanes
    # the experts in JAX's Hopper grouped matmul (128-wide: whole tiles of its outputs)
    ("qwen3_moe:128", "h100", 2, ["--enable-expert-parallel"]),
    # LoRA's banks: their grouped products as jax.lax.ragged_dot on each platform
    ("llama", "h100", 1, ["--enable-lora", "--max-loras", "4"]),
    ("qwen3", "v5e-4", 4, ["--enable-lora", "--max-loras", "4"]),  # split with their layers
]


def _head_dim_128(fixture: str, root: Path) -> Path:
    """The fixture's config.json with 128-wide heads (or "name:64", 64-wide) in bfloat16
    (only the config is read); "moe:128" also makes the experts 128 wide, in and out."""
    fixture, _, width = fixture.partition(":")
    config = json.loads((HF_FIXTURES / fixture / "config.json").read_text())
    config["head_dim"] = int(width or 128)
    if "moe" in fixture and width:
        config["hidden_size"] = config["moe_intermediate_size"] = int(width)
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    path = root / fixture
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("fixture", "target", "tp", "extra"), CASES,
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}" + ("-lora" if "--enable-lora" in c[3]
                                                           else "") for c in CASES])
def test_every_step_compiles_for_the_target_with_our_kernels(fixture, target, tp, extra,
                                                             tmp_path):
    model = _head_dim_128(fixture, tmp_path)
    env = os.environ | {"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "1"}
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "plan", str(model), "--target",
                          target, "-tp", str(tp), "--compile", "--json", *FLAGS, *extra],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    platform = "gpu" if target.startswith("h") else "tpu"
    assert result["device"]["backend"] == platform and result["target"] == target
    assert result["attention_impl"] == ("pallas" if platform == "gpu" else "tpu")
    assert result["fits"] and not result["problems"], result["problems"]
    names = {c["name"].split("[")[0] for c in result["compiled"]}
    assert {"decode", "head", "write_slot", "decode_hidden"} <= names
    assert names & {"prefill", "ragged"}
    kernels = result["kernels"]
    assert kernels["kv_steps"] > 0 and kernels["steps_with_kernels"] == kernels["kv_steps"]
    if "moe" in fixture and platform == "gpu":  # attention and three grouped matmuls a layer
        for step in result["compiled"]:
            if step["name"].split("[")[0] in ("decode", "prefill", "ragged"):
                assert step["kernels"] >= 4 * result["layers"], step
    kv = result["per_device_bytes"]["kv"]
    for step in result["compiled"]:
        assert step["host_calls"] == 0, step
        if step["name"].split("[")[0] in ("decode", "prefill", "ragged", "decode_hidden"):
            assert step["alias_bytes"] >= kv, step  # the pool updated in place
    # in the model's forward, per layer attention's output and the MLP's (the experts' shares
    # too) summed once, and the embedding's gather: in the program text a scanned stack is one
    # layer's body (the sampler's own collectives come on top, in the decode step)
    layers = 1 if result["scan_layers"] else result["layers"]
    assert result["all_reduces_per_forward"] == (0 if tp == 1 else 2 * layers + 1)
    assert result["all_reduces_per_decode_step"] >= result["all_reduces_per_forward"]
    assert result["estimate"]["decode_tok_s_batch1"] > 0
    # XLA's cost analysis of the forward beside the estimate's counts (the TPU compiler gives
    # one, the GPU's nothing)
    xla = result["estimate"]["xla"]
    if platform == "gpu":
        assert xla == []
    else:
        assert xla and all(x["xla_flops"] > 0 and x["xla_bytes"] > 0 for x in xla), xla


ONE_ROW_HEAD = """
import json
from dataclasses import dataclass
import jax, jax.numpy as jnp
from jaxserve.runner.compile_only import CompilingFns
from jaxserve.tools.targets import parse_target, target_devices
device = target_devices(parse_target("h100"), 1)[0]
put = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                         sharding=jax.sharding.SingleDeviceSharding(device))
@dataclass
class Fns:  # a step like the runner's head: one row of the carry times a large lm_head
    head: object
fns = CompilingFns(Fns(jax.jit(lambda last, w: (last[:1] @ w).astype(jnp.float32))), "gpu",
                   device, device)
out = fns.head(put((6, 512)), put((512, 128256)))
print(json.dumps({"failed": fns.failed, "notes": [c.note for c in fns.compiled],
                  "shape": list(out.shape)}))
"""


def test_a_step_xla_refuses_untuned_is_compiled_with_cublas_and_says_so():
    """Deviceless, XLA cannot autotune its Triton GEMM, and the untuned tile of a one-row
    matmul with a large output fails to emit: the compile is retried with cuBLAS's GEMMs (as a
    live GPU's autotuner may choose) and the step's report says so."""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "1"}
    out = subprocess.run([sys.executable, "-c", ONE_ROW_HEAD], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"failed": {}, "notes": ["cuBLAS GEMMs"], "shape": [1, 128256]}
