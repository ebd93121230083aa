"""Queue orders. A policy ranks requests (lower key first) and so picks the preemption victim.

New policies subclass `Policy`; the scheduler loop only calls `key` and `victim`.
"""

from abc import ABC, abstractmethod
from typing import Any

from jaxserve.request import Request


class Policy(ABC):
    name: str

    @abstractmethod
    def key(self, request: Request, now: float) -> Any:
        """Sort key: requests with lower keys are served first."""

    def order(self, requests: list[Request], now: float) -> list[Request]:
        return sorted(requests, key=lambda r: self.key(r, now))

    def victim(self, running: list[Request], now: float) -> Request:
        """The running request to preempt when pages run out: the one served last."""
        return max(running, key=lambda r: self.key(r, now))


class FCFS(Policy):
    name = "fcfs"

    def key(self, request: Request, now: float) -> Any:
        return (request.arrival_time, request.request_id)


class PriorityPolicy(Policy):
    """Lower `priority` value first; arrival breaks ties."""

    name = "priority"

    def key(self, request: Request, now: float) -> Any:
        return (request.priority, request.arrival_time, request.request_id)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, PriorityPolicy)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
