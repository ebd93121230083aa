"""The benchmark commands at tiny sizes on stories260K: `jaxserve bench throughput | serve |
sweep` and `jaxserve plan` write what they promise (vLLM's keys, completed == num_prompts,
ordered percentiles, PNGs, a recommended config that loads), and the pure parts of the sweep and
of bench/peer_hf.py (which itself needs torch, so it runs by hand) are right."""

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml
from served import uvicorn_url

from cpu_kernels import library as cpu_library
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
ROOT = Path(__file__).resolve().parents[1]
LATENCY = ("ttft", "tpot", "itl", "e2el")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_peer_pure_parts():
    peer = _load(ROOT / "bench" / "peer_hf.py")  # imports neither torch nor transformers
    samples = peer.workload(8, 128, 256, seed=0)
    assert len(samples) == 8 and all(s.prompt_len + s.output_len <= 256 for s in samples)
    assert peer.agreement([[1, 2, 3, 4], [5]], [[1, 2, 9, 4], [5]]) == {
        "identical": 1, "total": 2, "mean_prefix_fraction": 0.75}
    rows = [{"name": "jaxserve", "setting": "a", "output_tokens_per_s": 600.0},
            {"name": "hf-cb", "setting": "256", "output_tokens_per_s": 100.0},
            {"name": "hf-cb", "setting": "1024", "output_tokens_per_s": 200.0},
            {"name": "hf-static", "setting": "16", "output_tokens_per_s": 50.0}]
    r = peer.ratios(rows)
    assert r["hf-cb"] == {"best_setting": "1024", "peer_tokens_per_s": 200.0, "ratio": 3.0}
    assert r["hf-static"]["ratio"] == 12.0
    assert peer.row_buckets_x15(64) == (2, 4, 8, 12, 16, 24, 32, 48, 64)
    assert peer.row_buckets_x15(40) == (2, 4, 8, 12, 16, 24, 32, 40)
    assert peer.row_buckets_x15(4) == (2, 4) and peer.row_buckets_x15(1) == (2,)



def test_peer_rounds_pair_each_rounds_runs(monkeypatch):
    peer = _load(ROOT / "bench" / "peer_hf.py")
    speeds = iter([600.0, 500.0, 100.0,  # round 1: two jaxserve settings, then the peer
                   300.0, 400.0, 100.0])  # round 2: the machine slower for jaxserve
    ids = [[1, 2], [3]]

    def fake(*_):
        return {"output_tokens_per_s": next(speeds), "token_ids": ids}

    monkeypatch.setattr(peer, "run_jaxserve", fake)
    monkeypatch.setattr(peer, "run_hf_cb", fake)
    rounds = peer.paired_rounds(["a", "b"], None, [], [{}, {}], 512, 2)
    assert [r["ratio"] for r in rounds] == [6.0, 4.0]
    assert [r["setting_ratios"] for r in rounds] == [[6.0, 5.0], [3.0, 4.0]]
    assert [r["jaxserve_tokens_per_s"] for r in rounds] == [600.0, 400.0]
    assert all(r["identical"] == 2 for r in rounds)
    assert all(r["host_steal"] == [None, None, None] for r in rounds)  # the fakes report none


def test_peer_reads_the_hosts_steal_from_proc_stat(tmp_path):
    peer = _load(ROOT / "bench" / "peer_hf.py")
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 50 0 25 400 5 0 2 18 0 0\n")
    start = peer.cpu_times(stat)
    assert start == (35, 1000)
    stat.write_text("cpu  300 0 100 900 10 0 5 85 0 0\n")
    assert peer.host_steal(start, peer.cpu_times(stat)) == 50 / 400
    assert peer.cpu_times(tmp_path / "missing") is None
    stat.write_text("cpu  1 2 3 4\n")  # no steal column
    assert peer.cpu_times(stat) is None
    assert peer.host_steal(None, start) is None and peer.host_steal(start, start) is None


def test_peer_iteration_times_charge_each_step_to_the_iteration_before():
    peer = _load(ROOT / "bench" / "peer_hf.py")

    class Chunk:
        def __init__(self, n):
            self.num_tokens = n

    class Engine:  # dispatches a prompt chunk, then two decode iterations, then nothing
        def __init__(self):
            self.plan = [[Chunk(30), Chunk(1)], [Chunk(1)], [Chunk(1)]]
            self.core = SimpleNamespace(inflight=None)

        def step(self):
            self.core.inflight = (SimpleNamespace(chunks=self.plan.pop(0)), None) if self.plan \
                else None
            return []

    engine = Engine()
    with peer.iteration_times(engine) as times:
        for _ in range(4):
            engine.step()
    assert (len(times["prefill"]), len(times["decode"])) == (1, 2)
    assert "step" not in engine.__dict__  # the engine's own step is back


def test_cpu_kernels_bench_runs_at_tiny_size(capsys):
    """bench/cpu_kernel_speed.py compares each CPU kernel with XLA in its place."""
    out = _load(ROOT / "bench" / "cpu_kernel_speed.py").main(["--quick"])
    assert [r["m"] for r in out["matmul"]] == [1, 8, 40]
    assert all(r[f"{k}_ms"] > 0 for r in out["matmul"] + out["prefill"] for k in ("xla", "cpu"))
    assert out["decode"]["gb_per_s"] > 0 and out["read_gb_per_s"] > 0
    assert out["decode"]["bf16_ms"] > 0
    assert "decode attention, 4 slots x 40 tokens x 2 layers" in capsys.readouterr().out


def test_cpu_kernels_bench_runs_a_git_revisions_decode_kernel_beside_todays(capsys):
    """--baseline REV builds the kernels as they were at REV and alternates their decode and
    prefill attention and their matmuls (the amx one too, where it runs) with today's."""
    bench = _load(ROOT / "bench" / "cpu_kernel_speed.py")
    out = bench.main(["--quick", "--parts", "matmul", "prefill", "decode", "--baseline", "HEAD",
                      "--dependent"])
    assert out["decode"]["ms"] > 0 and out["decode"]["baseline_ms"] > 0
    assert all(r["cpu_ms"] > 0 and r["baseline_ms"] > 0 for r in out["prefill"])
    assert all(r["panels_ms"] > 0 and r["baseline_ms"] > 0 for r in out["matmul"])
    if cpu_library.amx_ready():
        assert all(r["amx_baseline_ms"] > 0 for r in out["matmul"])
    printed = capsys.readouterr().out
    assert "as at HEAD:" in printed and "as at HEAD" in printed.split("decode attention")[0]
    with pytest.raises(SystemExit, match="--baseline no-such-revision"):
        bench.main(["--quick", "--parts", "decode", "--baseline", "no-such-revision"])


@pytest.mark.parametrize(("flags", "what"), [
    (["--context", "20"], "decode step of 2 rows at about 20 tokens"),
    (["--prefill", "16"], "prefill call of 2 rows x 16 tokens")])
def test_profile_step_reads_xla_op_times(stories_dir, capsys, flags, what):
    """bench/profile_step.py traces the engine's decode step (or a prefill call) and sums XLA's
    ops by kind, each kernel by its target and shape."""
    profile = _load(ROOT / "bench" / "profile_step.py")
    profile.main(["--model", str(stories_dir), "--rows", "2", *flags, "--iters", "1",
                  "--top", "50"])
    lines = capsys.readouterr().out.splitlines()
    assert what in lines[0]
    ops = {kind: float(ms) for ms, _, kind in (line.split(maxsplit=2) for line in lines[2:])}
    assert ops and all(ms >= 0 for ms in ops.values()) and sum(ops.values()) > 0
    assert not any(kind.startswith(profile._WRAPPERS) for kind in ops)
    assert any(kind.startswith("jaxserve_cpu_") and "[" in kind for kind in ops)


def test_profile_step_times_verification_against_decode(stories_dir, capsys):
    """--verify K: speculation's verification call, K drafts a row, against the decode step."""
    profile = _load(ROOT / "bench" / "profile_step.py")
    profile.main(["--model", str(stories_dir), "--rows", "2", "--context", "20", "--verify", "2",
                  "--iters", "1", "--top", "1"])
    line = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"verify K=2: [\d.]+ ms a step vs decode [\d.]+ ms \([\d.]+x\) at 2 "
                        r"rows; speculation pays above [\d.]+ accepted drafts a verification "
                        r"on average", line), line


def test_profile_step_names_custom_calls():
    profile = _load(ROOT / "bench" / "profile_step.py")
    hlo = ('  %ffi_call.87 = f32[1024,512]{1,0} custom-call(%a, %b), custom_call_target='
           '"jaxserve_cpu_matmul_panels", api_version=API_VERSION_TYPED_FFI\n'
           '  ROOT ffi_call.2 = f32[4,8,64]{2,1,0} custom-call(%q), custom_call_target="x"\n'
           '  %add.1 = f32[4]{0} add(%p, %q)\n')
    assert profile.custom_call_names(hlo) == {
        "ffi_call.87": "jaxserve_cpu_matmul_panels f32[1024,512]", "ffi_call.2": "x f32[4,8,64]"}

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


def test_speculative_bench_compares_ngram_and_draft_with_none_on_both_workloads(capsys):
    """bench/speculative.py: prompt lookup and the demo's draft against none on the demo model,
    code edits and free text; speculation proposes, and the greedy ids are none's."""
    rows = _load(ROOT / "bench" / "speculative.py").main(
        ["--batches", "1", "--requests-scale", "0.25", "--output-len", "16", "--repeats", "1"])
    methods = ("none", "ngram", "draft")
    assert [(r["workload"], r["method"]) for r in rows] == [
        (w, m) for w in ("code_edit", "free") for m in methods]
    assert all(r["requests"] == 2 and r["output_tokens"] > 0 for r in rows)
    speculating = [r for r in rows if r["method"] != "none"]
    assert all(r["same_ids"] and r["draft_tokens"] > 0 for r in speculating)
    assert all(r["compilations"] == 0 for r in rows)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    assert lines[header].rstrip().endswith("same ids")
    printed = [line.split() for line in lines[header + 1:]]
    assert [(cells[1], cells[-1]) for cells in printed] == [
        ("none", "-"), ("ngram", "yes"), ("draft", "yes")] * 2


def test_moe_bench_times_grouped_and_dense_experts_with_the_same_logits(capsys):
    """bench/moe.py at a tiny Qwen3-MoE shape: both ways of running the experts, each batch;
    on the CPU backend the grouped matmul gives the loop's logits bit for bit."""
    rows = _load(ROOT / "bench" / "moe.py").main(
        ["--hidden", "64", "--moe-intermediate", "32", "--experts", "8", "--top-k", "2",
         "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab",
         "256", "--batches", "1,4", "--context", "20", "--iters", "2"])
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["same_logits"] and set(r["seconds"]) == {"grouped", "dense"} for r in rows)
    out = capsys.readouterr().out
    assert "Qwen3-MoE shape: 2 layers" in out and out.rstrip().endswith("yes")
