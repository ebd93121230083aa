"""Scheduling policies, length bucketing and the adaptive window, on a fake clock (no jax)."""

import numpy as np
import pytest
from fake_runner import Driver, FakeClock, expected, make_request, run

from jaxserve.config.engine import EngineConfig
from jaxserve.core.policies import EDF, MLFQ, POLICIES, SJF, PriorityPolicy, make_policy
from jaxserve.core.predictors import (
    NUM_FEATURES,
    MLPPredictor,
    PromptLengthPredictor,
    oracle,
    resolve_predictor,
)
from jaxserve.core.scheduler import Scheduler, make_scheduler
from jaxserve.core.window import AdaptiveWindow, BatchingWindow
from jaxserve.request import RequestStatus, SamplingParams


def scheduler(policy="fcfs", clock=None, **kw):
    cfg = dict(num_pages=129, page_size=4, max_num_seqs=1, max_num_batched_tokens=64,
               max_chunk_tokens=32)
    cfg |= kw
    return Scheduler(clock=clock or FakeClock(), policy=policy,
                     window=BatchingWindow(0.0, 1, cfg["max_num_seqs"]), **cfg)


def admission_order(s, requests):
    """Request ids in the order they first ran."""
    log = run(s, requests).log
    first = {}
    for i, entry in enumerate(log):
        for rid in entry.ids:
            first.setdefault(rid, i)
    return sorted(first, key=first.get)


def workload():
    return [make_request("a", 5, 9, priority=1), make_request("b", 19, 3, arrival=0.001),
            make_request("c", 1, 12, arrival=0.002, priority=2),
            make_request("d", 8, 1, arrival=0.003), make_request("e", 33, 7, arrival=0.004),
            make_request("f", 2, 5, arrival=0.005, priority=1, slo_ms=5.0)]


# -- every policy keeps outputs exact ------------------------------------------------------------


@pytest.mark.parametrize("length_buckets", [(), (4, 8, 32)])
@pytest.mark.parametrize("decode_steps", [1, 3])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_gives_exact_outputs_with_preemption(policy, decode_steps, length_buckets):
    for num_pages in (65, 11):  # roomy, and small enough to preempt (e needs 10 pages)
        s = scheduler(policy, num_pages=num_pages, max_num_seqs=3, max_num_batched_tokens=32,
                      max_chunk_tokens=8, decode_steps=decode_steps,
                      length_buckets=length_buckets)
        requests = workload()
        result = run(s, requests)
        assert result.outputs == expected(requests)
        if num_pages == 11:
            assert s.num_preemptions > 0


def test_config_lists_every_policy_and_builds_it():
    for name in POLICIES:
        s = make_scheduler(EngineConfig(policy=name), num_pages=64, max_chunk_tokens=64)
        assert s.policy.name == name
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="lottery")
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("lottery")


# -- priority: two-level QoS ---------------------------------------------------------------------


def test_priority_shares_admissions_three_to_one():
    requests = [make_request(f"r{i}", 3, 2, arrival=i / 1000) for i in range(8)]
    requests += [make_request(f"b{i}", 3, 2, arrival=i / 1000, priority=1) for i in range(4)]
    order = admission_order(scheduler("priority"), requests)
    assert "".join(rid[0] for rid in order) == "rrrbrrrbrrbb"
    assert [rid for rid in order if rid[0] == "r"] == [f"r{i}" for i in range(8)]


def test_priority_batch_progresses_under_a_stream_of_realtime():
    clock = FakeClock()
    s = scheduler("priority", clock)
    d = Driver(s, advance=False)
    s.add_request(make_request("batch", 3, 2, priority=1))
    admitted = []
    for i in range(40):  # a realtime request arrives every step, forever
        s.add_request(make_request(f"r{i}", 3, 1, arrival=clock.now))
        entry = d.step()
        admitted += [rid for rid in entry.ids if rid not in admitted]
        clock.advance_ms(1)
    assert "batch" in admitted[:5]


def test_priority_victim_is_the_largest_priority_value_then_the_newest():
    """As vLLM's: within a class the victim has the largest priority value, then the latest
    first admission; a re-admitted request keeps its seniority; a batch request preempted
    `batch_preemptions` times is given up last of all."""
    policy = PriorityPolicy()
    old, urgent = make_request("old", 3, priority=0), make_request("urgent", 3, priority=-10)
    batch, newer = make_request("batch", 3, priority=1), make_request("newer", 3, priority=1)
    for r in (old, urgent, batch, newer):
        policy.on_admit(r, 0.0)
    assert policy.victim([urgent, old], 0.0) is old  # urgent came later, ranks higher
    assert policy.victim([old, urgent, batch, newer], 0.0) is newer
    policy.on_admit(batch, 0.0)  # re-admitted after a preemption: still the senior one
    assert policy.victim([batch, newer], 0.0) is newer
    batch.metrics.num_preemptions = newer.metrics.num_preemptions = policy.batch_preemptions
    assert policy.victim([batch, old, urgent], 0.0) is old
    assert policy.victim([batch, newer], 0.0) is newer  # both promoted: the newest goes


def test_priority_idle_class_banks_no_credit():
    s = scheduler("priority")
    d = Driver(s)
    for i in range(12):  # batch sits idle while realtime work runs
        s.add_request(make_request(f"early{i}", 3, 1, arrival=i / 1000))
    d.drain()
    late = [make_request(f"r{i}", 3, 2, arrival=1.0 + i / 1000) for i in range(6)]
    late += [make_request(f"b{i}", 3, 2, arrival=1.0 + i / 1000, priority=1) for i in range(2)]
    order = admission_order(s, late)
    assert "".join(rid[0] for rid in order) == "rrrbrrrb"


def test_priority_realtime_rows_decode_one_step_per_dispatch():
    s = scheduler("priority", max_num_seqs=2, decode_steps=4)
    d = Driver(s)
    s.add_request(make_request("batch", 3, 30, priority=1))
    for _ in range(4):
        d.step()
    assert d.log[-1].decode_steps == 4
    s.add_request(make_request("rt", 3, 30, arrival=s.clock()))
    for _ in range(4):
        d.step()
    assert d.log[-1].decode_steps == 1 and {"rt", "batch"} <= set(d.log[-1].ids)
    d.drain()


# -- sjf -----------------------------------------------------------------------------------------


def test_sjf_oracle_serves_the_shortest_output_first():
    requests = [make_request("long", 3, 30), make_request("short", 3, 5, arrival=0.001),
                make_request("mid", 3, 12, arrival=0.002)]
    s = scheduler(SJF(oracle, aging_tokens_per_s=0.0))
    assert admission_order(s, requests) == ["short", "mid", "long"]


def test_sjf_takes_any_callable_and_predicts_once_per_request():
    calls = []

    def predictor(request):
        calls.append(request.request_id)
        return 100 - len(request.prompt_ids)  # longest prompt first

    policy = SJF(predictor, aging_tokens_per_s=0.0)
    requests = [make_request(f"p{n}", n, 200) for n in (3, 9, 5)]
    for _ in range(3):
        assert [r.request_id for r in policy.order(requests, 0.0)] == ["p9", "p5", "p3"]
    assert sorted(calls) == ["p3", "p5", "p9"]
    assert [r.request_id for r in SJF(PromptLengthPredictor()).order(requests, 0.0)] == [
        "p3", "p5", "p9"]


def test_sjf_predictions_stop_at_max_tokens():
    """A request may not produce more than its max_tokens, whatever the predictor says."""
    policy = SJF(lambda r: 2000.0 if r.request_id == "classify" else 10.0, aging_tokens_per_s=0)
    classify = make_request("classify", 40, 1)
    chat = make_request("chat", 3, 1000, arrival=0.001)
    assert policy.predicted(classify) == 1.0 and policy.predicted(chat) == 10.0
    assert [r.request_id for r in policy.order([chat, classify], 0.0)] == ["classify", "chat"]


def test_sjf_key_holds_while_pending_tokens_are_read():
    """A preempted request's tokens still in flight count as served already: its key does not
    change when they are read while it waits in the (sorted) queue."""
    policy = SJF(oracle, aging_tokens_per_s=0.0)
    r = make_request("r", 3, 20)
    r.num_pending = 2
    before = policy.key(r, 0.0)
    r.output_ids += [5, 6]
    r.num_pending = 0
    assert policy.key(r, 0.0) == before


def test_sjf_aging_lets_a_long_request_overtake_newcomers():
    policy = SJF(oracle, aging_tokens_per_s=50.0)
    long = make_request("long", 3, 100, arrival=0.0)
    for now, first in [(0.5, "short"), (1.5, "short"), (2.5, "long")]:
        short = make_request("short", 3, 5, arrival=now)  # always a fresh short request
        assert policy.order([long, short], now)[0].request_id == first


def test_sjf_long_request_is_not_starved_by_a_stream_of_short_ones():
    # a short request arrives every 10 ms step, faster than one slot serves them: the queue
    # never empties. Aging orders by predicted/rate + arrival, so only the short requests that
    # arrive within (100 - 3) / 500 s of the long one may overtake it.
    for aging, admitted_by in [(500.0, 1.5), (0.0, None)]:
        clock = FakeClock()
        s = scheduler(SJF(oracle, aging_tokens_per_s=aging), clock)
        d = Driver(s, advance=False)
        s.add_request(make_request("s", 3, 3))
        s.add_request(make_request("long", 3, 100))
        started = None
        for i in range(400):  # 4 s
            s.add_request(make_request(f"s{i}", 3, 3, arrival=clock.now))
            d.step()
            if started is None and "long" in d.log[-1].ids:
                started = clock.now
            clock.advance_ms(10)
        if admitted_by is None:
            assert started is None
        else:
            assert started is not None and 0.1 < started <= admitted_by


def test_sjf_victim_is_the_longest_predicted_remaining():
    policy = SJF(oracle, aging_tokens_per_s=0.0)
    running = [make_request("a", 3, 10), make_request("b", 3, 40), make_request("c", 3, 20)]
    assert policy.victim(running, 0.0).request_id == "b"
    running[1].output_ids = [5] * 35  # b has 5 tokens to go
    assert policy.victim(running, 0.0).request_id == "c"


# -- mlfq ----------------------------------------------------------------------------------------


def test_mlfq_skip_join_puts_long_prompts_in_lower_queues():
    policy = MLFQ(num_levels=4, quantum_tokens=16, prompt_token_cost=0.25, starvation_s=5.0)
    levels = [policy.level(make_request(f"p{n}", n), 0.0) for n in (8, 63, 64, 191, 192, 900)]
    assert levels == [0, 0, 1, 1, 2, 3]


def test_mlfq_demotes_by_tokens_served_and_promotes_by_waiting():
    policy = MLFQ(num_levels=4, quantum_tokens=16, prompt_token_cost=0.25, starvation_s=5.0)
    r = make_request("r", 4, 200)
    r.status = RequestStatus.RUNNING
    served = []
    for n in (0, 14, 15, 46, 47, 110, 111):  # + 1 for the 4-token prompt
        r.output_ids = [5] * n
        served.append(policy.level(r, 0.0))
    assert served == [0, 0, 1, 1, 2, 2, 3]
    r.status = RequestStatus.WAITING  # preempted at t=10 after being served: level 3
    r.metrics.last_preempted_time = 10.0
    assert policy.level(r, 14.9) == 3
    assert policy.level(r, 15.0) == 0  # waited starvation_s since its preemption


def test_mlfq_orders_short_prompts_first_until_the_long_one_starves():
    policy = MLFQ(starvation_s=5.0)
    long = make_request("long", 400, arrival=0.0)
    for now, first in [(1.0, "short"), (4.9, "short"), (5.0, "long")]:
        short = make_request("short", 8, arrival=now)
        assert policy.order([long, short], now)[0].request_id == first


# -- edf -----------------------------------------------------------------------------------------


def test_edf_serves_the_earliest_deadline_first():
    policy = EDF(default_slo_ms=1000.0)
    loose = make_request("loose", 3, arrival=0.0, slo_ms=500.0)  # due at 0.5 s
    tight = make_request("tight", 3, arrival=0.2, slo_ms=100.0)  # due at 0.3 s
    default = make_request("default", 3, arrival=0.0)  # due at 1.0 s
    assert [r.request_id for r in policy.order([default, loose, tight], 0.2)] == [
        "tight", "loose", "default"]
    assert policy.victim([default, loose, tight], 0.2).request_id == "default"


def test_edf_old_deadlines_beat_newcomers():
    policy = EDF(default_slo_ms=1000.0)
    old = make_request("old", 3, arrival=0.0, slo_ms=900.0)  # due at 0.9 s
    for now, first in [(0.0, "new"), (0.5, "old"), (2.0, "old")]:
        new = make_request("new", 3, arrival=now, slo_ms=500.0)
        assert policy.order([old, new], now)[0].request_id == first
    s = scheduler(policy)
    requests = [make_request("old", 3, 2, arrival=0.0, slo_ms=900.0)]
    requests += [make_request(f"new{i}", 3, 2, arrival=0.5 + i / 1000) for i in range(3)]
    # arriving last, due first (0.503 + 0.1 s): it goes ahead of everything, which FCFS would not
    requests.append(make_request("urgent", 3, 2, arrival=0.503, slo_ms=100.0))
    assert admission_order(s, requests) == ["urgent", "old", "new0", "new1", "new2"]


def test_sampling_params_validate_slo_ms():
    assert SamplingParams(slo_ms=250).slo_ms == 250
    for bad in (0, -1.0, "fast"):
        with pytest.raises(ValueError, match="slo_ms"):
            SamplingParams(slo_ms=bad)


# -- length bucketing ----------------------------------------------------------------------------


def test_length_bucketing_groups_the_prompts_of_one_iteration():
    def requests():
        return [make_request("a10", 10, 2), make_request("b200", 200, 2, arrival=0.001),
                make_request("c12", 12, 2, arrival=0.002),
                make_request("d100", 100, 2, arrival=0.003),
                make_request("e14", 14, 2, arrival=0.004)]

    kw = dict(num_pages=257, max_num_seqs=8, max_num_batched_tokens=512, max_chunk_tokens=256)
    plain = run(scheduler(**kw), requests())
    assert set(plain.log[0].ids) == {"a10", "b200", "c12", "d100", "e14"}
    bucketed = run(scheduler(length_buckets=(16, 64, 256), **kw), requests())
    assert bucketed.log[0].ids == ["a10", "c12", "e14"]  # the head's bucket only
    assert set(bucketed.log[1].ids) >= {"b200", "d100"}
    assert bucketed.outputs == plain.outputs == expected(requests())


def test_length_bucketing_always_admits_the_head():
    # a long prompt is mid-chunking (bucket 256); the head of the queue is short: it still joins
    s = scheduler(length_buckets=(16, 64, 256), num_pages=257, max_num_seqs=4,
                  max_num_batched_tokens=512, max_chunk_tokens=256)
    d = Driver(s)
    s.add_request(make_request("long", 500, 2))
    d.step()
    s.add_request(make_request("short", 10, 2, arrival=s.clock()))
    s.add_request(make_request("short2", 11, 2, arrival=s.clock()))
    d.step()
    assert {"long", "short"} <= set(d.log[-1].ids) and "short2" not in d.log[-1].ids
    d.drain()


# -- the adaptive window -------------------------------------------------------------------------


def test_adaptive_window_shrinks_under_a_burst_and_grows_when_sparse():
    w = AdaptiveWindow(window_ms=10.0, min_batch_size=2, max_batch_size=8, window_ms_min=1.0,
                       window_ms_max=40.0, alpha=0.5)
    t = 0.0
    for _ in range(20):  # sparse: a request every 50 ms
        t += 0.050
        w.observe_arrival(t)
    assert w.window_ms == 40.0  # 2 x 50 ms, capped
    history = []
    for _ in range(20):  # a burst: every 1 ms
        t += 0.001
        w.observe_arrival(t)
        history.append(w.window_ms)
    assert history == sorted(history, reverse=True) and w.window_ms == pytest.approx(2.0, 0.01)
    for _ in range(30):
        t += 0.0001
        w.observe_arrival(t)
    assert w.window_ms == 1.0  # floored at window_ms_min
    t += 0.020
    w.observe_arrival(t)
    assert 1.0 < w.window_ms < 40.0  # one sparse gap moves it up, smoothly


def test_adaptive_window_is_validated_and_clamped():
    assert AdaptiveWindow(window_ms=100.0, window_ms_max=20.0).window_ms == 20.0
    with pytest.raises(ValueError, match="window_ms_min"):
        AdaptiveWindow(window_ms_min=5.0, window_ms_max=1.0)
    with pytest.raises(ValueError, match="alpha"):
        AdaptiveWindow(alpha=0.0)
    with pytest.raises(ValueError, match="window_ms_min"):
        EngineConfig(window_ms_min=10.0, window_ms_max=5.0)


def test_scheduler_feeds_arrivals_to_the_adaptive_window():
    clock = FakeClock()
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=4,
                          adaptive_window=True, window_ms=5.0, window_ms_min=0.5,
                          window_ms_max=30.0, min_batch_size=2)
    s = make_scheduler(config, num_pages=65, max_chunk_tokens=16, clock=clock)
    assert isinstance(s.window, AdaptiveWindow) and s.window.window_ms == 5.0
    for i in range(10):
        s.add_request(make_request(f"r{i}", 3, 2, arrival=i * 0.0001))
    assert s.window.window_ms == 0.5
    d = Driver(s)
    d.drain()
    assert len(d.finished) == 10


# -- predictors ----------------------------------------------------------------------------------


def test_mlp_predictor_round_trips_and_resolves(tmp_path):
    rng = np.random.default_rng(0)
    hidden = 4
    model = MLPPredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32),
                         rng.normal(size=(NUM_FEATURES, hidden)).astype(np.float32),
                         np.zeros(hidden, np.float32), rng.normal(size=hidden).astype(np.float32),
                         2.0)
    path = tmp_path / "predictor.json"
    model.save(path)
    loaded = resolve_predictor(str(path))
    request = make_request("r", 17)
    assert loaded(request) == pytest.approx(model(request), rel=1e-5) and model(request) >= 0
    assert resolve_predictor("oracle") is oracle
    assert resolve_predictor("prompt")(request) == 17
    with pytest.raises(ValueError, match="sjf_predictor"):
        resolve_predictor(str(tmp_path / "missing.json"))
    s = make_scheduler(EngineConfig(policy="sjf", sjf_predictor=str(path)), 64, 64)
    assert isinstance(s.policy.predictor, MLPPredictor)


def test_priority_policy_validates_weights():
    with pytest.raises(ValueError, match="weights"):
        PriorityPolicy(weights=(1.0, 0.0))


# -- lpm: longest prefix match first -------------------------------------------------------------


def test_lpm_admits_the_longest_cached_prefix_first():
    """One slot; a runs first and leaves its prompt's pages cached. Of the three waiting, c
    shares 16 tokens (4 pages) with a, d shares 8, b nothing: lpm admits c, d, then b (fcfs:
    b, c, d); without prefix caching lpm is fcfs."""
    shared = list(range(10, 30))
    def requests():
        return [make_request("a", shared, 2), make_request("b", 20, 2, arrival=0.001),
                make_request("c", [*shared[:16], 60, 61, 62], 2, arrival=0.002),
                make_request("d", shared[:8] + [70] * 9, 2, arrival=0.003)]
    assert admission_order(scheduler("lpm", enable_prefix_caching=True),
                           requests()) == ["a", "c", "d", "b"]
    assert admission_order(scheduler("fcfs", enable_prefix_caching=True),
                           requests()) == ["a", "b", "c", "d"]
    assert admission_order(scheduler("lpm"), requests()) == ["a", "b", "c", "d"]


def test_lpm_starvation_guard():
    """A request waiting starvation_s goes before longer matches, oldest first."""
    from jaxserve.core.policies import LPM

    clock = FakeClock()
    s = scheduler(LPM(starvation_s=1.0), clock=clock, enable_prefix_caching=True)
    shared = list(range(10, 30))
    s.add_request(make_request("a", shared, 4))
    driver = Driver(s, clock=clock)
    driver.step()  # a prefills
    s.add_request(make_request("b", 20, 2))
    s.add_request(make_request("c", [*shared[:16], 60, 61], 2))
    driver.step()  # a decodes (one slot: b and c wait); its prompt's pages are keyed now
    now = clock.now
    assert s.kv.cached_prefix_len(s.requests["c"]) == 16
    assert [r.request_id for r in s.policy.order(s.waiting, now)] == ["c", "b"]
    assert [r.request_id for r in s.policy.order(s.waiting, now + 1.0)] == ["b", "c"]
