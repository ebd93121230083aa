"""The host scheduler, driven by a fake runner whose tokens are worked out by hand (no jax):
outputs, slots, the batching window, the batching modes and queue order."""

import pytest
from fake_runner import (
    Driver,
    FakeClock,
    expected,
    first_step,
    last_step,
    make_request,
    mixed_requests,
    run,
    small_scheduler,
)

from jaxserve.core.policies import FCFS
from jaxserve.core.scheduler import BATCHING_MODES

# -- outputs by hand ------------------------------------------------------------------------------


def test_outputs_are_worked_out_by_hand():
    requests = mixed_requests()
    result = run(small_scheduler(), requests)
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
        s = small_scheduler(batching=batching, decode_steps=decode_steps, num_pages=num_pages,
                           max_batch_size=3, max_chunk_tokens=8)
        result = run(s, mixed_requests(), overlap=overlap)
        assert result.outputs == want
        if num_pages == 12 and batching == "continuous":
            assert s.num_preemptions > 0


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_num_seqs"):
        small_scheduler(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="at least 2"):
        small_scheduler(max_num_seqs=1, max_num_batched_tokens=1)
    with pytest.raises(ValueError, match="at least 2"):
        small_scheduler(max_chunk_tokens=1)
    with pytest.raises(ValueError, match="batching"):
        small_scheduler(batching="eager")


def test_a_request_the_policy_cannot_order_leaves_no_trace():
    """add_request raises and the scheduler holds nothing of it: nothing unfinished, nothing to
    abort, and the others run as before."""

    class Refuses(FCFS):
        def key(self, request, now):
            if request.request_id == "bad":
                raise TypeError("cannot order this request")
            return super().key(request, now)

    s = small_scheduler()
    s.policy = Refuses()
    a = make_request("a", 5)
    s.add_request(a)
    with pytest.raises(TypeError):
        s.add_request(make_request("bad", 5))
    assert list(s.requests) == ["a"] and s.abort("bad") is None
    run(s, [])
    assert a.output_ids == expected([make_request("a", 5)])["a"]
    assert not s.has_unfinished_requests()


# -- slots: insertion and eviction ----------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_finished_slot_is_reused_the_next_iteration(overlap):
    s = small_scheduler(max_num_seqs=2)
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
    s = small_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", 2 + i % 5, 1 + i % 7, arrival=i / 1000) for i in range(12)]
    result = run(s, requests)
    assert max(len(entry.running) for entry in result.log) == 3
    assert result.outputs == expected(requests)


# -- the batching window --------------------------------------------------------------------------


def test_lone_request_is_admitted_after_the_window_when_idle():
    clock = FakeClock()
    s = small_scheduler(clock, window_ms=10, max_batch_size=4)
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
    s = small_scheduler(clock, window_ms=3, max_batch_size=4)
    s.add_request(make_request("a", 3, 2, arrival=arrival))
    assert not s.schedule().chunks
    clock.now = s.next_wakeup()
    assert [c.request.request_id for c in s.schedule().chunks] == ["a"]


def test_window_opens_at_once_when_max_batch_size_wait():
    clock = FakeClock()
    s = small_scheduler(clock, window_ms=10, max_batch_size=3, max_num_seqs=4)
    for i in range(2):
        s.add_request(make_request(f"r{i}", 3, 2, arrival=0.0))
    assert not s.schedule().chunks
    s.add_request(make_request("r2", 3, 2, arrival=0.0))
    assert len(s.schedule().chunks) == 3  # no wait: the batch is full


def test_min_batch_size_gates_admission_while_others_run():
    clock = FakeClock()
    s = small_scheduler(clock, window_ms=10, min_batch_size=2, max_batch_size=4)
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


def test_a_preempted_request_does_not_open_the_window_for_new_arrivals():
    """The window judges new arrivals: a preempted request (admitted once, arrived long ago)
    neither counts toward min_batch_size nor makes the oldest waiter old, so a lone arrival
    still waits while others run (it joined 3 ms after arriving)."""
    clock = FakeClock()
    s = small_scheduler(clock, window_ms=10, min_batch_size=2, max_batch_size=4, num_pages=6,
                        max_num_seqs=4)
    d = Driver(s, advance=False)
    for rid, output_len in (("a", 4), ("b", 8), ("d", 4)):
        s.add_request(make_request(rid, 3, output_len, arrival=0.0))
    clock.now = 0.010
    arrived = None
    for _ in range(100):
        entry = d.step()
        if entry.preempted and arrived is None:
            s.add_request(make_request("c", 2, 2, arrival=clock.now))
            arrived = clock.now
        if "c" in entry.ids:
            break
        clock.advance_ms(1)
    assert arrived is not None and "c" in entry.ids
    assert clock.now - arrived >= 0.010 - 1e-9 and entry.running == ["c"]
    d.advance = True
    d.drain()
    assert s.kv.pool.num_free == s.kv.pool.num_usable


def test_window_needs_the_oldest_to_wait_window_ms_while_others_run():
    clock = FakeClock()
    s = small_scheduler(clock, window_ms=10, min_batch_size=1, max_batch_size=4)
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
    s = small_scheduler(clock, batching=batching, max_num_seqs=4, max_batch_size=2)
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
    s = small_scheduler(clock, batching=batching, max_num_seqs=4, max_batch_size=3)
    requests = [make_request("a", 3, 2), make_request("b", 3, 9), make_request("c", 3, 5),
                make_request("d", 3, 2, arrival=0.001)]
    log = run(s, requests, clock=clock).log
    first = log[:last_step(log, "b") + 1]
    assert all(entry.batch_rows == 3 for entry in first if entry.rows)
    assert len(first[-1].running) == 1  # b alone, still padded to the batch's 3 rows
    assert {entry.batch_rows for entry in log[first_step(log, "d"):] if entry.rows} == {1}


def test_continuous_pads_only_to_the_rows_it_runs():
    log = run(small_scheduler(max_num_seqs=4), [make_request("a", 3, 2),
                                               make_request("b", 3, 6)]).log
    assert {entry.batch_rows for entry in log} == {0}


def test_continuous_joins_while_others_run():
    s = small_scheduler(max_num_seqs=4, max_batch_size=2)
    requests = [make_request("short", 3, 2), make_request("long", 3, 12, arrival=0.001),
                make_request("late", 3, 2, arrival=0.002)]
    log = run(s, requests).log
    assert first_step(log, "late") < last_step(log, "long")


def test_dynamic_waits_for_the_window_then_runs_the_batch_to_completion():
    clock = FakeClock()
    s = small_scheduler(clock, batching="dynamic", window_ms=10, max_batch_size=3, max_num_seqs=4)
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
    s = small_scheduler(clock, batching="static", window_ms=1000, max_batch_size=2)
    s.add_request(make_request("a", 3, 2))
    assert [c.request.request_id for c in s.schedule().chunks] == ["a"]


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_batches_respect_max_batch_size_in_policy_order(batching):
    clock = FakeClock()
    s = small_scheduler(clock, batching=batching, max_num_seqs=4, max_batch_size=2)
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
    s = small_scheduler(max_num_seqs=1, policy=policy)
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
