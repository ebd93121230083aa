"""The scripts under bench/ at tiny sizes: the pure parts of bench/peer_hf.py (which itself needs
torch, so it runs by hand), bench/cpu_kernel_speed.py, bench/profile_step.py, bench/speculative.py
and bench/moe.py (the yardsticks: test_bench_yardsticks.py; the `jaxserve bench` commands:
test_benchmarks.py)."""

import re
from types import SimpleNamespace

import pytest
from bench_scripts import ROOT, _load

from cpu_kernels import library as cpu_library


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
