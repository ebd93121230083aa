"""The simulator: the real scheduler on a virtual clock, its cost model, workloads and metrics."""

import json

import numpy as np
import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.core.policies import SJF
from jaxserve.core.predictors import oracle
from jaxserve.core.scheduler import Scheduler
from jaxserve.sim import RequestSpec, Simulator, StepCostModel, synthetic
from jaxserve.sim.cost_model import (
    StepShape,
    correlated_draws,
    cost_settings,
    fit_noise_memory,
    normal_scores,
    spread_quantiles,
    step_shape,
)
from jaxserve.sim.metrics import RequestRecord, compute_metrics, parse_slos
from jaxserve.sim.workload import Burst, arrival_times, read_trace, write_trace
from jaxserve.tools.simulate import main

ROWS, CHUNKS = (1, 2, 4, 8), (16, 64)


def flat_cost(seconds: float = 0.01) -> StepCostModel:
    """Every iteration takes `seconds`, whatever it runs."""
    line = (seconds, 0.0)
    return StepCostModel({(r, 1): line for r in ROWS}, {(r, c): line for r in ROWS for c in CHUNKS},
                         -seconds, ROWS, CHUNKS)


def config(**kw) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, page_size=4,
                        prefill_chunk_sizes=CHUNKS, **kw)


def test_one_request_timing_by_hand():
    # iteration 1 prefills; iteration 2 (dispatched at once, overlapped) decodes token 2; the
    # prefill's token is read when iteration 1 ends at 10 ms, and so on: one token per 10 ms
    sim = Simulator(config(), flat_cost(0.01), num_pages=64, max_model_len=128)
    result = sim.run([RequestSpec(0.5, prompt_len=10, output_len=3)])
    (record,) = result.records
    assert record.times == pytest.approx([0.51, 0.52, 0.53])
    assert record.ttft == pytest.approx(0.01) and record.e2el == pytest.approx(0.03)
    assert record.tpot == pytest.approx(0.01) and record.itls == pytest.approx([0.01, 0.01])
    assert result.num_steps == 3 and result.duration == pytest.approx(0.53)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "mlfq", "edf"])
def test_simulation_completes_every_request_and_frees_the_cache(policy):
    specs = synthetic(300, 200.0, seed=1, input_len=20, output_len=12, max_model_len=128)
    specs = [RequestSpec(s.arrival, s.prompt_len, s.output_len, priority=i % 2)
             for i, s in enumerate(specs)]
    sim = Simulator(config(policy=policy, decode_steps=2), flat_cost(0.002), num_pages=40,
                    max_model_len=128)
    result = sim.run(specs)
    assert len(result.records) == 300
    for spec, record in zip(specs, result.records, strict=True):
        assert record.output_len == spec.output_len  # every token delivered, once
        assert record.times == sorted(record.times) and record.times[0] >= spec.arrival
    assert result.kv_pages_free_at_end == result.kv_pages_total
    assert result.num_preemptions > 0  # 40 pages of 4 tokens: the pool runs short
    m = result.metrics()
    assert m["completed"] == 300
    assert m["total_output_tokens"] == sum(s.output_len for s in specs)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < m[f"median_{name}_ms"] <= m[f"p99_{name}_ms"]
    assert m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert m["request_throughput"] == pytest.approx(300 / result.duration)
    assert max(result.timeline.kv_usage) <= 1.0 and result.timeline.preemptions[-1] > 0


def test_simulator_drives_the_real_scheduler_and_a_given_policy():
    seen = []
    policy = SJF(oracle, aging_tokens_per_s=0.0)
    sim = Simulator(config(), flat_cost(), 64, 128, policy=policy,
                    on_step=lambda s, out: seen.append((s, out)))
    sim.run([RequestSpec(0.0, 5, 9), RequestSpec(0.0, 5, 2)])
    scheduler = seen[0][0]
    assert type(scheduler) is Scheduler and scheduler.policy is policy
    assert all(s is scheduler for s, _ in seen)


def test_sjf_beats_fcfs_on_mean_ttft_in_simulation():
    specs = synthetic(400, 400.0, seed=2, input_len=16, output_len=24, output_spread=1.2,
                      max_model_len=128)
    ttft = {}
    for name in ("fcfs", "sjf"):
        sim = Simulator(config(policy=name, sjf_predictor="oracle"), flat_cost(0.002), 256, 128)
        ttft[name] = sim.run(specs).metrics()["mean_ttft_ms"]
    assert ttft["sjf"] < ttft["fcfs"]


def test_simulation_is_deterministic():
    specs = synthetic(100, 100.0, seed=3, max_model_len=256)
    runs = [Simulator(config(), flat_cost(0.003), 256, 256).run(specs).metrics()
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_step_time_spread_is_seeded_and_keeps_the_mean():
    # decode iterations of 5 or 15 ms (mean 10): a 400-token request takes about 400 x 10 ms
    cost = flat_cost(0.01)
    cost.spread = (0.5, 1.5)
    spec = [RequestSpec(0.0, prompt_len=10, output_len=400)]

    def times(seed: int) -> list[float]:
        return Simulator(config(), cost, 256, 512, seed=seed).run(spec).records[0].times

    assert times(0) == times(0) != times(1)
    gaps = np.diff(times(0))
    assert set(np.round(gaps, 6)) == {0.005, 0.015}
    assert times(0)[-1] == pytest.approx(4.0, rel=0.1)


def test_the_first_iterations_after_idle_run_at_their_kinds_wake_factor():
    cost = flat_cost(0.01)
    # WAKE_STEPS = 5 iterations: the prefill at 30 ms, four decodes at 20 ms, then 10 ms
    cost.wake_prefill_factor, cost.wake_factor = 3.0, 2.0
    sim = Simulator(config(), cost, num_pages=64, max_model_len=128)
    (early, late) = sim.run([RequestSpec(0.5, prompt_len=10, output_len=7),
                             RequestSpec(2.0, prompt_len=10, output_len=2)]).records
    assert early.times == pytest.approx([0.53, 0.55, 0.57, 0.59, 0.61, 0.62, 0.63])
    assert late.times == pytest.approx([2.03, 2.05])  # woke again


def test_the_first_iterations_after_idle_draw_from_the_wake_spreads():
    cost = flat_cost(0.01)
    cost.spread, cost.prefill_spread = (1.0,), (1.0,)
    cost.wake_spread, cost.wake_prefill_spread = (2.0,), (4.0,)
    (record,) = Simulator(config(), cost, num_pages=64, max_model_len=128).run(
        [RequestSpec(0.5, prompt_len=10, output_len=7)]).records
    assert record.times == pytest.approx([0.54, 0.56, 0.58, 0.60, 0.62, 0.63, 0.64])
    cost.wake_prefill_spread = ()  # too few woke prefills measured: the steady table serves
    (record,) = Simulator(config(), cost, num_pages=64, max_model_len=128).run(
        [RequestSpec(0.5, prompt_len=10, output_len=2)]).records
    assert record.times == pytest.approx([0.51, 0.53])


def test_correlated_draws_are_uniform_and_their_memory_is_fitted_back():
    rng = np.random.default_rng(0)
    scores, runs, steps = [], [], []
    for run in range(4):  # four runs of 5,000 iterations, as calibration's open loops
        u, _ = correlated_draws(rng, 0.4, 0.95, 5000, rng.standard_normal())
        assert u.min() >= 0.0 and u.max() < 1.0
        assert abs(u.mean() - 0.5) < 0.05 and abs(np.mean(u < 0.1) - 0.1) < 0.03
        scores.append(normal_scores(u))
        runs.append(np.full(5000, run))
        steps.append(np.arange(5000))
    share, memory = fit_noise_memory(*(np.concatenate(x) for x in (scores, runs, steps)))
    assert share == pytest.approx(0.4, abs=0.1) and memory == pytest.approx(0.95, abs=0.02)
    independent = normal_scores(rng.random(5000))
    assert fit_noise_memory(independent, np.zeros(5000), np.arange(5000))[0] < 0.05


def test_correlated_step_times_are_seeded_keep_the_mean_and_vary_runs_more():
    cost = flat_cost(0.01)
    cost.spread = tuple(np.linspace(0.5, 1.5, 101))
    spec = [RequestSpec(0.0, prompt_len=10, output_len=400)]

    def durations(share: float) -> list[float]:
        cost.noise_share, cost.noise_memory = share, 0.9
        return [Simulator(config(), cost, 256, 512, seed=seed).run(spec).records[0].times[-1]
                for seed in range(24)]

    independent, correlated = durations(0.0), durations(0.8)
    assert durations(0.8) == correlated  # seeded
    assert np.mean(correlated) == pytest.approx(4.0, rel=0.05)  # the spread's mean is 1
    assert np.std(correlated) > 2 * np.std(independent)  # slow stretches do not average out


def test_spread_quantiles_scale_to_mean_one():
    fit = flat_cost(0.01)
    fit.decode_factor, fit.prefill_factor = {0: 2.0}, 1.0
    rows, d, p = np.full(1000, 2), np.full(1000, 0.01), np.zeros(1000)
    wall = 0.02 * np.random.default_rng(0).lognormal(0.0, 0.5, 1000)  # around factor x d
    q = np.array(spread_quantiles(fit, rows, d, p, wall))
    assert len(q) == 1000 and q.mean() == pytest.approx(1.0)
    assert np.all(np.diff(q) >= 0) and q[0] > 0
    # wall / (factor x d) is lognormal(0, 0.5): median 1, mean exp(0.125); scaled to mean 1
    assert q[500] == pytest.approx(np.exp(-0.125), rel=0.05)


# -- the cost model ------------------------------------------------------------------------------


def test_cost_model_fit_recovers_per_shape_lines_and_round_trips(tmp_path):
    samples = []
    for rows in (1, 2, 4):
        for length in (16, 100, 400):
            samples.append((StepShape(decode_rows=rows, decode_len=length),
                            1e-3 * rows + 2e-6 * length))
            samples.append((StepShape(prefill=((rows, 64, length),)),
                            4e-3 * rows + 1e-5 * length))
    samples.append((StepShape(decode_rows=2, decode_len=100, prefill=((1, 64, 100),)),
                    2.2e-3 + 5e-3 + 1e-3))
    samples.append((StepShape(prefill=((1, 64, 100), (2, 64, 16))),  # two calls: mixed once
                    5e-3 + 8.16e-3 + 1e-3))
    fit = StepCostModel.fit(samples, (1, 2, 4), (16, 64))
    assert fit.decode[2, 1] == pytest.approx((2e-3, 2e-6))
    assert fit.prefill[4, 64] == pytest.approx((16e-3, 1e-5))
    assert fit.mixed == pytest.approx(1e-3)
    assert fit.info["max_rel_error"] < 1e-9
    # a shape the profile missed: the nearest one, scaled by rows and chunk
    assert fit.shape_cost(StepShape(prefill=((4, 16, 16),))) == pytest.approx(
        (16e-3 + 1e-5 * 16) / 4)
    fit.decode_factor, fit.prefill_factor = {0: 1.5, 2: 1.25}, 2.0
    assert fit.decode_factor_for(2) == 1.25 and fit.decode_factor_for(4) == 1.5
    path = tmp_path / "fit.json"
    fit.save(path)
    loaded = StepCostModel.load(path)
    assert loaded.decode == fit.decode and loaded.prefill == fit.prefill
    assert loaded.decode_factor == fit.decode_factor and loaded.prefill_factor == 2.0
    assert loaded.samples == fit.samples and loaded.spread == ()
    fit.spread, fit.wake_spread, fit.wake_prefill_spread = (0.5, 1.5), (0.8, 1.2), (0.9, 1.1)
    fit.wake_factor, fit.wake_prefill_factor = 1.4, 1.2
    fit.noise_share, fit.noise_memory = 0.4, 0.97
    fit.save(path)
    loaded = StepCostModel.load(path)
    assert (loaded.noise_share, loaded.noise_memory) == (0.4, 0.97)
    assert loaded.spread == (0.5, 1.5) and loaded.wake_spread == (0.8, 1.2)
    assert loaded.wake_prefill_spread == (0.9, 1.1)
    assert (loaded.wake_factor, loaded.wake_prefill_factor) == (1.4, 1.2)


def test_step_shape_pads_as_the_runner_does():
    from fake_runner import make_request

    from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput

    a, b, c = make_request("a", 40), make_request("b", 3), make_request("c", 70)
    d, e = make_request("d", 300), make_request("e", 300)
    out = SchedulerOutput([ScheduledChunk(a, 39, 1, 2), ScheduledChunk(b, 2, 1, 2),
                           ScheduledChunk(c, 0, 20, 0)], decode_steps=2)
    assert step_shape(out, ROWS, CHUNKS) == StepShape(decode_rows=2, decode_steps=2,
                                                      decode_len=41, prefill=((1, 64, 20),))
    # a batch running to completion keeps its rows; prompt chunks of very different lengths
    # run as separate calls (the runner's grouping)
    out = SchedulerOutput([ScheduledChunk(a, 39, 1, 1), ScheduledChunk(c, 0, 20, 0),
                           ScheduledChunk(d, 0, 250, 0), ScheduledChunk(e, 0, 250, 0)],
                          batch_rows=3)
    rows, chunks = (1, 2, 4), (16, 64, 256)
    assert step_shape(out, rows, chunks) == StepShape(
        decode_rows=4, decode_len=40, prefill=((1, 64, 20), (2, 256, 250)))
    # a ragged runner (the CPU's, the TPU's) packs them into one call of their 520 tokens:
    # 3 rows of their mean length, 174, which the table scales from its nearest shape, not a
    # 64-chunk call and a 2 x 256 one; one chunk alone is its own padded shape
    ragged = step_shape(out, rows, chunks, ragged=True)
    assert ragged == StepShape(decode_rows=4, decode_len=40, prefill=((3, 174, 250),))
    fit = StepCostModel({(4, 1): (0.001, 0.0)}, {(2, 64): (0.002, 0.0), (4, 256): (0.016, 0.0)},
                        0.0, rows, chunks)
    assert fit.parts(ragged)[1] == pytest.approx(0.016 * 3 / 4 * 174 / 256)
    out = SchedulerOutput([ScheduledChunk(c, 0, 20, 0)])
    assert step_shape(out, rows, chunks, ragged=True).prefill == ((1, 64, 20),)


# -- workloads and metrics -----------------------------------------------------------------------


def test_arrivals_poisson_gamma_and_bursts():
    rng = np.random.default_rng(0)
    t = arrival_times(20000, 50.0, rng)
    assert np.all(np.diff(t) >= 0) and np.mean(np.diff(t)) == pytest.approx(0.02, rel=0.03)
    bursty = np.diff(arrival_times(20000, 50.0, rng, burstiness=0.25))
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.1)  # cv = 1/sqrt(k)
    t = arrival_times(20000, 50.0, rng, bursts=(Burst(10.0, 20.0, 3.0),))
    inside = np.sum((t >= 10) & (t < 30)) / 20.0
    before = np.sum(t < 10) / 10.0
    assert inside / before == pytest.approx(3.0, rel=0.1)
    assert np.all(arrival_times(5, float("inf"), rng) == 0)


def test_synthetic_lengths_fit_the_model_and_trace_round_trips(tmp_path):
    specs = synthetic(500, 10.0, seed=4, dist="uniform", input_len=100, output_len=300,
                      input_spread=0.5, output_spread=0.5, max_model_len=256)
    assert all(s.prompt_len + s.output_len <= 256 for s in specs)
    assert all(50 <= s.prompt_len <= 150 for s in specs)
    specs[0] = RequestSpec(0.0, 3, 2, priority=1, slo_ms=50.0, label="x", prompt_ids=(5, 6, 7))
    path = tmp_path / "trace.jsonl"
    write_trace(path, specs)
    assert read_trace(path) == sorted(specs, key=lambda s: s.arrival)
    for bad in ('{"arrival": 0, "prompt_len": 0, "output_len": 1}',
                '{"arrival": NaN, "prompt_len": 5, "output_len": 1}',
                '{"arrival": -3.0, "prompt_len": 5, "output_len": 1}',
                '{"arrival": 0, "prompt_len": 100.5, "output_len": 1}'):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"trace\.jsonl:1: not a request spec"):
            read_trace(path)
    # a request the engine would refuse is refused here too, not run past the model's length
    with pytest.raises(ValueError, match="prompt 300 \\+ output 10 tokens exceed max_model_len 256"):
        Simulator(config(), flat_cost(), num_pages=512, max_model_len=256).run(
            [RequestSpec(0.0, 300, 10)])
    with pytest.raises(ValueError, match="a burst needs start >= 0"):
        arrival_times(10, 5.0, np.random.default_rng(0), bursts=(Burst(-1.0, 2.0, 3.0),))


def test_metrics_by_hand():
    a = RequestRecord(0.0, 10)
    for t in (0.1, 0.2, 0.4):
        a.deliver(t, 1)
    b = RequestRecord(1.0, 20, slo_ms=50.0)
    b.deliver(1.04, 1)
    b.deliver(1.24, 2)  # two tokens in one delivery (multi-step decode)
    m = compute_metrics([a, b], duration=2.0, slos_ms={"ttft": 200.0})
    assert m["completed"] == 2 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0
    assert m["mean_ttft_ms"] == pytest.approx(70.0)
    assert m["mean_tpot_ms"] == pytest.approx((150.0 + 100.0) / 2)
    assert m["mean_itl_ms"] == pytest.approx((100 + 200 + 200) / 3)
    assert m["mean_e2el_ms"] == pytest.approx((400 + 240) / 2)
    assert m["request_goodput"] == 1.0  # a within 200 ms; b met its own 50 ms
    assert parse_slos(["ttft:500", "tpot:20"]) == {"ttft": 500.0, "tpot": 20.0}
    with pytest.raises(ValueError, match="goodput"):
        parse_slos(["latency:5"])


# -- the command line ----------------------------------------------------------------------------


def test_cli_simulates_with_a_saved_fit(tmp_path, capsys):
    fit = flat_cost(0.004)
    fit.info = {"num_pages": 512, "max_model_len": 256}
    fit.save(tmp_path / "fit.json")
    out = tmp_path / "m.json"
    argv = ["--fit", str(tmp_path / "fit.json"), "--num-prompts", "200", "--request-rate", "50",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--prefill-chunk-sizes",
            "16,64", "--policy", "mlfq", "--adaptive-window", "--window-ms-max", "5",
            "--set", "page_size=4", "--goodput", "ttft:100", "--output-json", str(out)]
    assert main(argv) == 0
    metrics = json.loads(out.read_text())
    assert metrics["completed"] == 200 and "request_goodput" in metrics
    assert "mlfq" in capsys.readouterr().out
    assert main(["--fit", str(tmp_path / "fit.json"), "--policy", "lottery"]) == 2
    # workload flags: errors naming the flag, not 1-token requests or numpy's words
    for flags, named in ((["--output-len", "-5"], "--output-len"),
                         (["--input-len", "nan"], "--input-len"),
                         (["--num-prompts", "-1"], "--num-prompts"),
                         (["--input-spread", "-1"], "--input-spread"),
                         (["--burst", "a:b"], "--burst"), (["--request-rate", "0"], "--request-rate")):
        capsys.readouterr()
        assert main(["--fit", str(tmp_path / "fit.json"), *flags]) == 2
        assert named in capsys.readouterr().err
    assert main(["--fit", str(tmp_path / "fit.json"), "--num-prompts", "5",
                 "--output-json", str(tmp_path)]) == 2  # a directory in the way: one line
    # the KV cache is sized by pages; --seed seeds the step-time draws as well as the workload
    assert main(["--fit", str(tmp_path / "fit.json"), "--set", "kv_cache_bytes_cpu=1000"]) == 2
    assert "pass --num-pages" in capsys.readouterr().err
    assert main(["--fit", str(tmp_path / "fit.json"), "--set",
                 'speculative_config={"num_speculative_tokens": 2}']) == 2
    assert "does not model speculative decoding" in capsys.readouterr().err
    fit.spread = tuple(np.linspace(0.5, 1.5, 101))
    fit.save(tmp_path / "spread.json")
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synthetic(50, 20.0, seed=0, max_model_len=256))
    runs = []
    for seed in ("0", "7"):
        argv = ["--fit", str(tmp_path / "spread.json"), "--trace", str(trace), "--seed", seed,
                "--output-json", str(out), "--save-trace", str(tmp_path / f"copy{seed}.jsonl")]
        assert main([*argv, "--max-num-seqs", "8", "--prefill-chunk-sizes", "16,64"]) == 0
        runs.append(json.loads(out.read_text())["mean_tpot_ms"])
        assert read_trace(tmp_path / f"copy{seed}.jsonl") == read_trace(trace)
    assert runs[0] != runs[1]
    labelled = [RequestSpec(0.1 * i, 20, 5, label="chat" if i % 2 else "batch") for i in range(6)]
    write_trace(trace, labelled)
    assert main(["--fit", str(tmp_path / "fit.json"), "--trace", str(trace), "--output-json",
                 str(out), "--max-num-seqs", "8", "--prefill-chunk-sizes", "16,64"]) == 0
    by_label = json.loads(out.read_text())["by_label"]
    assert {k: v["completed"] for k, v in by_label.items()} == {"batch": 3, "chat": 3}
    # a fit from another engine shape is used, with a warning naming what differs
    fit.info["engine"] = cost_settings(EngineConfig.from_overrides(max_num_seqs=16))
    fit.save(tmp_path / "other.json")
    capsys.readouterr()
    assert main(["--fit", str(tmp_path / "other.json"), "--num-prompts", "5", "--max-num-seqs",
                 "8", "--prefill-chunk-sizes", "16,64"]) == 0
    assert "max_num_seqs: 16 -> 8" in capsys.readouterr().err
    assert main(["--fit", str(tmp_path / "fit.json"), "--prefill-chunk-sizes", "512"]) == 2
    assert "prefill_chunk_sizes [512]: none fits max_model_len 256" in capsys.readouterr().err
    # a config file (server keys and all, as configs/*.yaml hold) and sizes as the other
    # commands take them, space-separated
    config = tmp_path / "c.yaml"
    config.write_text("max_num_seqs: 8\nprefill_chunk_sizes: [16, 64]\nport: 9000\n")
    assert main(["--fit", str(tmp_path / "fit.json"), "--num-prompts", "5", "--config",
                 str(config), "--output-json", str(out)]) == 0
    assert main(["--fit", str(tmp_path / "fit.json"), "--num-prompts", "5", "--max-num-seqs",
                 "8", "--prefill-chunk-sizes", "16", "64"]) == 0
    config.write_text("max_num_seqs: 0\n")  # the file is read: its bad value is refused
    capsys.readouterr()
    assert main(["--fit", str(tmp_path / "fit.json"), "--config", str(config)]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    # --max-model-len is honoured with a fit measured at another (the workload is cut to it)
    saved = tmp_path / "cut.jsonl"
    assert main(["--fit", str(tmp_path / "fit.json"), "--num-prompts", "20", "--max-model-len",
                 "128", "--save-trace", str(saved), "--prefill-chunk-sizes", "16,64"]) == 0
    assert max(s.prompt_len + s.output_len for s in read_trace(saved)) <= 128


def test_cli_plots(tmp_path):
    pytest.importorskip("matplotlib")
    fit = flat_cost(0.004)
    fit.info = {"num_pages": 512, "max_model_len": 256}
    fit.save(tmp_path / "fit.json")
    argv = ["--fit", str(tmp_path / "fit.json"), "--num-prompts", "50", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "128", "--prefill-chunk-sizes", "16,64",
            "--plot-dir", str(tmp_path / "plots")]
    assert main(argv) == 0
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 0



def test_learned_predictor_learns_the_task_from_the_prompt(tmp_path):
    from jaxserve.core.predictors import resolve_predictor
    from jaxserve.request import Request, SamplingParams
    from jaxserve.tools.train_predictor import train_predictor

    rng = np.random.default_rng(0)
    lengths = {3: 8, 10: 64, 17: 200}  # the first token names the task, the task its length
    prompts, outputs = [], []
    for _ in range(300):
        task = int(rng.choice(list(lengths)))
        prompts.append([task, *rng.integers(30, 200, size=int(rng.integers(4, 40))).tolist()])
        outputs.append(int(lengths[task] * rng.uniform(0.8, 1.2)))
    model = train_predictor(prompts, outputs, steps=300)
    model.save(tmp_path / "p.json")
    predictor = resolve_predictor(str(tmp_path / "p.json"))
    predicted = {}
    for task in lengths:
        request = Request("r", [task, 50, 60, 70, 80], SamplingParams(), 0.0, 0, 64, frozenset())
        predicted[task] = predictor(request)
    assert predicted[3] < predicted[10] < predicted[17]
    assert predicted[10] == pytest.approx(64, rel=0.3)


def test_the_host_core_and_the_simulator_load_without_jax():
    import subprocess
    import sys

    code = ("import sys, jaxserve.core.scheduler, jaxserve.core.buckets, jaxserve.tools.simulate; "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_prefix_cache_in_the_simulator():
    """The simulator drives the real KV manager, so a trace whose prompts share a prefix hits
    the cache (a hit's prompt fits one chunk instead of two: one iteration to its first token
    instead of two), and synthetic prompts, each its own, never do."""
    shared = list(range(10, 106))  # 96 tokens: 24 pages of 4
    specs = [RequestSpec(float(i), prompt_len=100, output_len=2,
                         prompt_ids=tuple(shared + [200 + i] * 4)) for i in range(6)]
    for caching in (False, True):
        sim = Simulator(config(enable_prefix_caching=caching), flat_cost(0.01), num_pages=200,
                        max_model_len=128)
        result = sim.run(specs)
        ttfts = [r.ttft for r in result.records]
        if caching:
            assert (result.prefix_cache_queries, result.prefix_cache_hits) == (600, 5 * 96)
            assert ttfts == pytest.approx([0.02] + [0.01] * 5)
        else:
            assert result.prefix_cache_hits == 0 and ttfts == pytest.approx([0.02] * 6)
    result = Simulator(config(), flat_cost(0.01), 200, 128).run(
        synthetic(20, float("inf"), input_len=40, max_model_len=128))
    assert result.prefix_cache_queries > 0 and result.prefix_cache_hits == 0


def test_cli_shared_prefix_workloads(tmp_path):
    """--dataset prefix_repetition / multiturn: jaxserve bench's shared-prefix workloads in the
    simulator, their prompts' ids in the saved trace; with the prefix cache the same requests
    finish sooner than without it."""
    fit = flat_cost(0.004)
    fit.info = {"num_pages": 512, "max_model_len": 256}
    fit.save(tmp_path / "fit.json")
    for dataset in ("prefix_repetition", "multiturn"):
        ttfts = []  # the simulator's virtual seconds, not the wall clock
        for caching in ("true", "false"):
            out, trace = tmp_path / f"{dataset}{caching}.json", tmp_path / "t.jsonl"
            assert main(["--fit", str(tmp_path / "fit.json"), "--dataset", dataset,
                         "--num-prompts", "24", "--request-rate", "20", "--prefix-len", "96",
                         "--num-prefixes", "2", "--turns", "3", "--input-len", "24",
                         "--output-len", "8", "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "128", "--prefill-chunk-sizes", "16,64",
                         "--set", "page_size=4", "--set", f"enable_prefix_caching={caching}",
                         "--output-json", str(out), "--save-trace", str(trace)]) == 0
            metrics = json.loads(out.read_text())
            assert metrics["completed"] == 24
            ttfts.append(metrics["mean_ttft_ms"])
            specs = read_trace(trace)
            assert all(s.prompt_ids is not None and len(s.prompt_ids) == s.prompt_len
                       for s in specs)
        assert ttfts[0] < ttfts[1], dataset  # cache on: a lower mean TTFT
