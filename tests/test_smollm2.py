"""SmolLM2-135M-Instruct, our real-weights reference (issue 52): its Q4_1 GGUF from the package
registry (jaxserve/tools/fetch.py; cached), against what transformers gave on the same file
(tests/fixtures/make_smollm2_reference.py -> smollm2_reference.json): the tokenizer and chat
template built from the file's metadata, greedy ids batched and alone, a few positions'
logits, and the official openai client asking for the capital of France."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from served import uvicorn_url
from test_model_hf import full_logits

from jaxserve import LLM, SamplingParams
from jaxserve.config.model import ModelConfig
from jaxserve.model.loader import load_state, state_bytes
from jaxserve.tools.fetch import fetch_smollm2

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "smollm2_reference.json").read_text())
ENGINE = dict(max_num_seqs=16, max_model_len=256, page_size=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(str(smollm2), **ENGINE)


def test_the_file_is_the_one_the_reference_was_made_on(smollm2):
    assert smollm2.stat().st_size == REFERENCE["gguf"]["size"]
    assert (smollm2.parent / "LICENSE").is_file()  # Apache-2.0 travels beside it


def test_the_tokenizer_and_chat_template_from_the_file_give_transformers_ids(llm):
    tokenizer = llm.get_tokenizer()
    for text, ids in REFERENCE["encodings"].items():
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for prompt in REFERENCE["prompts"]:
        rendered = tokenizer.apply_chat_template(prompt["messages"])
        assert tokenizer.chat_prompt_ids(rendered) == prompt["prompt_ids"], prompt["name"]
    assert llm.llm_engine.model_config.eos_token_ids == (2,)


def test_greedy_ids_equal_transformers_batched_and_alone(llm):
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p["prompt_ids"]} for p in REFERENCE["prompts"]]
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    for prompt, ids in zip(REFERENCE["prompts"], batched, strict=True):
        assert ids == prompt["generated_ids"], prompt["name"]
    for prompt, ids in zip(prompts[::3], batched[::3], strict=True):  # alone
        assert list(llm.generate([prompt], params)[0].outputs[0].token_ids) == ids
    text = llm.get_tokenizer().decode(batched[0])
    assert text.startswith("The capital of France is Paris.")


def test_logits_at_positions_equal_transformers(smollm2):
    cfg = ModelConfig.from_hf_dir(smollm2)
    graphdef, state = load_state(smollm2, cfg, jnp.float32)
    # the Q4_1 layers and the Q8_0 embedding held as stored: about the file's bytes
    assert state_bytes(state) == pytest.approx(smollm2.stat().st_size, rel=0.05)
    prompts = {p["name"]: p for p in REFERENCE["prompts"]}
    for name in dict.fromkeys(entry["name"] for entry in REFERENCE["logits"]):
        prompt = prompts[name]
        logits = full_logits(graphdef, state, cfg, prompt["prompt_ids"] + prompt[
            "generated_ids"])
        for entry in (e for e in REFERENCE["logits"] if e["name"] == name):
            ours = logits[entry["position"]]
            top = np.argsort(-ours, kind="stable")[:10]
            assert list(top[:3]) == entry["ids"][:3], (name, entry["position"])
            np.testing.assert_allclose(ours[entry["ids"]], entry["values"], atol=2e-3)


def test_the_official_client_asks_for_the_capital_of_france(smollm2):
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server import ServerConfig, build_app

    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig.from_overrides(**ENGINE)))
    app = build_app(engine, ServerConfig(), "smollm2")
    with uvicorn_url(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
