"""The bridge between the simulator and the real engine (jaxserve.tools.calibrate) on a tiny model:
profile, fit, measure the engine, save; then validate a short trace against the engine. The fit
itself is checked on timings made here (synthetic, seeded), never on the machine's: a test's
outcome must not move with the load beside it."""

import dataclasses
import math

import numpy as np
import pytest
from conftest import HF_FIXTURES

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sim.cost_model import StepCostModel, StepShape
from jaxserve.sim.metrics import idle_arrivals
from jaxserve.sim.simulator import Simulator
from jaxserve.sim.workload import RequestSpec, synthetic
from jaxserve.tools.calibrate import (
    VALIDATED,
    calibrate,
    measure_wakeup,
    profile_shapes,
    run_on_engine,
    validate,
)

MODEL = str(HF_FIXTURES / "llama")
CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk_sizes=(16, 32),
                      page_size=8, num_pages=96, max_model_len=64, enable_prompt_logprobs=False,
                      max_top_logprobs=0)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(MODEL, CONFIG, progress=False)


@pytest.fixture(scope="module")
def fit(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "fit.json"
    fitted = calibrate(MODEL, CONFIG, path, engine, progress=False, open_loop_requests=6)
    assert path.is_file()
    return fitted, path


def test_every_profiled_shape_is_one_the_engine_compiled(engine, fit):
    fitted, _ = fit
    shapes = profile_shapes(engine)
    assert any(s[0] and not s[3] for s in shapes) and any(s[3] and not s[0] for s in shapes)
    assert engine.runner.num_compilations_after_warmup == 0  # profiling compiled nothing new
    assert set(fitted.decode) == {(2, 1)}  # the one decode row bucket at max_num_seqs 2
    # one-chunk calls at the chunk buckets; the CPU runner's ragged calls of several chunks
    # at their mean length (step_shape), which lies between them
    chunks = {c for _, c in fitted.prefill}
    assert {16, 32} <= chunks and all(16 <= c <= 32 for c in chunks), chunks


def test_the_fit_has_positive_costs_and_engine_factors_and_round_trips(fit):
    fitted, path = fit
    for a, b in [*fitted.decode.values(), *fitted.prefill.values()]:
        assert a >= 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)  # the constraint
    assert all(f > 0 and math.isfinite(f) for f in fitted.decode_factor.values())
    assert fitted.prefill_factor >= 0 and fitted.idle_wakeup >= 0
    assert fitted.wake_factor > 0 and fitted.wake_prefill_factor > 0
    assert 0 <= fitted.noise_share <= 0.9 and 0 <= fitted.noise_memory <= 0.999
    assert len(fitted.spread) == 1000  # decode-only; with prompt chunks there may be too few
    for spread in (fitted.spread, fitted.prefill_spread, fitted.wake_spread,
                   fitted.wake_prefill_spread):
        assert len(spread) in (0, 1000)
        assert not spread or math.isclose(sum(spread) / len(spread), 1.0)
        assert not spread or (spread[0] > 0 and list(spread) == sorted(spread))
    loaded = StepCostModel.load(path)
    assert loaded.decode == fitted.decode and loaded.decode_factor == fitted.decode_factor
    assert loaded.spread == fitted.spread and loaded.prefill_spread == fitted.prefill_spread
    assert loaded.wake_factor == fitted.wake_factor
    assert loaded.wake_prefill_factor == fitted.wake_prefill_factor
    assert loaded.wake_spread == fitted.wake_spread
    assert (loaded.noise_share, loaded.noise_memory) == (fitted.noise_share, fitted.noise_memory)


def _synthetic_samples(decode_cost, prefill_cost, noise, seed=0):
    """(StepShape, seconds) as the profiler gives them, from known lines: decode (rows, steps)
    -> (a, b) and prefill (rows, chunk) -> (a, b), each time scaled by 1 + noise * N(0, 1)."""
    rng = np.random.default_rng(seed)
    samples = []
    for (rows, steps), (a, b) in decode_cost.items():
        for length in (16, 64, 128, 256, 512) * 2:
            seconds = (a + b * length) * (1 + noise * rng.standard_normal())
            samples.append((StepShape(rows, steps, length), seconds))
    for (rows, chunk), (a, b) in prefill_cost.items():
        for length in (chunk, 128, 256, 512) * 2:
            seconds = (a + b * length) * (1 + noise * rng.standard_normal())
            samples.append((StepShape(prefill=((rows, chunk, length),)), seconds))
    return samples


def test_the_fit_recovers_known_costs_from_noisy_timings():
    decode = {(1, 1): (2e-3, 2e-6), (8, 1): (3e-3, 1.5e-5), (8, 4): (1e-2, 6e-5)}
    prefill = {(1, 32): (4e-3, 1e-5), (2, 64): (9e-3, 4e-5)}
    fitted = StepCostModel.fit(_synthetic_samples(decode, prefill, noise=0.02), (1, 8),
                               (32, 64))
    for table, truth in ((fitted.decode, decode), (fitted.prefill, prefill)):
        assert set(table) == set(truth)
        for key, (a, b) in truth.items():
            fit_a, fit_b = table[key]
            assert fit_a == pytest.approx(a, rel=0.15) and fit_b == pytest.approx(b, rel=0.15)
            cost = fit_a + fit_b * 256
            assert cost == pytest.approx(a + b * 256, rel=0.03)


@pytest.mark.parametrize("seed", range(20))
def test_the_fit_never_gives_a_negative_cost(seed):
    # timings that an unconstrained least-squares line fits with a negative slope (a longer
    # context looking faster, as noise on a busy machine can make it) or a negative intercept
    # (a steep line whose short contexts ran fast): costs clamp at zero, the fit stays close
    rng = np.random.default_rng(seed)
    falling = {(1, 1): (2e-3, -1e-6)}
    steep = {(2, 32): (-5e-4, 4e-5)}
    samples = [(s, abs(t)) for s, t in _synthetic_samples(
        falling, steep, noise=0.3 * rng.random(), seed=seed)]
    fitted = StepCostModel.fit(samples, (1, 2), (32,))
    for a, b in [*fitted.decode.values(), *fitted.prefill.values()]:
        assert a >= 0 and b >= 0
    (a, b), = fitted.decode.values()
    assert b == 0 or a > 0
    assert all(StepCostModel._lookup(table, *key, length) > 0
               for table in (fitted.decode, fitted.prefill) for key in table
               for length in (16, 512))


def test_the_fit_refuses_timings_that_are_not_positive():
    samples = _synthetic_samples({(1, 1): (2e-3, 1e-6)}, {}, noise=0.0)
    samples[3] = (samples[3][0], 0.0)
    with pytest.raises(ValueError, match="positive"):
        StepCostModel.fit(samples, (1,), (32,))


def test_validate_reports_both_runs_and_every_relative_error(fit):
    _, path = fit
    report = validate(MODEL, CONFIG, lambda max_len: synthetic(
        10, 20.0, seed=4, input_len=12, output_len=8, max_model_len=max_len), path,
        progress=False, repeats=2)
    assert report["real"]["completed"] == report["sim"]["completed"] == 10
    assert set(report["errors"]) == set(VALIDATED) == set(report["noise"])
    assert all(e >= 0 and math.isfinite(e) for e in report["errors"].values())
    first, second = report["runs"]  # the engine side is the mean of its runs
    assert report["real"]["mean_ttft_ms"] == pytest.approx(
        (first["mean_ttft_ms"] + second["mean_ttft_ms"]) / 2)
    # no agreement claimed closer than the mean of two runs can tell: twice its standard
    # error, |a - b| / sqrt(2) * 2 / sqrt(2) = |a - b|, relative to the mean
    spread = abs(first["mean_ttft_ms"] - second["mean_ttft_ms"]) / report["real"]["mean_ttft_ms"]
    assert report["uncertainty"]["mean_ttft_ms"] == pytest.approx(spread)
    assert all(report["claims"][k] == max(report["errors"][k], report["uncertainty"][k])
               for k in VALIDATED)


def test_each_play_of_a_workload_starts_from_an_empty_prefix_cache(engine):
    """A replay of the same prompts finds none cached (the simulator's runs never do): the
    later plays' prefills are not skipped."""
    specs = synthetic(6, 50.0, seed=2, input_len=40, output_len=4, max_model_len=64)
    hits = []
    for _ in range(2):
        run_on_engine(engine, specs)
        hits.append(engine.stats()["prefix_cache_hits"])
    run_on_engine(engine, specs)
    assert engine.stats()["prefix_cache_hits"] == hits[0] == hits[1] == 0


def test_the_wake_up_term_is_what_idle_arrivals_miss_and_ignores_queueing(engine, fit):
    # "measured" runs made by the simulator itself (no spread: deterministic) with every time
    # of a request that arrived at an idle engine 5 ms late, and of one that queued behind
    # another 40 ms late (as queueing compounds a step-cost error): the term is the 5 ms
    fitted = dataclasses.replace(fit[0], idle_wakeup=0.0, spread=(), prefill_spread=(),
                                 wake_spread=(), wake_prefill_spread=())
    specs = [RequestSpec(t, 12, 4) for t in (0.0, 1.0, 1.0, 1.0, 2.0, 3.0, 3.0)]
    records = Simulator(CONFIG, fitted, CONFIG.num_pages, 64).run(specs).records
    idle = idle_arrivals(records)
    assert idle == [True, True, False, False, True, True, False]
    for record, alone in zip(records, idle, strict=True):
        record.times = [t + (0.005 if alone else 0.040) for t in record.times]
    assert measure_wakeup(engine, fitted, [(specs, records)]) == pytest.approx(0.005)


def test_one_sequence_at_a_time_still_gives_finite_factors(tmp_path):
    # every prompt iteration follows a step that only drained the last token: that is not an
    # idle wait, and the fit must not lose all its steady prefill samples to the wake factor
    config = dataclasses.replace(CONFIG, max_num_seqs=1)
    fitted = calibrate(MODEL, config, tmp_path / "fit.json", progress=False,
                       open_loop_requests=6)
    values = [*fitted.decode_factor.values(), fitted.prefill_factor, fitted.wake_factor,
              fitted.wake_prefill_factor]
    assert fitted.decode_factor and all(math.isfinite(v) and v >= 0 for v in values)
    assert all(v > 0 for v in fitted.decode_factor.values())  # ratios of positive sums


def test_a_fresh_calibration_interleaves_its_open_loops_with_the_validation_runs(
        tmp_path, monkeypatch):
    import jaxserve.tools.calibrate as calibrate_module

    played = []  # (requests, whether the calibration timed its steps) per workload, in order
    real_run = calibrate_module.run_on_engine

    def run_on_engine(engine, specs, *args, **kwargs):
        played.append((len(specs), "step" in engine.__dict__))
        return real_run(engine, specs, *args, **kwargs)

    monkeypatch.setattr(calibrate_module, "run_on_engine", run_on_engine)
    path = tmp_path / "fit.json"
    report = validate(MODEL, CONFIG, lambda max_len: synthetic(
        10, 40.0, seed=5, input_len=12, output_len=6, max_model_len=max_len), path,
        progress=False, recalibrate=True, repeats=2, open_loop_requests=4)
    assert path.is_file() and len(report["runs"]) == 2
    # warm-up (8 of the trace); then per round one timed open loop of 2 requests at each of
    # the four rates, and one untimed run of the 10-request trace
    round_ = [(2, True)] * 4 + [(10, False)]
    assert played == [(8, False), *round_, *round_]
    assert all(math.isfinite(e) for e in report["errors"].values())
