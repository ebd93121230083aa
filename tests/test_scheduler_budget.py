"""The host scheduler under pressure, with the fake runner (no jax): the token budget and
chunking, preemption, abort in every state, stops and multi-step decode."""

import pytest
from fake_runner import (
    Driver,
    FakeClock,
    expected,
    expected_output,
    make_request,
    run,
    small_scheduler,
    token_after,
)

from jaxserve.core.policies import MLFQ
from jaxserve.request import Request, RequestStatus

# -- the token budget and chunking ----------------------------------------------------------------


def test_long_prompt_is_chunked_to_max_chunk_tokens():
    s = small_scheduler(max_num_batched_tokens=64, max_chunk_tokens=8)
    result = run(s, [make_request("long", 30, 2)])
    rows = [entry.row("long") for entry in result.log if entry.row("long")]
    assert [(r.start, r.num_tokens, r.num_samples) for r in rows[:4]] == [
        (0, 8, 0), (8, 8, 0), (16, 8, 0), (24, 6, 1)]


def test_chunk_takes_what_the_budget_leaves_after_running_decodes():
    s = small_scheduler(max_num_batched_tokens=16, max_chunk_tokens=64)
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
    s = small_scheduler(max_num_batched_tokens=8, max_chunk_tokens=8, max_num_seqs=4)
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
    s = small_scheduler(max_num_batched_tokens=8, max_chunk_tokens=8, decode_steps=decode_steps)
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
    s = small_scheduler(num_pages=9, max_num_seqs=3, max_chunk_tokens=32, policy=policy)
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
    big = run(small_scheduler(max_num_seqs=3, max_chunk_tokens=32, policy=policy),
              preemption_workload(), overlap=overlap)
    assert big.outputs == {r.request_id: r.output_ids for r in requests}


def test_preempted_request_resumes_by_recomputing_prompt_and_output():
    s = small_scheduler(num_pages=9, max_num_seqs=3, max_chunk_tokens=32)
    result = run(s, preemption_workload())
    victim = next(entry.preempted[0] for entry in result.log if entry.preempted)
    k = next(i for i, entry in enumerate(result.log) if victim in entry.preempted)
    resume = next(entry.row(victim) for entry in result.log[k + 1:] if entry.row(victim))
    assert resume.start == 0 and resume.num_tokens > 6 and resume.num_samples == 1


def test_new_requests_never_preempt_running_ones():
    s = small_scheduler(num_pages=4, max_num_seqs=2, policy="priority")
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
        s = small_scheduler(decode_steps=decode_steps, max_num_seqs=2, num_pages=num_pages)
        requests = [make_request("a", 3, 20), make_request("b", 3, 20, arrival=0.0001),
                    make_request("c", 1, 1, arrival=0.0002)]
        result = run(s, requests)
        assert s.num_preemptions > 0
        for entry in result.log:
            if entry.preempted:
                assert set(entry.running) <= set(result.log[result.log.index(entry) - 1].running)
        assert result.outputs == expected(requests)


def _under_a_stream(policy, num_pages: int, long: Request, steps: int = 1500) -> Driver:
    """`long` first, then a 3 + 12-token request every 6 steps, the clock 1 ms a step."""
    clock = FakeClock()
    s = small_scheduler(clock, num_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=16,
                        max_chunk_tokens=8, policy=policy)
    d = Driver(s, advance=False)
    s.add_request(long)
    for t in range(steps):
        if t % 6 == 0:
            s.add_request(make_request(f"s{t}", 3, 12, arrival=clock.now))
        d.step()
        clock.advance_ms(1)
    return d


@pytest.mark.parametrize(("policy", "num_pages", "priority", "output_len"), [
    ("fcfs", 12, 0, 40),  # the oldest needs every page: the newest running one gives its up
    ("priority", 10, 1, 30),  # a batch request preempted twice keeps its pages from then on
    (MLFQ(starvation_s=0.05), 16, 0, 40),  # demoted, then promoted for a quantum: it progresses
    ("mlfq", 16, 0, 40),  # the defaults: two fruitless preemptions promote it, not 5 s
    ("mlfq", 10, 0, 30),
])
def test_page_pressure_never_starves_a_request(policy, num_pages, priority, output_len):
    """A long request among a steady stream of short ones, pages short: it finishes with its
    exact output. (The victim used to be chosen only among requests not yet scheduled in the
    iteration, so the long one preempted itself over and over, hundreds of times.)"""
    long = make_request("L", 3, output_len, priority=priority)
    d = _under_a_stream(policy, num_pages, long)
    assert long.status.finished
    assert long.output_ids == expected([make_request("L", 3, output_len)])["L"]
    assert long.metrics.num_preemptions <= 20 and len(d.finished) > 200


def test_a_request_larger_than_the_kv_cache_is_refused():
    s = small_scheduler(num_pages=9, max_num_seqs=2, max_chunk_tokens=8,
                        max_num_batched_tokens=8)  # 8 usable pages of 4 tokens
    with pytest.raises(ValueError, match="needs 10 KV pages at its max length 40; the KV cache "
                                         "has 8"):
        s.add_request(make_request("big", 20, 20))
    assert not s.has_unfinished_requests()
    assert run(s, [make_request("fits", 16, 16)]).outputs["fits"] == expected(
        [make_request("fits", 16, 16)])["fits"]


def test_a_preempted_request_skips_the_window():
    """min_batch_size gates new arrivals; a preempted request was admitted once and returns as
    soon as pages allow, not when enough others wait."""
    back = {}
    for min_batch in (1, 2):
        s = small_scheduler(num_pages=15, max_num_seqs=3, max_num_batched_tokens=64,
                            max_chunk_tokens=64, min_batch_size=min_batch)
        d = Driver(s)
        for r in (make_request("c", 32, 6), make_request("a", 6, 40, arrival=0.001),
                  make_request("b", 6, 10, arrival=0.002)):
            s.add_request(r)
        d.drain()
        gone = next(i for i, e in enumerate(d.log) if "b" in e.preempted)
        back[min_batch] = next(i for i, e in enumerate(d.log) if i > gone and "b" in e.ids)
    assert back[2] == back[1]


# -- abort ----------------------------------------------------------------------------------------


def assert_all_free(s):
    assert s.kv.pool.num_free == s.kv.pool.num_usable


def test_abort_waiting():
    s = small_scheduler()
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
    s = small_scheduler(max_chunk_tokens=8)
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
    s = small_scheduler(decode_steps=decode_steps)
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
    s = small_scheduler(num_pages=9, max_num_seqs=3, max_chunk_tokens=32)
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
        # a generation_config stop id beside the tokenizer's EOS: its id is the reason (vLLM)
        make_request("named-eos", prompt, 6, eos=frozenset({third}), named_eos=frozenset({third})),
        # the tokenizer's EOS named in stop_token_ids too: EOS wins, no reason (vLLM checks it
        # first); with ignore_eos only the stop id ends it, and names itself
        make_request("eos-as-stop-id", prompt, 6, eos=frozenset({third}), stop_token_ids=(third,)),
        make_request("ignored-eos-as-stop-id", prompt, 6, eos=frozenset({third}),
                     stop_token_ids=(third,), ignore_eos=True),
    ]
    s = small_scheduler(decode_steps=decode_steps)
    result = run(s, requests, overlap=overlap)
    full = expected_output(prompt, 6)
    assert result.outputs == {"length": full, "stop-id": full[:3], "eos": full[:3],
                              "ignore-eos": full, "named-eos": full[:3],
                              "eos-as-stop-id": full[:3], "ignored-eos-as-stop-id": full[:3]}
    assert result.finish_reasons == {"length": "length", "stop-id": "stop", "eos": "stop",
                                     "ignore-eos": "length", "named-eos": "stop",
                                     "eos-as-stop-id": "stop", "ignored-eos-as-stop-id": "stop"}
    assert result.stop_reasons == {"length": None, "stop-id": third, "eos": None,
                                   "ignore-eos": None, "named-eos": third,
                                   "eos-as-stop-id": None, "ignored-eos-as-stop-id": third}


# -- multi-step decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_multi_step_decode_matches_single_step(overlap):
    requests = [make_request(f"r{i}", 2 + 3 * i, 1 + 5 * i, arrival=i / 1000) for i in range(4)]
    one = run(small_scheduler(decode_steps=1), requests, overlap=overlap)
    s = small_scheduler(decode_steps=4)
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
    s = small_scheduler(decode_steps=4)
    r = make_request("a", 3, 6)
    result = run(s, [r])
    assert len(r.output_ids) == 6
    steps = [entry.decode_steps for entry in result.log if entry.row("a")]
    # prefill samples 1, then 4, then the 1 that remains (not 4 past max_tokens)
    assert steps[:3] == [1, 4, 1]
    assert all(row.start + row.num_samples <= r.max_len
               for entry in result.log if (row := entry.row("a")))


def test_multi_step_decode_drops_to_one_while_requests_wait_for_admission():
    s = small_scheduler(decode_steps=4, max_num_seqs=2)
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
    s = small_scheduler(decode_steps=4, max_chunk_tokens=4)
    d = Driver(s)
    s.add_request(make_request("a", 3, 40))
    d.step()
    s.add_request(make_request("b", 20, 4, arrival=s.clock()))
    for _ in range(4):
        entry = d.step()
        assert entry.decode_steps == 1
    d.drain()
