"""The host scheduler, driven by a fake runner whose tokens are worked out by hand (no jax)."""

import pytest
from fake_runner import (
    Driver,
    FakeClock,
    expected_output,
    make_request,
    run,
    token_after,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.core.scheduler import BATCHING_MODES, Scheduler
from jaxserve.core.window import BatchingWindow
from jaxserve.request import RequestStatus


def make_scheduler(clock=None, window_ms=0.0, min_batch_size=1, max_batch_size=None, **kw):
    cfg = dict(num_pages=65, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
               max_chunk_tokens=16)
    cfg |= kw
    window = BatchingWindow(window_ms, min_batch_size, max_batch_size or cfg["max_num_seqs"])
    return Scheduler(clock=clock or FakeClock(), window=window, **cfg)


def first_step(log, request_id):
    """Index of the first step that scheduled the request."""
    return next(i for i, entry in enumerate(log) if request_id in entry.ids)


def last_step(log, request_id):
    return max(i for i, entry in enumerate(log) if request_id in entry.ids)


def mixed_requests():
    return [make_request("a", 5, 9), make_request("b", 19, 3, arrival=0.001),
            make_request("c", 1, 12, arrival=0.002), make_request("d", 8, 1, arrival=0.003),
            make_request("e", 33, 7, arrival=0.004), make_request("f", 2, 5, arrival=0.005)]


def expected(requests):
    return {r.request_id: expected_output(r.prompt_ids, r.params.max_tokens, r.stop_ids)
            for r in requests}


# -- outputs by hand ------------------------------------------------------------------------------


def test_outputs_are_worked_out_by_hand():
    requests = mixed_requests()
    result = run(make_scheduler(), requests)
    assert result.outputs == expected(requests)
    assert set(result.finish_reasons.values()) == {"length"}
    a = requests[0]
    assert result.outputs["a"][0] == (sum(a.prompt_ids) + 4) % 97 + 3  # sampled after position 4


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize("batching", BATCHING_MODES)
def test_outputs_identical_across_modes_overlap_and_preemption(batching, overlap, decode_steps):
    want = expected(mixed_requests())
    for num_pages in (65, 12):  # large pool, and one small enough to preempt
        s = make_scheduler(batching=batching, decode_steps=decode_steps, num_pages=num_pages,
                           max_batch_size=3, max_chunk_tokens=8)
        result = run(s, mixed_requests(), overlap=overlap)
        assert result.outputs == want
        if num_pages == 12 and batching == "continuous":
            assert s.num_preemptions > 0


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="at least 2"):
        make_scheduler(max_num_seqs=1, max_num_batched_tokens=1)
    with pytest.raises(ValueError, match="at least 2"):
        make_scheduler(max_chunk_tokens=1)
    with pytest.raises(ValueError, match="batching"):
        make_scheduler(batching="eager")


# -- slots: insertion and eviction ----------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_finished_slot_is_reused_the_next_iteration(overlap):
    s = make_scheduler(max_num_seqs=2)
    for r in (make_request("a", 3, 2), make_request("b", 3, 10, arrival=0.001),
              make_request("c", 3, 3, arrival=0.002)):
        s.add_request(r)
    d = Driver(s, overlap=overlap)
    while "a" not in d.finished:
        d.step()
        assert "c" not in d.log[-1].running
    finished_at = len(d.log) - 1
    d.step()
    assert "c" in d.log[finished_at + 1].running
    assert d.log[finished_at + 1].row("c").start == 0
    d.drain()
    assert max(len(entry.running) for entry in d.log) == 2
    assert all(len(entry.rows) <= 2 for entry in d.log)


def test_max_num_seqs_never_exceeded():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", 2 + i % 5, 1 + i % 7, arrival=i / 1000) for i in range(12)]
    result = run(s, requests)
    assert max(len(entry.running) for entry in result.log) == 3
    assert result.outputs == expected(requests)


# -- the batching window --------------------------------------------------------------------------


def test_lone_request_is_admitted_after_the_window_when_idle():
    clock = FakeClock()
    s = make_scheduler(clock, window_ms=10, max_batch_size=4)
    s.add_request(make_request("a", 3, 2, arrival=0.0))
    clock.now = 0.009
    assert not s.schedule().chunks
    assert s.next_wakeup() == pytest.approx(0.010)
    clock.now = 0.010
    assert [c.request.request_id for c in s.schedule().chunks] == ["a"]


@pytest.mark.parametrize("arrival", [0.008, 0.1, 1234.567])
def test_window_opens_exactly_at_next_wakeup(arrival):
    # the engine sleeps until next_wakeup(); admission must agree with it to the last float bit
    clock = FakeClock(arrival)
    s = make_scheduler(clock, window_ms=3, max_batch_size=4)
    s.add_request(make_request("a", 3, 2, arrival=arrival))
    assert not s.schedule().chunks
    clock.now = s.next_wakeup()
    assert [c.request.request_id for c in s.schedule().chunks] == ["a"]


def test_window_opens_at_once_when_max_batch_size_wait():
    clock = FakeClock()
    s = make_scheduler(clock, window_ms=10, max_batch_size=3, max_num_seqs=4)
    for i in range(2):
        s.add_request(make_request(f"r{i}", 3, 2, arrival=0.0))
    assert not s.schedule().chunks
    s.add_request(make_request("r2", 3, 2, arrival=0.0))
    assert len(s.schedule().chunks) == 3  # no wait: the batch is full


def test_min_batch_size_gates_admission_while_others_run():
    clock = FakeClock()
    s = make_scheduler(clock, window_ms=10, min_batch_size=2, max_batch_size=4)
    d = Driver(s, advance=False)
    s.add_request(make_request("a", 3, 50, arrival=0.0))
    clock.now = 0.010  # idle: a lone request goes after the window
    d.step()
    assert d.log[-1].ids == ["a"]
    s.add_request(make_request("b", 3, 4, arrival=clock.now))
    clock.advance_ms(30)  # the window has long closed on b, but only one waits while a runs
    for _ in range(3):
        d.step()
        assert "b" not in d.log[-1].running
    s.add_request(make_request("c", 3, 4, arrival=clock.now))
    d.step()  # two wait and the oldest has waited the window
    assert {"b", "c"} <= set(d.log[-1].running)
    d.advance = True
    d.drain()
    assert s.kv.pool.num_free == s.kv.pool.num_usable


def test_window_needs_the_oldest_to_wait_window_ms_while_others_run():
    clock = FakeClock()
    s = make_scheduler(clock, window_ms=10, min_batch_size=1, max_batch_size=4)
    d = Driver(s, advance=False)
    s.add_request(make_request("a", 3, 50, arrival=0.0))
    clock.now = 0.010
    d.step()
    s.add_request(make_request("b", 3, 4, arrival=0.010))
    for ms in range(10):
        clock.now = 0.010 + ms / 1000
        d.step()
        assert "b" not in d.log[-1].running
    clock.now = 0.010 + 10 / 1000
    d.step()
    assert "b" in d.log[-1].running


# -- static, dynamic, continuous ------------------------------------------------------------------


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_nothing_joins_until_the_whole_batch_finishes(batching):
    clock = FakeClock()
    s = make_scheduler(clock, batching=batching, max_num_seqs=4, max_batch_size=2)
    requests = [make_request("short", 3, 2), make_request("long", 3, 12, arrival=0.001),
                make_request("late", 3, 2, arrival=0.002)]
    result = run(s, requests, clock=clock)
    log = result.log
    assert log[first_step(log, "short")].ids == ["short", "long"]
    assert last_step(log, "short") < last_step(log, "long") < first_step(log, "late")
    assert all("late" not in entry.running for entry in log[:last_step(log, "long") + 1])
    assert result.outputs == expected(requests)


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_a_batch_keeps_its_rows_until_it_finishes(batching):
    """A batch running to completion is one fixed shape, as a static batcher's: the runner pads
    its decode rows to the size it formed with, not to the members still running."""
    clock = FakeClock()
    s = make_scheduler(clock, batching=batching, max_num_seqs=4, max_batch_size=3)
    requests = [make_request("a", 3, 2), make_request("b", 3, 9), make_request("c", 3, 5),
                make_request("d", 3, 2, arrival=0.001)]
    log = run(s, requests, clock=clock).log
    first = log[:last_step(log, "b") + 1]
    assert all(entry.batch_rows == 3 for entry in first if entry.rows)
    assert len(first[-1].running) == 1  # b alone, still padded to the batch's 3 rows
    assert {entry.batch_rows for entry in log[first_step(log, "d"):] if entry.rows} == {1}


def test_continuous_pads_only_to_the_rows_it_runs():
    log = run(make_scheduler(max_num_seqs=4), [make_request("a", 3, 2),
                                               make_request("b", 3, 6)]).log
    assert {entry.batch_rows for entry in log} == {0}


def test_continuous_joins_while_others_run():
    s = make_scheduler(max_num_seqs=4, max_batch_size=2)
    requests = [make_request("short", 3, 2), make_request("long", 3, 12, arrival=0.001),
                make_request("late", 3, 2, arrival=0.002)]
    log = run(s, requests).log
    assert first_step(log, "late") < last_step(log, "long")


def test_dynamic_waits_for_the_window_then_runs_the_batch_to_completion():
    clock = FakeClock()
    s = make_scheduler(clock, batching="dynamic", window_ms=10, max_batch_size=3, max_num_seqs=4)
    d = Driver(s, advance=False)
    s.add_request(make_request("a", 3, 6, arrival=0.0))
    clock.now = 0.004
    s.add_request(make_request("b", 3, 6, arrival=0.004))
    d.step()
    assert not d.log[-1].rows  # the window has not closed on a yet
    clock.now = 0.010
    d.step()
    assert d.log[-1].ids == ["a", "b"]
    s.add_request(make_request("c", 3, 2, arrival=clock.now))
    while "a" in s.requests or "b" in s.requests:
        clock.advance_ms(1)
        d.step()
        assert "c" not in d.log[-1].running
    d.advance = True
    d.drain()
    assert "c" in d.finished


def test_static_ignores_the_window():
    clock = FakeClock()
    s = make_scheduler(clock, batching="static", window_ms=1000, max_batch_size=2)
    s.add_request(make_request("a", 3, 2))
    assert [c.request.request_id for c in s.schedule().chunks] == ["a"]


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_batches_respect_max_batch_size_in_policy_order(batching):
    clock = FakeClock()
    s = make_scheduler(clock, batching=batching, max_num_seqs=4, max_batch_size=2)
    requests = [make_request(f"r{i}", 3 + i, 3 + i % 2, arrival=i / 1000) for i in range(5)]
    result = run(s, requests, clock=clock)
    assert max(len(entry.running) for entry in result.log) == 2
    batches = []  # a batch shrinks as members finish; a new one is not part of the last
    for entry in result.log:
        if entry.running and not (batches and set(entry.running) <= set(batches[-1])):
            batches.append(entry.running)
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert result.outputs == expected(requests)


# -- queue order ----------------------------------------------------------------------------------


def admission_order(policy):
    s = make_scheduler(max_num_seqs=1, policy=policy)
    requests = [make_request("p2-early", 3, 1, arrival=0.000, priority=2),
                make_request("p0-late", 3, 1, arrival=0.003, priority=0),
                make_request("p1", 3, 1, arrival=0.001, priority=1),
                make_request("p0-early", 3, 1, arrival=0.002, priority=0)]
    log = run(s, requests[::-1]).log
    return sorted((first_step(log, r.request_id), r.request_id) for r in requests)


def test_priority_order_lower_value_first_arrival_breaks_ties():
    assert [rid for _, rid in admission_order("priority")] == [
        "p0-early", "p0-late", "p1", "p2-early"]


def test_fcfs_order_is_arrival_order():
    assert [rid for _, rid in admission_order("fcfs")] == [
        "p2-early", "p1", "p0-early", "p0-late"]


# -- the token budget and chunking ----------------------------------------------------------------


def test_long_prompt_is_chunked_to_max_chunk_tokens():
    s = make_scheduler(max_num_batched_tokens=64, max_chunk_tokens=8)
    result = run(s, [make_request("long", 30, 2)])
    rows = [entry.row("long") for entry in result.log if entry.row("long")]
    assert [(r.start, r.num_tokens, r.num_samples) for r in rows[:4]] == [
        (0, 8, 0), (8, 8, 0), (16, 8, 0), (24, 6, 1)]


def test_chunk_takes_what_the_budget_leaves_after_running_decodes():
    s = make_scheduler(max_num_batched_tokens=16, max_chunk_tokens=64)
    d = Driver(s)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 3, 30))
    d.step()
    d.step()  # a and b decode now
    s.add_request(make_request("long", 40, 2, arrival=s.clock()))
    for want_start in (0, 14, 28):
        entry = d.step()
        assert [r.request_id for r in entry.rows] == ["a", "b", "long"]  # decodes first
        assert entry.rows[2].start == want_start
        assert entry.rows[2].num_tokens == min(14, 40 - want_start)
        assert sum(r.num_tokens for r in entry.rows) <= 16
    d.drain()


def test_running_decodes_are_never_starved_by_an_older_chunking_request():
    s = make_scheduler(max_num_batched_tokens=8, max_chunk_tokens=8, max_num_seqs=4)
    long = make_request("long", 60, 2, arrival=-1.0)
    short = make_request("short", 2, 20, arrival=0.0)
    s.add_request(short)
    d = Driver(s)
    d.step()
    s.add_request(long)  # earlier arrival: first in fcfs order
    for _ in range(6):
        entry = d.step()
        assert entry.rows[0].request_id == "short"
        assert entry.rows[0].num_tokens == 1
    d.drain()
    assert short.output_ids == expected_output(short.prompt_ids, 20)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_one_token_of_budget_never_makes_a_prompt_chunk_a_decode_row(decode_steps):
    # the first prompt leaves one token of budget; a 1-token row is a decode row to the runner,
    # so the second prompt must wait rather than sample after its first token
    s = make_scheduler(max_num_batched_tokens=8, max_chunk_tokens=8, decode_steps=decode_steps)
    requests = [make_request("a", 7, 3), make_request("b", 10, 3)]
    result = run(s, requests)
    assert result.log[0].ids == ["a"]
    assert all(row.num_tokens > 1 for e in result.log if (row := e.row("b")) and row.start < 9)
    assert result.outputs == expected(requests)


# -- preemption -----------------------------------------------------------------------------------


def preemption_workload():
    # three requests of 6 + 12 tokens: 5 pages of 4 each, and only 8 pages in the pool
    return [make_request(rid, 6, 12, arrival=i / 1000, priority=p)
            for i, (rid, p) in enumerate([("a", 2), ("b", 0), ("c", 1)])]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_victim_is_policys_last_and_output_is_unchanged(policy, overlap):
    s = make_scheduler(num_pages=9, max_num_seqs=3, max_chunk_tokens=32, policy=policy)
    requests = preemption_workload()
    for r in requests:
        s.add_request(r)
    d = Driver(s, overlap=overlap)
    victims = []
    while d.busy():
        ranked = sorted(s.running, key=lambda r: s.policy.key(r, 0.0), reverse=True)
        entry = d.step()
        if entry.preempted:
            victims += entry.preempted
            assert entry.preempted == [r.request_id for r in ranked[:len(entry.preempted)]]
    assert victims and s.num_preemptions == len(victims)
    assert victims[0] == ("c" if policy == "fcfs" else "a")
    assert sum(r.metrics.num_preemptions for r in requests) == len(victims)
    assert {r.request_id: r.output_ids for r in requests} == expected(requests)
    assert s.kv.pool.num_free == s.kv.pool.num_usable
    big = run(make_scheduler(max_num_seqs=3, max_chunk_tokens=32, policy=policy),
              preemption_workload(), overlap=overlap)
    assert big.outputs == {r.request_id: r.output_ids for r in requests}


def test_preempted_request_resumes_by_recomputing_prompt_and_output():
    s = make_scheduler(num_pages=9, max_num_seqs=3, max_chunk_tokens=32)
    result = run(s, preemption_workload())
    victim = next(entry.preempted[0] for entry in result.log if entry.preempted)
    k = next(i for i, entry in enumerate(result.log) if victim in entry.preempted)
    resume = next(entry.row(victim) for entry in result.log[k + 1:] if entry.row(victim))
    assert resume.start == 0 and resume.num_tokens > 6 and resume.num_samples == 1


def test_new_requests_never_preempt_running_ones():
    s = make_scheduler(num_pages=4, max_num_seqs=2, policy="priority")
    d = Driver(s)
    s.add_request(make_request("low", 8, 4, priority=5))  # grows to all 3 usable pages
    d.step()
    s.add_request(make_request("urgent", 8, 4, priority=0))
    for _ in range(3):
        entry = d.step()
        assert not entry.preempted and "urgent" not in entry.running
    d.drain()
    assert "urgent" in d.finished


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_nobody_joins_in_an_iteration_that_preempts(decode_steps):
    # b is preempted while slots are full; c (a 1-token prompt, waiting for a slot) must not take
    # b's pages ahead of it, nor join a multi-step iteration and sample past its max_len
    for num_pages in (7, 8, 9, 11):  # a alone needs 6 pages
        s = make_scheduler(decode_steps=decode_steps, max_num_seqs=2, num_pages=num_pages)
        requests = [make_request("a", 3, 20), make_request("b", 3, 20, arrival=0.0001),
                    make_request("c", 1, 1, arrival=0.0002)]
        result = run(s, requests)
        assert s.num_preemptions > 0
        for entry in result.log:
            if entry.preempted:
                assert set(entry.running) <= set(result.log[result.log.index(entry) - 1].running)
        assert result.outputs == expected(requests)


# -- abort ----------------------------------------------------------------------------------------


def assert_all_free(s):
    assert s.kv.pool.num_free == s.kv.pool.num_usable


def test_abort_waiting():
    s = make_scheduler()
    r = make_request("a", 5, 4)
    s.add_request(r)
    assert s.abort("a") is r
    assert r.status == RequestStatus.FINISHED_ABORTED and r.status.value == "abort"
    assert not s.waiting and not s.has_unfinished_requests()
    assert s.abort("a") is None and s.abort("unknown") is None
    assert not s.schedule().chunks
    assert_all_free(s)


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_running_mid_prompt(overlap):
    s = make_scheduler(max_chunk_tokens=8)
    r, other = make_request("a", 40, 4), make_request("b", 3, 6, arrival=0.001)
    s.add_request(r)
    s.add_request(other)
    d = Driver(s, overlap=overlap)
    d.step()
    assert r.status == RequestStatus.RUNNING and 0 < r.num_computed_tokens < 40
    s.abort("a")
    assert r.pages == [] and r not in s.running
    assert s.kv.pool.num_free == s.kv.pool.num_usable - len(other.pages)
    d.drain()
    assert r.output_ids == [] and r.status == RequestStatus.FINISHED_ABORTED
    assert other.output_ids == expected_output(other.prompt_ids, 6)
    assert_all_free(s)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_abort_decoding_with_a_step_in_flight_discards_its_tokens(decode_steps):
    s = make_scheduler(decode_steps=decode_steps)
    r, other = make_request("a", 5, 40), make_request("b", 3, 6, arrival=0.001)
    s.add_request(r)
    s.add_request(other)
    d = Driver(s)
    while len(r.output_ids) < 3:
        d.step()
    assert d.inflight is not None and "a" in d.inflight[1] and r.num_pending > 0
    n = len(r.output_ids)
    s.abort("a")
    assert r.pages == [] and r not in s.running
    d.drain()
    assert r.output_ids == expected_output(r.prompt_ids, 40)[:n]  # nothing from the flight
    assert r.num_pending == 0 and r.stop_reason is None
    assert other.output_ids == expected_output(other.prompt_ids, 6)
    assert_all_free(s)


def test_abort_preempted_request_waiting_again():
    s = make_scheduler(num_pages=9, max_num_seqs=3, max_chunk_tokens=32)
    requests = preemption_workload()
    for r in requests:
        s.add_request(r)
    d = Driver(s)
    while not d.log or not d.log[-1].preempted:
        d.step()
    victim = s.requests[d.log[-1].preempted[0]]
    assert victim.status == RequestStatus.WAITING and victim.pages == []
    n = len(victim.output_ids)
    pending = victim.num_pending
    s.abort(victim.request_id)
    assert victim not in s.waiting and victim.status == RequestStatus.FINISHED_ABORTED
    d.drain()
    assert len(victim.output_ids) == n and victim.num_pending == 0
    assert pending >= 0
    for r in requests:
        if r is not victim:
            assert r.output_ids == expected_output(r.prompt_ids, 12)
    assert_all_free(s)


# -- stop conditions ------------------------------------------------------------------------------


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_stop_conditions(decode_steps, overlap):
    prompt = [10, 11, 12]
    third = token_after(prompt, len(prompt) + 1)  # the third output token
    requests = [
        make_request("length", prompt, 6),
        make_request("stop-id", prompt, 6, stop_token_ids=(third,)),
        make_request("eos", prompt, 6, eos=frozenset({third})),
        make_request("ignore-eos", prompt, 6, eos=frozenset({third}), ignore_eos=True),
    ]
    s = make_scheduler(decode_steps=decode_steps)
    result = run(s, requests, overlap=overlap)
    full = expected_output(prompt, 6)
    assert result.outputs == {"length": full, "stop-id": full[:3], "eos": full[:3],
                              "ignore-eos": full}
    assert result.finish_reasons == {"length": "length", "stop-id": "stop", "eos": "stop",
                                     "ignore-eos": "length"}
    assert result.stop_reasons == {"length": None, "stop-id": third, "eos": None,
                                   "ignore-eos": None}


# -- multi-step decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_multi_step_decode_matches_single_step(overlap):
    requests = [make_request(f"r{i}", 2 + 3 * i, 1 + 5 * i, arrival=i / 1000) for i in range(4)]
    one = run(make_scheduler(decode_steps=1), requests, overlap=overlap)
    s = make_scheduler(decode_steps=4)
    four = run(s, [make_request(f"r{i}", 2 + 3 * i, 1 + 5 * i, arrival=i / 1000)
                   for i in range(4)], overlap=overlap)
    assert four.outputs == one.outputs == expected(requests)
    assert any(entry.decode_steps == 4 for entry in four.log)
    assert len(four.log) < len(one.log)
    for entry in four.log:
        for row in entry.rows:
            if row.num_tokens == 1:
                assert row.num_samples == entry.decode_steps


def test_multi_step_decode_never_passes_max_tokens():
    s = make_scheduler(decode_steps=4)
    r = make_request("a", 3, 6)
    result = run(s, [r])
    assert len(r.output_ids) == 6
    steps = [entry.decode_steps for entry in result.log if entry.row("a")]
    # prefill samples 1, then 4, then the 1 that remains (not 4 past max_tokens)
    assert steps[:3] == [1, 4, 1]
    assert all(row.start + row.num_samples <= r.max_len
               for entry in result.log if (row := entry.row("a")))


def test_multi_step_decode_drops_to_one_while_requests_wait_for_admission():
    s = make_scheduler(decode_steps=4, max_num_seqs=2)
    d = Driver(s)
    s.add_request(make_request("a", 3, 40))
    d.step()
    d.step()
    assert d.log[-1].decode_steps == 4
    s.add_request(make_request("b", 3, 8, arrival=s.clock()))
    entry = d.step()
    assert entry.decode_steps == 1 and "b" in entry.ids
    s.add_request(make_request("c", 3, 8, arrival=s.clock()))  # slots full: c cannot join yet
    entry = d.step()
    assert "c" not in entry.running and entry.decode_steps == 4
    d.drain()


def test_multi_step_decode_stays_one_while_prompts_are_chunked():
    s = make_scheduler(decode_steps=4, max_chunk_tokens=4)
    d = Driver(s)
    s.add_request(make_request("a", 3, 40))
    d.step()
    s.add_request(make_request("b", 20, 4, arrival=s.clock()))
    for _ in range(4):
        entry = d.step()
        assert entry.decode_steps == 1
    d.drain()


# -- random workloads -----------------------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / abort / step / clock sequences on small pools."""

    @initialize(batching=st.sampled_from(BATCHING_MODES), policy=st.sampled_from(["fcfs", "priority"]),
                decode_steps=st.sampled_from([1, 4]), overlap=st.booleans(),
                num_pages=st.integers(4, 16), page_size=st.sampled_from([2, 4]),
                max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 16),
                max_chunk_tokens=st.integers(2, 12), window_ms=st.sampled_from([0.0, 3.0]),
                min_batch_size=st.integers(1, 2))
    def setup(self, batching, policy, decode_steps, overlap, num_pages, page_size, max_num_seqs,
              extra_budget, max_chunk_tokens, window_ms, min_batch_size):
        self.clock = FakeClock()
        self.scheduler = make_scheduler(
            self.clock, batching=batching, policy=policy, decode_steps=decode_steps,
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2, max_num_seqs + extra_budget),
            max_chunk_tokens=max_chunk_tokens,
            window_ms=window_ms, min_batch_size=min(min_batch_size, max_num_seqs))
        self.driver = Driver(self.scheduler, overlap=overlap)
        self.capacity = (num_pages - 1) * page_size  # a request alone always fits
        self.requests = {}
        self.aborted = set()

    @rule(burst=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16), st.integers(0, 2),
                                   st.one_of(st.none(), st.integers(3, 99))),
                         min_size=1, max_size=3))
    def add(self, burst):
        for prompt_len, max_tokens, priority, eos in burst:
            prompt_len = min(prompt_len, self.capacity - 1)
            max_tokens = min(max_tokens, self.capacity - prompt_len)
            rid = f"r{len(self.requests)}"
            request = make_request(rid, prompt_len, max_tokens, arrival=self.clock.now,
                                   priority=priority, eos=frozenset() if eos is None else {eos})
            self.scheduler.add_request(request)
            self.requests[rid] = request

    def _abort_one(self, data, candidates):
        if candidates:
            rid = data.draw(st.sampled_from(sorted(r.request_id for r in candidates)))
            assert self.scheduler.abort(rid) is self.requests[rid]
            self.aborted.add(rid)

    @rule(data=st.data())
    def abort_running(self, data):
        self._abort_one(data, self.scheduler.running)

    @rule(data=st.data())
    def abort_waiting(self, data):
        self._abort_one(data, self.scheduler.waiting)

    @rule(n=st.integers(1, 8))
    def step(self, n):
        for _ in range(n):
            self.driver.step()

    @rule(ms=st.integers(1, 5))
    def wait(self, ms):
        self.clock.advance_ms(ms)

    @invariant()
    def bounded(self):
        if hasattr(self, "scheduler"):
            self.driver.runner.check_pages()
            assert all(len(e.rows) <= self.scheduler.max_num_seqs for e in self.driver.log[-1:])

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        self.driver.clock = self.clock
        self.driver.drain(max_steps=2000)
        s = self.scheduler
        assert s.kv.pool.num_free == s.kv.pool.num_usable
        assert not s.running and not s.waiting and not s.requests
        for rid, r in self.requests.items():
            assert r.status.finished and r.num_pending == 0 and r.pages == []
            want = expected_output(r.prompt_ids, r.params.max_tokens, r.stop_ids)
            if rid in self.aborted:
                assert r.output_ids == want[:len(r.output_ids)]
            else:
                assert r.output_ids == want


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
