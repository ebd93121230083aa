"""The benchmark commands at tiny sizes on stories260K: `jaxserve bench throughput | serve |
sweep` and `jaxserve plan` write what they promise (vLLM's keys, completed == num_prompts,
ordered percentiles, PNGs, a recommended config that loads), and the pure parts of the workloads,
the serving arithmetic and the sweep are right. The scripts under bench/: test_bench_scripts.py."""

import json
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml
from bench_scripts import ROOT, _load
from served import uvicorn_url

from jaxserve.benchmarks.datasets import (
    Sample,
    batching_samples,
    dataset_of,
    get_samples,
    load_samples,
)
from jaxserve.benchmarks.metrics import peak_output_rate
from jaxserve.benchmarks.offline import run_load
from jaxserve.benchmarks.serve import serve_arrivals, set_output_len
from jaxserve.benchmarks.sweep import knee, largest_meeting, recommend
from jaxserve.cli import main
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server import ServerConfig, build_app
from jaxserve.sim.metrics import RequestRecord, parse_slos, percentile_key

# the server tests' engine shape: every step is already in the persistent compilation cache
CONFIG = dict(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_sizes=(32,),
              page_size=8, num_pages=256, enable_prompt_logprobs=False)
FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--prefill-chunk-sizes", "32",
         "--page-size", "8", "--num-pages", "256", "--no-enable-prompt-logprobs"]
TINY = ["--input-len", "16", "--output-len", "8", "--disable-tqdm"]
LATENCY = ("ttft", "tpot", "itl", "e2el")


def _check_serving(result: dict, n: int, percentiles=("p50", "p90", "p99")) -> None:
    assert result["completed"] == n and result["failed"] == 0
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    for name in LATENCY:
        values = [result[f"{p}_{name}_ms"] for p in percentiles]
        assert values == sorted(values) and values[0] >= 0, (name, values)
        assert result[f"mean_{name}_ms"] > 0 or name == "itl"


# -- pure parts ---------------------------------------------------------------------------------


def test_workloads(tmp_path):
    samples = get_samples("random", 50, input_len=100, output_len=20, range_ratio=0.5,
                          vocab_size=300, seed=1)
    assert all(50 <= s.prompt_len <= 150 and 10 <= s.output_len <= 30 for s in samples)
    assert all(len(s.prompt) == s.prompt_len and 3 <= min(s.prompt) < max(s.prompt) < 300
               for s in samples)
    fitted = get_samples("sharegpt", 50, input_len=200, output_len=100, vocab_size=300,
                         max_model_len=128)
    assert all(s.prompt_len + s.output_len <= 128 for s in fitted)
    # the workload is bench/batching.py's, draw for draw
    prompts, params = _load(ROOT / "bench" / "batching.py").workload(16, 4096, 3)
    ours = batching_samples(16, 4096, 3)
    assert [s.prompt for s in ours] == [p["prompt_token_ids"] for p in prompts]
    assert [s.output_len for s in ours] == [p.max_tokens for p in params]
    story = "tell me a story about a dragon"  # ~7 tokens at 4 characters a token
    rows = [{"conversations": [{"from": "human", "value": story},
                               {"from": "gpt", "value": "once upon a time, a dragon"}]},
            {"conversations": [{"from": "human", "value": "hi"},  # under 4 tokens: skipped
                               {"from": "gpt", "value": "hello to you, and a good day"}]},
            {"prompt": [5, 6, 7], "output_len": 3}, "a plain prompt"]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for name in ("d.json", "d.jsonl"):
        loaded = load_samples(tmp_path / name, 5, default_output_len=9)
        assert len(loaded) == 5
        assert {(str(s.prompt), s.output_len) for s in loaded} == {
            (story, 6), ("[5, 6, 7]", 3), ("a plain prompt", 9)}
    # a text prompt cannot be cut at a token: one of max_model_len tokens or more is skipped
    # (it used to be counted as trimmed and then refused by the engine, ending the run)
    (tmp_path / "long.json").write_text(json.dumps(["x" * 400, "a short one"]))
    assert {s.prompt for s in load_samples(tmp_path / "long.json", 4, 8,
                                           max_model_len=64)} == {"a short one"}
    with pytest.raises(ValueError, match="every prompt has max_model_len 2 tokens or more"):
        load_samples(tmp_path / "long.json", 4, 8, max_model_len=2)
    vllm_flags = SimpleNamespace(dataset="sharegpt", dataset_path=str(tmp_path / "d.json"))
    assert dataset_of(vllm_flags) == str(tmp_path / "d.json")
    assert dataset_of(SimpleNamespace(dataset="random")) == "random"


def test_serving_arithmetic_as_vllm_does_it():
    # send times: gamma gaps scaled so the last goes out at n / rate; inf burstiness is regular
    times = serve_arrivals(200, 10.0, 1.0, seed=3)
    assert times[-1] == pytest.approx(20.0) and np.all(np.diff(times) >= 0)
    assert np.array_equal(times, serve_arrivals(200, 10.0, 1.0, seed=3))
    assert np.allclose(serve_arrivals(4, 2.0, float("inf"), seed=0), [0.5, 1.0, 1.5, 2.0])
    assert not serve_arrivals(5, float("inf"), 1.0, seed=0).any()
    # the server's usage is the output length, whatever the chunks held
    record = RequestRecord(0.0, 4)
    for t in (1.0, 2.0, 3.0):
        record.deliver(t, 1)
    set_output_len(record, 5)  # the two more spread over the last deliveries
    assert record.counts == [1, 2, 2]
    set_output_len(record, 1)
    assert record.counts == [1, 0, 0] and record.output_len == 1
    # a server that merges outputs sends 200 tokens in 100 chunks: 2 a chunk, a peak of 20/s,
    # not 101 tokens in the last second
    merged = RequestRecord(0.0, 4)
    for i in range(100):
        merged.deliver(0.1 * (i + 1), 1)
    set_output_len(merged, 200)
    assert merged.counts == [2] * 100 and peak_output_rate([merged])[0] == 20
    assert [percentile_key(p) for p in (99, 99.9, 99.99999, 50.0)] == [
        "p99", "p99.9", "p99.99999", "p50"]
    # peak concurrency: a request leaving as another arrives does not overlap it
    a, b, c = RequestRecord(0.0, 1), RequestRecord(1.0, 1), RequestRecord(1.5, 1)
    a.deliver(1.0, 1), b.deliver(2.0, 1), c.deliver(2.5, 1)
    assert peak_output_rate([a, b])[1] == 1 and peak_output_rate([a, b, c])[1] == 2
    with pytest.raises(ValueError, match="non-negative"):
        parse_slos(["ttft:-5"])


class _SlowEngine:
    """An engine whose every step gives each running request one token: run_load's clock."""

    def __init__(self):
        self.running: dict[str, list] = {}
        self.scheduler = SimpleNamespace(next_wakeup=lambda: None, waiting=[],
                                         window=SimpleNamespace(max_batch_size=64))

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.running[rid] = [params.max_tokens, 0]
        return SimpleNamespace(prompt_ids=list(prompt["prompt_token_ids"]))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        import time

        time.sleep(0.02)
        outs = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[
                SimpleNamespace(token_ids=[7] * state[1])]))
            if done:
                del self.running[rid]
        return outs


def test_offline_load_starts_each_clock_at_its_send_time():
    """As vLLM's client: a request is sent at its time (bench serve's send times, the last at
    n / rate), so a step in progress when it comes counts in its TTFT; in a closed loop it is
    sent when a slot frees, which is not TTFT."""
    samples = [Sample([5] * 4, 4, 3) for _ in range(8)]
    run = run_load(_SlowEngine(), samples, request_rate=40.0, seed=1)
    assert [r.arrival for r in run.records] == pytest.approx(
        list(serve_arrivals(8, 40.0, 1.0, seed=1)))
    closed = run_load(_SlowEngine(), samples, max_concurrency=2)
    finished = sorted(r.times[-1] for r in closed.records[:2])
    assert [r.arrival for r in closed.records[2:4]] == pytest.approx(finished)


def test_knee_and_recommendation():
    xs = [1, 2, 4, 8, 16, 32]
    assert knee(xs, [10, 20, 40, 70, 75, 76]) == 8  # flattens after 8
    assert knee(xs, [1, 2, 4, 8, 16, 32]) is None  # still scaling
    assert knee(xs[:5], [100, 101, 99, 100, 102]) == 1  # flat from the start: noise, no knee
    rows = [{"concurrency": c, "batching": "continuous", "failed": 0,
             "output_throughput": 10.0 * c,
             "request_throughput": float(c), "p99_ttft_ms": 100.0 * c, "p99_tpot_ms": 5.0}
            for c in (1, 2, 4, 8, 16)]
    rows[1]["p99_tpot_ms"] = 50.0  # 2 misses the TPOT target: 4 and 8 do not count after it
    slo = {"ttft": 1000.0, "tpot": 20.0}
    assert largest_meeting(rows, "concurrency", slo, "p99")["concurrency"] == 1
    rows[1]["p99_tpot_ms"] = 5.0
    windows = [{"batching": m, "window_ms": w, "failed": 0, "output_throughput": t,
                "p99_ttft_ms": ttft, "p99_tpot_ms": 1.0}
               for m, w, t, ttft in (("dynamic", 0.0, 50, 10), ("dynamic", 50.0, 90, 900),
                                  ("continuous", 0.0, 80, 5), ("continuous", 100.0, 95, 1500))]
    rec = recommend(rows, windows, slo, "p99", 0.2)
    # 8 is the largest concurrency under 1000 ms: 80% of it; the best window meeting the SLO,
    # as measured (a smaller one, never measured, is no safer)
    assert (rec["max_num_seqs"], rec["batching"], rec["window_ms"]) == (6, "dynamic", 50.0)
    assert "continuous batching" in rec["_why_max_num_seqs"]
    assert recommend(rows, windows, {"ttft": 1.0}, "p99", 0.2) == {}
    # every concurrency meets it: the largest swept, not backed off (the limit was not found)
    rec = recommend(rows, [], {"ttft": 60000.0}, "p99", 0.2)
    assert rec["max_num_seqs"] == 16 and "limit lies beyond" in rec["_why_max_num_seqs"]
    # throughputs within 2% are tied: the smaller window wins (then the lower tail TTFT)
    close = [{"batching": m, "window_ms": w, "failed": 0, "output_throughput": t,
              "p99_ttft_ms": ttft, "p99_tpot_ms": 1.0}
             for m, w, t, ttft in (("continuous", 0.0, 121.0, 343), ("dynamic", 0.0, 120.0, 275),
                                   ("continuous", 10.0, 121.2, 300))]
    rec = recommend([], close, slo, "p99", 0.2)
    assert (rec["batching"], rec["window_ms"]) == ("dynamic", 0.0)


# -- the commands -------------------------------------------------------------------------------


def test_plan(stories_dir, capsys):
    before = len(jax.live_arrays())
    assert main(["plan", str(stories_dir), "--json", "--context", "64", "512",
                 "--page-size", "8", "--num-pages", "256", "--max-num-seqs", "16"]) == 0
    assert len(jax.live_arrays()) <= before  # nothing allocated: no weights, no pages
    p = json.loads(capsys.readouterr().out)
    assert p["kv_bytes_per_token"] == 2 * 5 * 4 * 8 * 4  # 2 x layers x kv heads x head_dim x 4
    assert p["kv_bytes_per_page"] == 8 * p["kv_bytes_per_token"]
    assert p["weight_bytes"]["float32"] == 2 * p["weight_bytes"]["bfloat16"] > 4 * 250_000
    assert (p["num_pages"], p["usable_pages"], p["kv_tokens"]) == (256, 255, 2040)
    assert p["concurrency"] == [
        {"context": 64, "pages_per_sequence": 8, "sequences_that_fit": 31, "sequences_running": 16},
        {"context": 512, "pages_per_sequence": 64, "sequences_that_fit": 3, "sequences_running": 3}]
    assert not p["problems"]
    assert p["sampler_state_bytes"] == 17 * (512 * 5 + 1024 * 8)  # 16 slots + padding
    assert main(["plan", str(stories_dir), "--num-pages", "16"]) == 0  # 15 pages < 32 needed
    assert "would refuse to start" in capsys.readouterr().out
    assert main(["plan", str(stories_dir), "--num-pages", "10000000000"]) == 0  # 76 TiB of KV
    assert "exceeds the host memory after the weights" in capsys.readouterr().out
    for context in ("0", "-16", "513"):  # stories260K: max_model_len 512
        assert main(["plan", str(stories_dir), "--context", context]) == 2
        assert "(--context) must be between 1 and max_model_len 512" in capsys.readouterr().err
    # a bf16 model on the CPU keeps its KV cache in float32 (kv_cache_dtype): same bytes
    assert main(["plan", str(stories_dir), "--json", "--dtype", "bfloat16", "--num-pages",
                 "256"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["dtype"], p["kv_dtype"], p["kv_bytes_per_token"]) == ("bfloat16", "float32", 1280)
    # a bfloat16 pool on the CPU (the cpu attention's kernels): half the bytes per token
    assert main(["plan", str(stories_dir), "--json", "--kv-cache-dtype", "bfloat16"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["dtype"], p["kv_dtype"], p["kv_bytes_per_token"]) == ("float32", "bfloat16", 640)


def test_bench_throughput(stories_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(stories_dir), "--num-prompts", "6",
                 *TINY, "--random-range-ratio", "0.5", *FLAGS, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 6 and r["elapsed_time"] > 0
    assert r["requests_per_second"] == pytest.approx(6 / r["elapsed_time"])
    assert r["total_num_tokens"] == pytest.approx(r["tokens_per_second"] * r["elapsed_time"])
    assert r["total_num_tokens"] > r["total_output_tokens"] >= 6 * 4


@pytest.fixture(scope="module")
def server(stories_dir):
    engine = AsyncEngine(LLMEngine(stories_dir, EngineConfig.from_overrides(**CONFIG)))
    with uvicorn_url(build_app(engine, ServerConfig(), "stories")) as url:
        yield url


def test_bench_serve(server, stories_dir, tmp_path):
    assert main(["bench", "serve", "--base-url", server, "--tokenizer", str(stories_dir),
                 "--num-prompts", "10", "--max-concurrency", "4", "--request-rate", "50",
                 "--random-input-len", "16", "--random-output-len", "8",  # EOS ignored: random
                 "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                 "50,90,99", "--goodput", "ttft:60000", "--save-result", "--save-detailed",
                 "--result-dir", str(tmp_path), "--result-filename", "serve.json",
                 "--temperature", "0", "--disable-tqdm"]) == 0
    r = json.loads((tmp_path / "serve.json").read_text())
    _check_serving(r, 10)
    assert r["model_id"] == "stories" and r["max_concurrency"] == 4
    assert r["total_output_tokens"] == sum(r["output_lens"]) == 10 * 8
    assert r["request_goodput"] > 0
    assert len(r["ttfts"]) == len(r["itls"]) == len(r["generated_texts"]) == 10
    assert len(r["start_times"]) == len(r["latencies"]) == 10
    assert all(lat >= ttft > 0 for lat, ttft in zip(r["latencies"], r["ttfts"], strict=True))


def test_bench_sweep_offline(stories_dir, tmp_path):
    config = tmp_path / "recommended.yaml"
    assert main(["bench", "sweep", "--model", str(stories_dir), "--concurrency", "1", "2", "4",
                 "--windows", "0", "20", "--num-prompts", "8", *TINY, *FLAGS,
                 "--slo", "ttft:60000", "tpot:60000", "--output-dir", str(tmp_path),
                 "--write-config", str(config)]) == 0
    conc = json.loads((tmp_path / "concurrency.json").read_text())
    assert [r["concurrency"] for r in conc] == [1, 2, 4]
    for row in conc:
        _check_serving(row, 8)
    window = json.loads((tmp_path / "window.json").read_text())
    assert {(r["batching"], r["window_ms"]) for r in window} == {
        (m, w) for m in ("dynamic", "continuous") for w in (0.0, 20.0)}
    assert all(r["completed"] == 8 for r in window)
    assert all(r["num_compilations"] == 0 for r in conc + window)  # one compile for the sweep
    for name in ("throughput_vs_concurrency", "latency_vs_concurrency", "window_sweep"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "concurrency.csv").read_text().startswith("batching,concurrency,")
    loaded = EngineConfig.from_file(config)
    # every concurrency met the SLO: the largest swept, not backed off
    assert loaded.max_num_seqs == 4 and loaded.batching in ("dynamic", "continuous")
    assert "load_format" not in yaml.safe_load(config.read_text())


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--num-prompts", "-2"], "--num-prompts must be at least 1, got -2"),
    (["throughput", "--output-len", "0"], "--output-len must be at least 1, got 0"),
    (["serve", "--random-input-len", "0"], "--random-input-len must be at least 1, got 0"),
    (["throughput", "--dataset", "sharegtp"], "--dataset 'sharegtp' is neither one of"),
    (["serve", "--request-rate", "0"], "--request-rate must be above 0"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["sweep", "--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
    (["sweep", "--concurrency", "0", "2"], "--concurrency values must be at least 1"),
    (["sweep", "--backoff", "1.5"], r"--backoff must be in \[0, 1\), got 1.5"),
    (["sweep", "--base-url", "http://127.0.0.1:9", "--kind", "concurrency", "window"],
     "the window sweep needs the offline engine"),
    (["sweep", "--base-url", "http://127.0.0.1:9", "--write-config", "c.yaml"],
     "--write-config needs the offline engine"),
])
def test_bench_flags_are_checked_before_anything_runs(argv, message, capsys):
    # the model named does not exist: an error naming the flag must come first
    assert main(["bench", argv[0], "--model", "/nonexistent", *argv[1:]]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_bench_sweep_window_alone_runs_at_the_engines_max_num_seqs(stories_dir, tmp_path):
    config = tmp_path / "recommended.yaml"
    assert main(["bench", "sweep", "--model", str(stories_dir), "--kind", "window", "--windows",
                 "0", "--window-modes", "continuous", "--request-rate", "100", "--num-prompts",
                 "4", *TINY, *FLAGS, "--output-dir", str(tmp_path), "--slo", "ttft:0.001",
                 "--write-config", str(config)]) == 0
    rows = json.loads((tmp_path / "window.json").read_text())
    assert [r["max_num_seqs"] for r in rows] == [8]  # the engine's, not 1
    assert not config.exists()  # nothing met the SLO: no "recommended" file


def test_bench_sweep_modes_preset(stories_dir, tmp_path):
    assert main(["bench", "sweep", "--preset", "modes", "--model", str(stories_dir),
                 "--modes-concurrency", "1", "4", "--num-prompts", "8", *TINY, *FLAGS,
                 "--modes-window-ms", "5", "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "modes.json").read_text())
    assert [(r["batching"], r["concurrency"]) for r in rows] == [
        (m, c) for m in ("static", "dynamic", "continuous") for c in (1, 4)]
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in rows)
    assert (tmp_path / "batching_modes.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_server(server, stories_dir, tmp_path):
    assert main(["bench", "sweep", "--base-url", server, "--tokenizer", str(stories_dir),
                 "--concurrency", "1", "2", "4", "--num-prompts", "6",  # kind: concurrency
                 *TINY, "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "concurrency.json").read_text())
    assert [(r["batching"], r["completed"]) for r in rows] == [("server", 6)] * 3
    assert (tmp_path / "latency_vs_concurrency.png").is_file()
