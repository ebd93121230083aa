"""How the runner splits an iteration's prompt chunks into prefill calls (core.buckets)."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core import buckets
from jaxserve.core.buckets import (
    CALL_TOKENS,
    bucket,
    prefill_calls,
    prefill_groups,
    prefill_row_buckets,
    prefill_shapes,
    ragged_calls,
    ragged_token_buckets,
)

# no clock in the verdict: hypothesis fails an example past 200 ms by default, and its data
# generation when slow; a busy machine pausing either is no error of the code
UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

ROWS, CHUNKS = prefill_row_buckets((2, 4, 8, 16, 32)), (16, 64, 256)


def padded(groups, lengths):
    return sum(bucket(len(g), ROWS, "rows") * bucket(max(lengths[i] for i in g), CHUNKS, "chunk")
               + CALL_TOKENS for g in groups)


def test_bucket_is_the_smallest_size_that_fits_and_names_what_overflows():
    assert bucket(1, CHUNKS, "chunk") == 16 and bucket(16, CHUNKS, "chunk") == 16
    assert bucket(17, CHUNKS, "chunk") == 64
    with pytest.raises(ValueError, match="chunk length 257 exceeds the largest bucket 256"):
        bucket(257, CHUNKS, "chunk length")


def test_prefill_calls_may_run_one_row():
    assert prefill_row_buckets((2, 4, 8)) == (1, 2, 4, 8)
    assert prefill_row_buckets((1, 2)) == (1, 2)


def test_one_long_chunk_does_not_pad_the_short_ones():
    # one call would be 4 x 256 tokens; apart: 4 x 64 for the short ones + 1 x 256
    assert prefill_groups([200, 20, 20, 20], ROWS, CHUNKS) == [[1, 2, 3], [0]]
    assert prefill_groups([200, 60], ROWS, CHUNKS) == [[1], [0]]


def test_chunks_of_one_bucket_share_a_call_in_their_order():
    assert prefill_groups([40, 30, 50, 64], ROWS, CHUNKS) == [[0, 1, 2, 3]]
    assert prefill_groups([], ROWS, CHUNKS) == []


def test_a_row_joins_its_neighbour_when_that_pads_less():
    # three 70s pad to 4 rows of 256 anyway: the 60 fills the fourth instead of a call of its own
    assert prefill_groups([70, 60, 70, 70], ROWS, CHUNKS) == [[0, 1, 2, 3]]


def test_a_chunk_that_wants_prompt_logprobs_runs_alone():
    # the 40 and 30 would share a call; the 30 wants prompt logprobs, so it runs as one row
    assert prefill_calls([40, 30, 50, 200], [False, True, False, False], ROWS, CHUNKS) == [
        [1], [0, 2], [3]]
    assert prefill_calls([40, 30], [False, False], ROWS, CHUNKS) == [[0, 1]]


def test_prefill_shapes_by_hand():
    # budget 18: a 32-bucket chunk is at least 17 tokens, so it runs alone
    assert prefill_shapes((16, 32), (1, 2, 4), 18) == [(1, 16), (2, 16), (4, 16), (1, 32)]


@UNTIMED
@given(st.lists(st.sampled_from([2, 3, 16, 17, 64, 65, 255, 256]) | st.integers(2, 256),
                min_size=1, max_size=64), st.integers(2, 600))
def test_every_call_of_a_budget_lands_in_a_prefill_shape(lengths, budget):
    """What warm-up compiles (prefill_shapes) holds every call an iteration's chunks within
    the token budget can make (lengths at the buckets' edges: the tightest calls)."""
    total = 0
    lengths = [n for n in lengths if (total := total + n) <= budget]
    shapes = set(prefill_shapes(CHUNKS, ROWS, budget))
    for group in prefill_calls(lengths, [False] * len(lengths), ROWS, CHUNKS):
        call = (bucket(len(group), ROWS, "rows"),
                bucket(max(lengths[i] for i in group), CHUNKS, "chunk"))
        assert call in shapes, (lengths, group)


@UNTIMED
@given(st.lists(st.integers(2, 256), min_size=1, max_size=32))
def test_groups_partition_the_rows_and_never_pad_more_than_one_call(lengths):
    groups = prefill_groups(lengths, ROWS, CHUNKS)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)
    assert padded(groups, lengths) <= padded([list(range(len(lengths)))], lengths)


def _cheapest_by_trying_every_cut(lengths, rows, chunks):
    """The padded cost of the best split, trying every set of cuts at bucket boundaries."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    keys = [bucket(lengths[i], chunks, "chunk") for i in order]
    cuts = [j for j in range(1, len(order)) if keys[j] != keys[j - 1]]
    return min(sum(bucket(hi - lo, rows, "rows") * keys[hi - 1] + CALL_TOKENS
                   for lo, hi in itertools.pairwise([0, *chosen, len(order)]))
               for r in range(len(cuts) + 1) for chosen in itertools.combinations(cuts, r))


MANY = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@UNTIMED
@given(st.lists(st.integers(2, 256), min_size=1, max_size=12))
def test_groups_are_the_cheapest_split(lengths):
    groups = prefill_groups(lengths, ROWS, MANY)
    cost = sum(bucket(len(g), ROWS, "rows") * bucket(max(lengths[i] for i in g), MANY, "chunk")
               + CALL_TOKENS for g in groups)
    assert cost == _cheapest_by_trying_every_cut(lengths, ROWS, MANY)


def test_many_chunk_buckets_stay_cheap_to_split(monkeypatch):
    # 64 buckets and 32 chunks, each in a bucket of its own: trying every set of cuts priced
    # 2^31 splits (seconds at 20 chunks, doubling with each one more); now each of the 33
    # boundaries is priced against every earlier one
    priced = []
    monkeypatch.setattr(buckets, "bucket", lambda n, sizes, what: priced.append(n) or
                        bucket(n, sizes, what))
    groups = prefill_groups([16 * (i + 1) for i in range(32)], prefill_row_buckets(
        tuple(range(2, 33))), tuple(range(16, 1025, 16)))
    assert sorted(i for g in groups for i in g) == list(range(32))
    assert len(priced) <= 32 + 32 * 33 // 2


def test_ragged_token_buckets_follow_the_chunk_buckets_up_to_the_budget():
    assert ragged_token_buckets((32, 48, 64, 96, 128, 192, 256), 1024) == (
        32, 48, 64, 96, 128, 192, 256, 320, 400, 512, 640, 800, 1024)
    assert ragged_token_buckets((16, 32, 64, 128, 256), 128) == (16, 32, 64, 80, 112, 128)
    assert ragged_token_buckets((256,), 16) == (16,)  # the budget cuts every chunk to 16
    assert ragged_token_buckets((16,), 20) == (16, 20)  # nothing just below the budget
    for chunks, budget in (((16, 32, 64, 128, 256), 2048), ((8,), 100)):
        sizes = ragged_token_buckets(chunks, budget)
        assert sizes[-1] == budget and list(sizes) == sorted(set(sizes))
        assert all(b <= max(2 * a, a + 16) for a, b in itertools.pairwise(sizes))


def test_ragged_calls_pack_rows_in_order_into_the_smallest_bucket_that_holds_them():
    sizes = ragged_token_buckets((32, 48, 64, 96, 128, 192, 256), 1024)
    assert ragged_calls([100, 200, 300, 424], sizes, 16) == [([0, 1, 2, 3], 1024)]
    assert ragged_calls([40], sizes, 16) == [([0], 48)]
    assert ragged_calls([10, 10, 10, 10], sizes, 16) == [([0, 1, 2, 3], 48)]
    # decode rows (one token each) among prompt chunks; at most max_rows rows a call
    assert ragged_calls([1] * 20 + [30], sizes, 32) == [(list(range(21)), 64)]
    calls = ragged_calls([3] * 20, sizes, 16)
    assert calls == [(list(range(16)), 48), ([16, 17, 18, 19], 32)]
    # and at most the largest bucket's tokens
    assert ragged_calls([600, 600], sizes, 16) == [([0], 640), ([1], 640)]
    assert ragged_calls([], sizes, 16) == []
    with pytest.raises(ValueError, match="exceeds the largest ragged bucket 1024"):
        ragged_calls([1025], sizes, 16)
