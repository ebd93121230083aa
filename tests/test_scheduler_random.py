"""Random add / abort / step sequences against the scheduler (hypothesis, fake runner, no jax):
no page leaks or double frees, limits always held, every output as if run alone. With prefix
caching, prompts share prefixes: no page in use is freed or evicted, reference counts match
the holders, and a row always finds its own tokens in its context's pages (the fake runner's
KV check), cached or not."""

from fake_runner import (
    Driver,
    FakeClock,
    expected_output,
    make_request,
    small_scheduler,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.core.policies import POLICIES
from jaxserve.core.scheduler import BATCHING_MODES

# -- random workloads -----------------------------------------------------------------------------

SHARED = ([7 + i % 40 for i in range(20)], [90 - i for i in range(20)])  # prompts' prefixes


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / abort / step / clock sequences on small pools."""

    @initialize(batching=st.sampled_from(BATCHING_MODES), policy=st.sampled_from(sorted(POLICIES)),
                decode_steps=st.sampled_from([1, 4]), overlap=st.booleans(),
                num_pages=st.integers(4, 16), page_size=st.sampled_from([2, 4]),
                max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 16),
                max_chunk_tokens=st.integers(2, 12), window_ms=st.sampled_from([0.0, 3.0]),
                min_batch_size=st.integers(1, 2), prefix_caching=st.booleans())
    def setup(self, batching, policy, decode_steps, overlap, num_pages, page_size, max_num_seqs,
              extra_budget, max_chunk_tokens, window_ms, min_batch_size, prefix_caching):
        self.clock = FakeClock()
        self.scheduler = small_scheduler(
            self.clock, batching=batching, policy=policy, decode_steps=decode_steps,
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2, max_num_seqs + extra_budget),
            max_chunk_tokens=max_chunk_tokens, enable_prefix_caching=prefix_caching,
            window_ms=window_ms, min_batch_size=min(min_batch_size, max_num_seqs))
        self.driver = Driver(self.scheduler, overlap=overlap)
        self.capacity = (num_pages - 1) * page_size  # a request alone always fits
        self.requests = {}
        self.aborted = set()

    @rule(burst=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16), st.integers(0, 2),
                                   st.one_of(st.none(), st.integers(3, 99)),
                                   st.sampled_from(SHARED), st.integers(0, 20)),
                         min_size=1, max_size=3))
    def add(self, burst):
        for suffix_len, max_tokens, priority, eos, shared, shared_len in burst:
            # a shared prefix (cut anywhere: on a page boundary or not), then the request's own
            prompt = shared[:shared_len] + [(len(self.requests) * 13 + 5 * i) % 50 + 3
                                            for i in range(suffix_len)]
            prompt = prompt[:self.capacity - 1]
            max_tokens = min(max_tokens, self.capacity - len(prompt))
            rid = f"r{len(self.requests)}"
            request = make_request(rid, prompt, max_tokens, arrival=self.clock.now,
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
