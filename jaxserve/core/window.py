"""The batching window: when waiting requests may be admitted.

    waiting:  r1 ----- r2 -- r3 ----------|  window_ms after r1's arrival: admit
                                          ^
Admission opens when max_batch_size requests wait, or when the oldest has waited window_ms and
at least min_batch_size wait (or nothing runs, so a lone request never waits forever).

`AdaptiveWindow` moves window_ms with the traffic: about the time min_batch_size more requests
take to arrive, from an EWMA of inter-arrival gaps, bounded by [window_ms_min, window_ms_max].
A burst shrinks it (a batch forms anyway, waiting only adds latency); sparse traffic grows it.
"""

from dataclasses import dataclass, field


@dataclass
class BatchingWindow:
    window_ms: float = 0.0
    min_batch_size: int = 1
    max_batch_size: int = 1

    def __post_init__(self):
        if self.window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {self.window_ms}")
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError(f"need 1 <= min_batch_size ({self.min_batch_size}) <= "
                             f"max_batch_size ({self.max_batch_size})")

    def observe_arrival(self, arrival_time: float) -> None:
        """A request arrived (a fixed window ignores it)."""

    def is_open(self, num_waiting: int, oldest_arrival: float | None, now: float,
                idle: bool) -> bool:
        if num_waiting == 0 or oldest_arrival is None:
            return False
        if num_waiting >= self.max_batch_size:
            return True
        waited = now >= self.opens_at(oldest_arrival)  # the same float as opens_at: no drift
        return waited and (idle or num_waiting >= self.min_batch_size)

    def opens_at(self, oldest_arrival: float | None) -> float | None:
        """When the window closes on the oldest waiting request (the engine may sleep until then)."""
        return None if oldest_arrival is None else oldest_arrival + self.window_ms / 1000.0


@dataclass
class AdaptiveWindow(BatchingWindow):
    """window_ms = clamp(min_batch_size * EWMA(inter-arrival gap)); starts at window_ms."""

    window_ms_min: float = 0.0
    window_ms_max: float = 50.0
    alpha: float = 0.2  # EWMA weight of the newest gap
    gap_ms: float | None = field(default=None, init=False)  # the EWMA; None before two arrivals
    _last_arrival: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.window_ms_min <= self.window_ms_max:
            raise ValueError(f"need 0 <= window_ms_min ({self.window_ms_min}) <= window_ms_max "
                             f"({self.window_ms_max})")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        self.window_ms = self._clamp(self.window_ms)

    def _clamp(self, ms: float) -> float:
        return min(self.window_ms_max, max(self.window_ms_min, ms))

    def observe_arrival(self, arrival_time: float) -> None:
        last = self._last_arrival
        self._last_arrival = arrival_time if last is None else max(last, arrival_time)
        if last is None:
            return
        gap = max(0.0, arrival_time - last) * 1000.0
        self.gap_ms = gap if self.gap_ms is None else (
            self.alpha * gap + (1.0 - self.alpha) * self.gap_ms)
        self.window_ms = self._clamp(self.min_batch_size * self.gap_ms)
