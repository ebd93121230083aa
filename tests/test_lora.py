"""LoRA adapters served side by side (jaxserve/model/lora.py): token-exact against transformers +
PEFT (fixtures from make_lora_fixtures.py: three adapters of different ranks and targets on the
tiny Llama, Qwen3 and Gemma 3 checkpoints), in one batch with base requests and each other,
batch invariant; the adapters' files checked; the scheduler's bound on adapters per step; the
prefix cache keyed by adapter; loading and unloading while requests run."""

import json
import shutil

import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.llm_engine import UnknownLoRAError
from jaxserve.model.lora_files import read_adapter
from jaxserve.request import Request

ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk_sizes=(32,),
              page_size=8, num_pages=256, max_model_len=128, enable_lora=True, max_loras=2,
              max_lora_rank=16)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _expected(name):
    lora = json.loads((HF_FIXTURES / name / "lora" / "expected.json").read_text())
    base = json.loads((HF_FIXTURES / name / "expected.json").read_text())
    return lora, [ids[:lora["new_tokens"]] for ids in base["greedy"]]


def _loras(name) -> dict[str, LoRARequest]:
    lora, _ = _expected(name)
    return {a: LoRARequest(a, i + 1, str(HF_FIXTURES / name / "lora" / a))
            for i, a in enumerate(lora["adapters"])}


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llms():
    """One engine a model, built when a test first asks (max_loras 2 < three adapters: slots
    are taken back and written again; the llama engine keeps two adapters on the host)."""
    made = {}

    def get(name, **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in made:
            made[key] = LLM(str(HF_FIXTURES / name), **ENGINE | extra)
        return made[key]

    return get


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_adapters_mixed_with_base_requests_match_peft(name, llms):
    """Every (prompt, adapter or base) pair in one generate call: each request's greedy ids
    are transformers + PEFT's (the adapter merged into the base) and the base's own."""
    expected, base = _expected(name)
    loras = _loras(name)
    llm = llms(name, **({"max_cpu_loras": 2} if name == "llama" else {}))
    prompts, requests, want = [], [], []
    for i, prompt in enumerate(expected["prompts"]):
        for adapter in [None, *loras]:
            prompts.append({"prompt_token_ids": prompt})
            requests.append(None if adapter is None else loras[adapter])
            want.append(base[i] if adapter is None else
                        expected["adapters"][adapter]["greedy"][i])
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)) == want
    # and each adapter alone, all its prompts together
    for adapter, lora in loras.items():
        got = _ids(llm.generate([{"prompt_token_ids": p} for p in expected["prompts"]], GREEDY,
                                use_tqdm=False, lora_request=lora))
        assert got == expected["adapters"][adapter]["greedy"], adapter
    # writing adapters into slots compiled nothing past the warm-up (the steps neither)
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0


@pytest.mark.parametrize("matmul", ["cpu", "xla"])
def test_stacked_layers_serve_adapters(llms, matmul):
    """Layers stacked under jax.lax.scan hold each bank with a leading layer axis; with XLA's
    matmuls the banks' grouped products are jax.lax.ragged_dot's (the GPU's and TPU's)."""
    expected, base = _expected("llama")
    loras = list(_loras("llama").values())
    llm = llms("llama", scan_layers=True, matmul_impl=matmul)
    prompts = [{"prompt_token_ids": p} for p in expected["prompts"]]
    got = _ids(llm.generate(prompts * 2, GREEDY, use_tqdm=False,
                            lora_request=[loras[2]] * 4 + [None] * 4))
    assert got == expected["adapters"][loras[2].lora_name]["greedy"] + base


def test_a_request_s_logprobs_do_not_depend_on_its_step_s_adapters(llms):
    """Batch invariance: a request's logprobs, to the bit, alone and beside other adapters'
    and base requests (the CPU's grouped kernel computes each row alone)."""
    expected, _ = _expected("qwen3")
    loras = list(_loras("qwen3").values())
    llm = llms("qwen3")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": expected["prompts"][3]}

    def logprobs(output):
        return [(t, lp.logprob) for step in output.outputs[0].logprobs for t, lp in step.items()]

    alone = llm.generate([prompt], params, use_tqdm=False, lora_request=loras[1])[0]
    others = [{"prompt_token_ids": p} for p in expected["prompts"]]
    mixed = llm.generate([*others, prompt], params, use_tqdm=False,
                         lora_request=[loras[0], None, loras[1], None, loras[1]])[-1]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    assert logprobs(mixed) == logprobs(alone)


def test_prefix_cache_pages_serve_their_adapter_only(llms):
    """The same long prompt, run by the base model first: the adapter's request finds none of
    its pages and gives what it gives with an empty cache."""
    llm = llms("llama")
    lora = _loras("llama")["attn_r4"]
    prompt = {"prompt_token_ids": [int(t) for t in np.random.RandomState(7).randint(3, 128, 40)]}
    assert llm.reset_prefix_cache()
    fresh = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert llm.reset_prefix_cache()
    llm.generate([prompt], GREEDY, use_tqdm=False)  # the base's pages cached
    after = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]  # its own
    assert again.num_cached_tokens == 32  # the full pages before the last token
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_unloading_an_adapter_lets_its_requests_finish(llms):
    """remove_lora while its requests run: they finish with it; new ones cannot name it."""
    expected, base = _expected("llama")
    loras = _loras("llama")
    engine = llms("llama").engine
    lora = loras["all_r8_rslora"]
    engine.add_lora(lora)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, GREEDY, lora_request=r).request_id
           for p, r in zip(expected["prompts"], [lora, None, lora, None], strict=True)]
    engine.step()
    engine.step()
    assert engine.remove_lora(lora.lora_name) and lora.lora_name not in engine.list_loras()
    assert not engine.remove_lora(lora.lora_name)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    want = expected["adapters"][lora.lora_name]["greedy"]
    assert [outputs[i].outputs[0].token_ids for i in ids] == [want[0], base[1], want[2], base[3]]
    engine.auto_load_loras = False  # (the server's rule)
    try:
        with pytest.raises(UnknownLoRAError, match="all_r8_rslora"):
            engine.add_request(None, {"prompt_token_ids": [5, 6]}, GREEDY, lora_request=lora)
    finally:
        engine.auto_load_loras = True


def test_lora_requests_and_options_are_checked(llms):
    llm = llms("llama")
    lora = _loras("llama")["attn_r4"]
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request="attn_r4")
    with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=[lora, lora])
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
    with pytest.raises(ValueError, match="loaded as"):  # another path under its name
        llm.generate([prompt], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("attn_r4", lora.lora_int_id, "/elsewhere"))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter"):
        llm.engine.add_lora(LoRARequest("another", 1, lora.lora_path))
    for bad in (dict(lora_name="", lora_int_id=1), dict(lora_name="a", lora_int_id=0),
                dict(lora_name="a", lora_int_id=True)):
        with pytest.raises(ValueError, match=r"lora_name|lora_int_id"):
            LoRARequest(**bad)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=0)
    plain = LLM(str(HF_FIXTURES / "llama"), **ENGINE | {"enable_lora": False})
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
    # a base request beside an adapter's gives the bits of an engine without banks
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    with_banks = llm.generate([prompt, prompt], params, use_tqdm=False,
                              lora_request=[None, lora])[0]
    without = plain.generate([prompt], params, use_tqdm=False)[0]
    assert with_banks.outputs[0].token_ids == without.outputs[0].token_ids
    assert with_banks.outputs[0].logprobs == without.outputs[0].logprobs


def _copy(name, adapter, tmp_path):
    out = tmp_path / adapter
    shutil.copytree(HF_FIXTURES / name / "lora" / adapter, out)
    return out


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | changes))


def _edit_tensors(path, edit):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file(edit(tensors), str(path / "adapter_model.safetensors"))


def test_bad_adapters_are_refused_naming_what(tmp_path):
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / "llama")
    good = read_adapter(HF_FIXTURES / "llama" / "lora" / "mlp_r16_patterns", cfg, 16)
    assert good.rank == 16 and good.modules == ["o_proj", "gate_proj", "down_proj"]
    assert not good.weights[(0, "down_proj")][0][:, 12:].any()  # rank_pattern: 12, padded
    cases = {
        "use_dora": (dict(use_dora=True), None, "DoRA"),
        "bias": (dict(bias="all"), None, "bias 'all'"),
        "modules_to_save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
        "peft_type": (dict(peft_type="IA3"), None, "peft_type 'IA3'"),
        "alpha": (dict(lora_alpha="big"), None, "lora_alpha 'big'"),
        "shape": ({}, lambda t: {k: (v[:, :-1] if "q_proj.lora_A" in k else v)
                                 for k, v in t.items()}, r"layers\.0\.self_attn\.q_proj"),
        "rank": ({}, lambda t: {k: np.concatenate([v] * 5, axis=0 if "lora_A" in k else 1)
                                for k, v in t.items()}, "rank 20, past max_lora_rank 16"),
        "embedding": ({}, lambda t: t | {"base_model.model.model.embed_tokens.lora_embedding_A":
                                         np.zeros((4, 128), np.float32)}, "embedding"),
        "module": ({}, lambda t: {k.replace("q_proj", "qq_proj"): v for k, v in t.items()},
                   "target 'qq_proj'"),
        "layer": ({}, lambda t: {k.replace("layers.1.", "layers.9."): v for k, v in t.items()},
                  "layers.9"),
        "half": ({}, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}, "lora_B"),
    }
    for case, (config, tensors, message) in cases.items():
        path = _copy("llama", "attn_r4", tmp_path / case)
        if config:
            _edit_config(path, **config)
        if tensors is not None:
            _edit_tensors(path, tensors)
        with pytest.raises(ValueError, match=message):
            read_adapter(path, cfg, 16)
    path = _copy("llama", "attn_r4", tmp_path / "bin")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is PyTorch's pickle"):
        read_adapter(path, cfg, 16)
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        read_adapter(tmp_path, cfg, 16)
    with pytest.raises(ValueError, match="not a directory"):
        read_adapter(tmp_path / "nowhere", cfg, 16)
    moe = ModelConfig.from_hf_dir(HF_FIXTURES / "qwen3_moe")
    path = _copy("qwen3", "all_r8_rslora", tmp_path / "moe")
    _edit_tensors(path, lambda t: {k: v for k, v in t.items() if "mlp" in k})
    with pytest.raises(ValueError, match="mixtures of experts"):
        read_adapter(path, moe, 16)


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    """Requests of a third adapter wait until one of the two running adapters has no
    request left; base requests and those of running adapters join meanwhile."""
    scheduler = Scheduler(num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          max_chunk_tokens=16, max_loras=2)
    loras = [None, LoRARequest("a", 1, "x"), LoRARequest("b", 2, "x"),
             LoRARequest("c", 3, "x"), LoRARequest("a", 1, "x")]
    for i, lora in enumerate(loras):
        scheduler.add_request(Request(str(i), [5, 6, 7], GREEDY, float(i), 0, 6, frozenset(),
                                      lora_request=lora))
    scheduler.schedule()
    running = {r.request_id for r in scheduler.running}
    assert running == {"0", "1", "2", "4"}
    assert {r.lora_name for r in scheduler.running} - {None} == {"a", "b"}
    for request in [r for r in scheduler.running if r.lora_name == "b"]:
        scheduler.abort(request.request_id)
    scheduler.schedule()
    assert "3" in {r.request_id for r in scheduler.running}
