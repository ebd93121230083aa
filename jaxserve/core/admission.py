"""Admission: which waiting requests may join the running ones, as the batching mode and the
window say (scheduler.py's docstring lists the modes). Continuous batching admits into free
slots whenever the window is open (a preempted request was admitted once and skips it); dynamic
forms a batch in the window and runs it to completion; static admits a batch and nothing else
until it ends. A mixin of Scheduler: the queue, the policy and the window are the scheduler's.
"""

import itertools

from jaxserve.request import Request


class Admission:
    """Scheduler's admission (a mixin: the state is the scheduler's)."""

    def _admissible(self, now: float) -> list[Request]:
        """Waiting requests that may join now, in policy order: the first few, enough for the
        free slots, the requests whose tokens are still in flight, and length bucketing."""
        if self._batch:  # static/dynamic: only the running batch's own (preempted) requests
            mine = [r for r in self.waiting if r.request_id in self._batch]
            return [r for r in self.policy.order(mine, now) if r.num_pending == 0]
        limit = self.max_num_seqs - len(self.running) + 2 * self.max_num_seqs
        ranked = self.policy.order(self.waiting, now, limit, presorted=self.policy.static_order)
        # a request whose sampled tokens are still on the device cannot be recomputed yet
        ready = [r for r in ranked if r.num_pending == 0]
        if not ready:
            return []
        if self.batching == "continuous":
            if self._window_open(now, idle=not self.running):
                return ready
            # the window gates arrivals; a preempted request was admitted once already
            return [r for r in ready if r.metrics.num_preemptions]
        if self.batching == "dynamic" and not self._window_open(now, idle=True):
            return []
        batch = ready[:self.window.max_batch_size]
        self._batch = {r.request_id for r in batch}
        self._batch_rows = len(batch)
        return batch

    def _arrivals(self, limit: int | None = None) -> list[Request]:
        """The waiting requests the window judges: new arrivals (a preempted request was
        admitted once already, and its old arrival would hold the window open for the rest);
        the first `limit` of them (the window needs no more: a long queue is not walked)."""
        arrivals = (r for r in self.waiting if not r.metrics.num_preemptions)
        return list(itertools.islice(arrivals, limit))

    def _window_open(self, now: float, idle: bool) -> bool:
        arrivals = self._arrivals(self.window.max_batch_size)
        n = len(arrivals)
        if n == 0 or n >= self.window.max_batch_size:  # open whatever the oldest
            return True
        return self.window.is_open(n, min(r.arrival_time for r in arrivals), now, idle)

    def next_wakeup(self) -> float | None:
        """When admission may open for requests that wait on the window (None: not waiting)."""
        arrivals = (self._arrivals(self.window.max_batch_size)
                    if self.waiting and not self.running else [])
        if not arrivals:
            return None
        return self.window.opens_at(min(r.arrival_time for r in arrivals))
