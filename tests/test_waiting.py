"""The waiting queue: policy order kept, O(1) removal, and a mass abort that leaves the scheduler
serving at once (no jax: a fake runner's scheduler)."""

import random

from fake_runner import make_request

from jaxserve.core.policies import make_policy
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.waiting import WaitingQueue
from jaxserve.request import RequestStatus


def test_order_and_removal_match_a_sorted_list():
    """Random adds and removes (head, middle, re-added): the queue reads as the sorted list of
    its live requests every time, and its length counts only those."""
    rng = random.Random(0)
    policy = make_policy("priority")
    queue = WaitingQueue(lambda r: policy.key(r, 0.0))
    model: list = []
    requests = [make_request(f"r{i}", 3, arrival=rng.random(), priority=rng.randint(-2, 2))
                for i in range(400)]
    for step in range(3000):
        if model and rng.random() < 0.45:
            victim = model[0] if rng.random() < 0.3 else rng.choice(model)
            queue.remove(victim)
            model.remove(victim)
        else:
            r = rng.choice(requests)
            if r not in queue:
                queue.add(r)
                model.append(r)
        if step % 97 == 0:
            want = sorted(model, key=lambda r: policy.key(r, 0.0))
            assert list(queue) == want and len(queue) == len(model)
            assert queue.head(5) == want[:5]
    assert len(queue._entries) <= 2 * len(model) + 65  # compacted: dead entries stay bounded


def test_arrival_order_without_a_key():
    queue = WaitingQueue()
    a, b, c = (make_request(x, 2) for x in "abc")
    for r in (c, a, b):
        queue.add(r)
    queue.remove(a)
    queue.add(a)  # re-added: at the back, once
    assert list(queue) == [c, b, a] and len(queue) == 3


def test_aborting_100000_waiting_requests_leaves_the_scheduler_serving():
    """Every one of 100,000 queued requests aborted one by one (as the engine applies a
    disconnected client's aborts), then a new request is admitted in the next schedule."""
    s = Scheduler(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                  max_chunk_tokens=16)
    ids = [f"flood-{i}" for i in range(100_000)]
    for rid in ids:
        s.add_request(make_request(rid, 3, arrival=1.0))
    for rid in ids:
        assert s.abort(rid).status == RequestStatus.FINISHED_ABORTED
    assert not s.waiting and not s.requests and len(s.waiting._entries) < 100
    s.add_request(make_request("after", 3, arrival=2.0))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["after"]


def test_the_queue_lets_go_of_the_requests_it_no_longer_holds():
    """Admission takes from the head: the dead are dropped as they outgrow the live, so a
    server that has queued a million requests does not keep them (each holds its prompt and
    its outputs' state); what it holds stays bounded by the queue's length."""
    import gc
    import weakref

    queue = WaitingQueue()
    gone = []
    for i in range(5000):
        queue.add(make_request(f"r{i}", 3))
        if len(queue) > 10:  # the oldest admitted
            head = queue.head(1)[0]
            queue.remove(head)
            gone.append(weakref.ref(head))
            del head
    gc.collect()
    assert len(queue) == 10 and len(queue._entries) <= 2 * 10 + 65
    assert sum(ref() is not None for ref in gone) <= 10 + 65
