"""The draft model's side of the scheduler: how many tokens a row proposes. The tokens
themselves are the draft model's, made on the device when the verification call is dispatched
(runner/draft_runner.py): the host never sees them before the verification's results."""

from jaxserve.request import Request


class DraftModelProposer:
    def propose(self, request: Request, k: int) -> list[int]:
        """k places for the draft model's tokens (their values, 0 here, are never read)."""
        return [0] * k
