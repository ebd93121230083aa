"""Speculative decoding's host half: the proposers the scheduler asks (the verification is the
sampler's: model/sampler.py `verify`; a draft model's proposals are made on the device,
runner/draft_runner.py). Host only: no jax here.

Imports jaxserve.request only. Must never import the runner or the model: the scheduler asks it
for proposals on the host.
"""

from typing import Protocol

from jaxserve.request import Request


class Proposer(Protocol):
    def propose(self, request: Request, k: int) -> list[int]:
        """At most k tokens to verify after the request's newest one (its tokens are all on
        the host); [] for none."""
        ...
