"""LoRA adapters over HTTP (vLLM's surface): --lora-modules, a request naming an adapter as its
model, /v1/models listing adapters with their parent, /v1/load_lora_adapter and
/v1/unload_lora_adapter while 32 streams run, unknown adapters a 404 in the error envelope,
lora_requests_info in /metrics. stories260K with PEFT adapters (make_lora_fixtures.py)."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from served import AUTH, KEY, MODEL, uvicorn_url

from jaxserve import LLM, LoRARequest, SamplingParams

ADAPTERS = Path(__file__).resolve().parent / "fixtures" / "lora" / "stories260K"
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk_sizes=(32,),
              page_size=8, num_pages=256, max_model_len=256, enable_lora=True, max_loras=2)
TOKENS = 24


def _cases():
    expected = json.loads((ADAPTERS / "expected.json").read_text())
    return expected["prompts"], expected["adapters"]


@pytest.fixture(scope="module")
def reference(stories_dir):
    """Offline texts of every (prompt, adapter) pair, checked against PEFT's ids first."""
    prompts, adapters = _cases()
    llm = LLM(stories_dir, **ENGINE)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    texts = {}
    for i, name in enumerate([None, *adapters]):
        lora = None if name is None else LoRARequest(name, i, str(ADAPTERS / name))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=lora)
        if name is not None:
            assert [o.outputs[0].token_ids for o in outs] == [
                ids[:TOKENS] for ids in adapters[name]["greedy"]]
        texts[name] = [o.outputs[0].text for o in outs]
    return texts


@pytest.fixture(scope="module")
def lora_server(stories_dir, reference):
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server import ServerConfig, build_app
    from jaxserve.server.app import load_lora_modules

    engine = LLMEngine(stories_dir, EngineConfig.from_overrides(**ENGINE))
    config = ServerConfig(api_key=KEY, lora_modules=(f"attn_r4={ADAPTERS / 'attn_r4'}",
                                                     f"mlp={ADAPTERS / 'mlp_r16_patterns'}"))
    load_lora_modules(engine, config)
    app = build_app(AsyncEngine(engine), config, MODEL)
    with uvicorn_url(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        yield SimpleNamespace(url=url, http=http)


def _complete(http, model, prompt, **extra):
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0,
                                              "max_tokens": TOKENS, "ignore_eos": True} | extra)


def test_models_list_the_adapters_with_their_parent(lora_server):
    cards = {c["id"]: c for c in lora_server.http.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "attn_r4", "mlp"}
    assert cards["attn_r4"]["parent"] == MODEL and cards[MODEL]["parent"] is None
    assert cards["mlp"]["root"] == str(ADAPTERS / "mlp_r16_patterns")


def test_a_request_names_its_adapter_as_its_model(lora_server, reference):
    prompts, _ = _cases()
    http = lora_server.http
    for name, adapter in ((None, MODEL), ("attn_r4", "attn_r4"), ("mlp_r16_patterns", "mlp")):
        body = _complete(http, adapter, prompts[1]).json()
        assert body["model"] == adapter
        assert body["choices"][0]["text"] == reference[name][1]
    response = _complete(http, "nobody", prompts[0])
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and "`attn_r4`" in error["message"]


def test_load_use_and_unload_while_32_streams_run(lora_server, reference):
    """32 streams (base and attn_r4) run while another adapter is loaded, used and unloaded:
    each stream's text is its reference, and the new adapter's answer is PEFT's."""
    prompts, _ = _cases()
    new = ADAPTERS / "all_r8_rslora"

    async def stream(client, i):
        model = "attn_r4" if i % 2 else MODEL
        body = {"model": model, "prompt": prompts[i % 4], "temperature": 0, "max_tokens": TOKENS,
                "ignore_eos": True, "stream": True}
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text == reference["attn_r4" if i % 2 else None][i % 4]

    async def manage(client):
        await asyncio.sleep(0.05)
        load = {"lora_name": "all", "lora_path": str(new)}
        response = await client.post("/v1/load_lora_adapter", json=load)
        assert response.status_code == 200, response.text
        assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 400
        body = {"model": "all", "prompt": prompts[2], "temperature": 0, "max_tokens": TOKENS,
                "ignore_eos": True}
        answer = (await client.post("/v1/completions", json=body)).json()
        assert answer["choices"][0]["text"] == reference["all_r8_rslora"][2]
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
        assert response.status_code == 200, response.text
        assert (await client.post("/v1/completions", json=body)).status_code == 404
        again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
        assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"

    async def main():
        async with httpx.AsyncClient(base_url=lora_server.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            streams = [asyncio.ensure_future(stream(client, i)) for i in range(32)]
            await manage(client)
            return await asyncio.gather(*streams)

    assert all(asyncio.run(main()))


def test_bad_adapter_loads_are_400s_naming_the_field(lora_server, tmp_path):
    http = lora_server.http
    for body, param in (({"lora_path": "x"}, "lora_name"), ({"lora_name": "x"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": str(tmp_path)}, "lora_path"),
                        ({"lora_name": "attn_r4", "lora_path": str(tmp_path)}, "lora_name")):
        response = http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    assert "no adapter_config.json" in http.post("/v1/load_lora_adapter", json={
        "lora_name": "x", "lora_path": str(tmp_path)}).json()["error"]["message"]


def test_metrics_report_the_adapters(lora_server):
    text = lora_server.http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("jaxserve:lora_requests_info"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line
