"""Tensor and data parallelism (jaxserve/parallel/sharding.py, LLMEngine's replicas) on 8 host CPU
devices: each model's logits and greedy ids against one device, batch invariance within each
configuration, each device's share of the weights and the KV pool, the decode step's
collectives, stories260K's C-reference ids at tp=4 and over dp=2 x tp=2.
The 8 devices need XLA_FLAGS before jax starts, so tensor_parallel_cases.py runs them in a
process of its own and reports JSON; bad settings are checked here, on this process's devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.parallel.sharding import check_tensor_parallel
from jaxserve.tools.plan import Device, plan

HERE = Path(__file__).resolve().parent
MODELS = ("llama", "qwen2", "mistral", "phi3", "stories260K")
# mixtures of experts: each expert split over tp=2, and whole experts over 4 devices (_ep)
MOE = ("mixtral", "qwen3_moe", "mixtral_ep", "qwen3_moe_ep")
# quantization="int8" / "fp8" on those checkpoints; int4 checkpoints, scales per column and
# per group of input rows; an AWQ one (zero points per group); a GGUF's Q4_1 layers and Q8_0
# embedding, held (XLA's dot) and dequantised at load (the CPU's kernels)
QUANTISED = ("llama_int8", "qwen2_fp8", "llama_w4a16", "llama_w4a16_g32", "llama_awq",
             "llama_gguf", "llama_w4a16_g32_xla", "llama_awq_xla", "llama_gguf_xla")
# those whose narrow kernels the devices hold (the CPU's kernels dequantise group-wise ones)
HELD = ("llama_int8", "qwen2_fp8", "llama_w4a16", "llama_w4a16_g32_xla", "llama_awq_xla",
        "llama_gguf_xla")


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(HERE / "tensor_parallel_cases.py")], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("model", MODELS + QUANTISED + MOE)
def test_logits_within_1e_5_of_one_device_and_the_same_greedy_ids(report, model):
    runs = report[model]
    one = np.array(runs["1"]["logits"])
    for tp, run in runs.items():
        logits = np.array(run["logits"])
        # float32 sums of the shards' partial products, in another order than one device's;
        # stories260K's logits run to about 20, the tiny random models' to about 1
        tolerance = 1e-5 * max(1.0, float(np.abs(one).max()) / 10)
        assert np.abs(logits - one).max() <= tolerance, (tp, np.abs(logits - one).max())
        assert run["ids"] == runs["1"]["ids"], tp


def test_lora_adapters_split_with_their_layers_give_pefts_ids(report):
    """LoRA banks split as their layers (B by columns, A by rows; k's and v's B with their
    heads repeated at tp 4): PEFT's greedy ids, base requests beside adapters', at tp 1, 2, 4;
    no compile after warm-up (slot writes on split banks included)."""
    lora = report["lora"]
    for tp in ("1", "2", "4"):
        assert lora[tp]["ids"] == lora["expected"], tp
        assert lora[tp]["compiles"] == 0, tp


def test_random_weights_made_on_their_shards_are_one_devices(report):
    """load_format="dummy" at tp=4 makes each weight on its shards, the values tp=1 makes."""
    one, four = (np.array(report["dummy_logits"][tp]) for tp in ("1", "4"))
    assert np.abs(four - one).max() <= 1e-5


def test_stories260k_gives_the_c_references_ids_at_tp4(report):
    assert report["stories260K_reference"]["ids"] == report["stories260K_reference"]["expected"]


@pytest.mark.parametrize("model", ("llama", "qwen2", "mistral"))
def test_data_parallel_replicas_give_one_devices_logits_and_ids(report, model):
    """dp=2 x tp=2 (and 4 x 1): the requests spread over the replicas, each replica on its own
    devices, one device's greedy ids, its last replica's logits within 1e-5, batch
    invariance within the configuration, no compile after warm-up."""
    one = report[model]["1"]
    for sizes, run in report["data_parallel"][model].items():
        dp, tp = map(int, sizes.split("x"))
        assert np.abs(np.array(run["logits"]) - np.array(one["logits"])).max() <= 1e-5, sizes
        assert run["ids"] == one["ids"] and run["alone_same"], sizes
        assert run["compilations_after_warmup"] == 0, sizes
        assert all(n > 0 for n in run["steps_per_replica"][:len(one["ids"])]), sizes
        assert [len(d) for d in run["devices"]] == [tp] * dp, sizes
        assert sorted(d for ds in run["devices"] for d in ds) == list(range(dp * tp)), sizes


def test_the_prefix_cache_over_sharded_pools_gives_the_same_ids_and_logprobs(report):
    """Prompts sharing three pages' prefix, the later ones finding them cached: at tp=2 and at
    dp=2 x tp=2 (each replica its own cache) the ids and logprobs (bit for bit) of tp=2
    without the cache."""
    runs = dict(report["prefix_cached"])
    plain = runs.pop("1x2 off")
    assert plain["hits"] == 0
    for sizes, run in runs.items():
        assert run["ids"] == plain["ids"] and run["logprobs"] == plain["logprobs"], sizes
        assert run["hits"] >= 3 * 8, sizes  # at least one request took the three pages
        assert run["compilations_after_warmup"] == 0, sizes


def test_the_tpu_attention_runs_per_shard_of_a_mesh(report):
    run = report["tpu_attention"]
    assert run["tpu"] == run["reference"] and len({t for ids in run["tpu"] for t in ids}) > 3


def test_greedy_rows_take_the_argmax_of_the_whole_vocabulary_from_the_shards(report):
    """Ties across shards and within one, a row with NaN, all tied: first_argmax's ids."""
    assert report["sharded_greedy"]["split"] == report["sharded_greedy"]["whole"]


def test_stories260k_gives_the_c_references_ids_over_two_replicas(report):
    run = report["stories260K_reference_dp"]
    assert run["ids"] == run["expected"]


def test_sampler_controls_structured_output_and_prompt_logprobs_as_on_one_device(report):
    """Penalties, a seeded min_p sample, a choice grammar and prompt logprobs at tp=2: the ids,
    text and prompt logprobs' tokens of tp=1, and no compile after warm-up."""
    runs = report["stories260K_controls"]
    assert runs["2"] == runs["1"]
    *outputs, compilations = runs["2"]
    assert outputs[2][1] in ("Lily", "Tom") and outputs[0][2] and compilations == 0


@pytest.mark.parametrize("model", MODELS + tuple(q for q in QUANTISED if not q.endswith("_xla"))
                         + MOE)
def test_batch_invariance_holds_in_each_configuration(report, model):
    """A prompt alone gives the bits it gives in a batch (ids and logprobs), at every tp (on
    the CPU's kernels: XLA's dot there is not batch invariant)."""
    for tp, run in report[model].items():
        assert run["alone_same"], tp


@pytest.mark.parametrize("model", MODELS + MOE)
def test_each_device_holds_its_share_of_every_split_weight_and_the_kv_pool(report, model):
    """Every weight split tp ways but the norms (and a mixture of experts' router): experts
    by their columns, or (_ep) whole experts, a tp-th of them on each device."""
    for tp, run in report[model].items():
        tp = int(tp)
        weights = run["bytes"]["weights"]
        router = {k for k in weights if "'gate'" in k}
        assert bool(router) == (model in MOE), router
        for name in router:
            assert weights[name][0] == weights[name][1], (tp, name)
        split = {k: v for k, v in weights.items() if "norm" not in k and k not in router}
        assert split, weights
        for name, (local, whole) in split.items():
            assert local * tp == whole, (tp, name, local, whole)
        for name, (local, whole) in weights.items():
            if "norm" in name:  # the norms' weights: whole on every device
                assert local == whole, (tp, name)
        for local, whole in run["bytes"]["kv"]:
            assert local * tp == whole, (tp, local, whole)


@pytest.mark.parametrize("model", HELD)
def test_quantised_kernels_and_their_scales_split_with_their_layers(report, model):
    """A narrow kernel splits as its float one does; its scales (one per output column) split
    with the columns of q/k/v and gate/up and stay whole beside o_proj's and down_proj's;
    group-wise scales [groups, out] (and a GGUF's minima) split as their kernel does, by rows
    or by columns; a narrow embedding's by vocabulary."""
    for tp, run in report[model].items():
        tp = int(tp)
        for name, (local, whole) in run["bytes"]["weights"].items():
            rows = any(f"'{proj}'" in name for proj in ("o_proj", "down_proj"))
            # column scales stay whole beside a row split; group-wise ones split with it
            whole_here = "norm" in name or (rows and "'scale'" in name)
            assert local * (1 if whole_here else tp) == whole, (tp, name, local, whole)
        scales = [k for k in run["bytes"]["weights"] if "scale" in k]
        embedding = any("embed_tokens" in k for k in scales)  # a GGUF's Q8_0 one
        layers = 1 if run["scan_layers"] else run["num_layers"]  # a stack: one name
        assert len(scales) == 7 * layers + embedding


@pytest.mark.parametrize("model", MODELS + QUANTISED + MOE)
def test_no_step_gathers_a_weight_and_none_compiles_after_warm_up(report, model):
    """The decode step gathers only activations: the logits [rows, vocab] (a call with a row
    that samples or wants logprobs), the shards' maxima and their ids [shards, rows] (a call
    of greedy rows) and, on the CPU backend, the shards' partial sums [shards, rows, 1,
    hidden]."""
    for tp, run in report[model].items():
        assert run["compilations_after_warmup"] == 0, tp
        rows, hidden, vocab = run["rows"], run["hidden_size"], run["vocab_size"]
        allowed = {f"f32[{rows},{vocab}]", f"f32[{tp},{rows},1,{hidden}]", f"f32[{tp},{rows}]",
                   f"s32[{tp},{rows}]"}
        for shape in run["collectives"]["all_gathers"]:
            assert shape in allowed, (tp, shape, allowed)


def test_the_decode_step_sums_twice_a_layer(report):
    """Two sums a layer (after o_proj, after down_proj) and one for the embedding; the logits
    gathered once. XLA's dot (reference backend, layers scanned: one layer's body): all-reduces;
    the CPU kernels (layers unrolled): the parts gathered and added in shard order (the
    all-reduce's order changes with the rows). A mixture of experts sums its experts' shares
    once, as a dense MLP its columns'. The head: the logits gathered, or (greedy rows) the
    shards' maxima and their ids."""
    for model in MODELS + MOE:
        for tp, run in report[model].items():
            collectives = run["collectives"]
            if tp == "1":
                assert collectives == {"all_reduces": 0, "all_gathers": []}
            else:
                assert not run["scan_layers"]
                assert collectives["all_reduces"] == 0
                assert len(collectives["all_gathers"]) == 2 * run["num_layers"] + 4, (model, tp)
    reference = report["llama_reference_backend"]["2"]
    assert reference["scan_layers"]
    assert reference["collectives"]["all_reduces"] == 2 + 1
    assert len(reference["collectives"]["all_gathers"]) == 3  # the logits, or maxima and ids
    assert reference["ids"] == report["llama_reference_backend"]["1"]["ids"]


def test_plan_gives_each_devices_bytes_as_the_runner_holds_them(report):
    """`jaxserve plan -tp 4` on stories260K: one device's weights and share of a page, as the
    tp=4 runner's arrays hold them."""
    result = plan(HERE.parent / "models" / "stories260K",
                  EngineConfig(tensor_parallel_size=4, page_size=8),
                  device=Device("cpu", "cpu", None, None))
    held = report["stories260K"]["4"]["bytes"]
    assert result["weight_bytes_per_device"] == sum(local for local, _ in held["weights"].values())
    pages = report["stories260K"]["4"]["num_pages"]
    assert result["kv_bytes_per_page_per_device"] * pages == sum(local for local, _ in held["kv"])
    assert not result["problems"]
    bad = plan(HERE.parent / "models" / "stories260K", EngineConfig(tensor_parallel_size=3),
               device=Device("cpu", "cpu", None, None))
    assert any("does not divide the model's 8 attention heads" in p for p in bad["problems"])


def _config(**changes) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", num_heads=4, num_kv_heads=2,
                intermediate_size=128, vocab_size=128, o_bias=False, num_experts=0,
                head_dim=16, quantization_group_size=None, quantization_act_order=False,
                moe_intermediate_size=0, shared_expert_intermediate_size=0)
    return type("Cfg", (), dict(base, **changes))()


def test_bad_tensor_parallel_settings_are_clear_errors_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 "
                                         "attention heads"):
        check_tensor_parallel(_config(), 3, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's "
                                         "102 MLP intermediate size"):
        check_tensor_parallel(_config(intermediate_size=102), 4, 8)
    with pytest.raises(ValueError, match="does not divide the model's 129 vocabulary"):
        check_tensor_parallel(_config(vocab_size=129), 2, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 and the model's 3 KV heads"):
        check_tensor_parallel(_config(num_heads=12, num_kv_heads=3), 4, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 needs 8 devices; 2 found"):
        check_tensor_parallel(_config(), 8, 2)
    # a mixture of experts: its experts' columns, or with expert parallelism the experts
    moe = dict(num_experts=6, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 "
                                         r"experts \(enable_expert_parallel\)"):
        check_tensor_parallel(_config(**moe), 4, 8, expert_parallel=True)
    check_tensor_parallel(_config(**moe), 4, 8)  # 32 columns split 4 ways
    with pytest.raises(ValueError, match="does not divide the model's 20 shared expert's"):
        check_tensor_parallel(_config(**moe, shared_expert_intermediate_size=20, num_heads=8,
                                      num_kv_heads=8, vocab_size=128), 8, 8)
    with pytest.raises(ValueError, match="enable_expert_parallel: the LlamaForCausalLM model "
                                         "has no experts"):
        check_tensor_parallel(_config(), 2, 8, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(HERE / "fixtures" / "hf" / "llama", tensor_parallel_size=0)
    devices = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {devices + 1} devices; {devices} found"):
        LLM(HERE / "fixtures" / "hf" / "llama", tensor_parallel_size=devices + 1)
