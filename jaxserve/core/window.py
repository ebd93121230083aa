"""The batching window: when waiting requests may be admitted.

    waiting:  r1 ----- r2 -- r3 ----------|  window_ms after r1's arrival: admit
                                          ^
Admission opens when max_batch_size requests wait, or when the oldest has waited window_ms and
at least min_batch_size wait (or nothing runs, so a lone request never waits forever).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
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
