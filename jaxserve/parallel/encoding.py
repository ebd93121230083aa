"""The leader's calls as plain data (jaxserve/parallel/distributed.py): a scheduler output
encoded once per step, each request's state sent whole the first step it runs after a break and
then only what it appended; the processes that replay the calls decode it onto stand-ins of the
requests."""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.request import Request, SamplingParams

_RUNNING = SimpleNamespace(finished=False)  # a stand-in's status: the leader says when it ends


@dataclass(eq=False)
class StandIn:
    """A follower's stand-in for a request: what the model runner reads of one (its token
    masks come with the leader's finish call)."""

    request_id: str
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    pages: list[int]
    metrics: SimpleNamespace
    token_mask: "FixedMask | None" = None  # a remote replica's: the leader's row, each step
    status: ClassVar[SimpleNamespace] = _RUNNING

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:end] if end <= n
                else (self.prompt_ids + self.output_ids)[start:end])


class FixedMask:
    """The tokens a request may sample this step, as the leader's grammar and limits made
    them (a row of a token bitmask): what a replica in other processes applies in their place."""

    grammar = None

    def __init__(self, row: np.ndarray):
        self.row = row

    def restrict(self, row: np.ndarray) -> None:
        row &= self.row


class Encoder:
    """The leader's side: a scheduler output as plain data, each request's state sent whole
    the first step it runs after a break and then only what it appended."""

    def __init__(self):
        # request id -> (the request, output ids sent, pages sent, preemptions): the
        # requests of the previous message, as the followers hold them
        self._sent: dict[str, tuple[Request, int, int, int]] = {}

    def encode(self, out: SchedulerOutput) -> dict[str, Any]:
        states, sent = [], {}
        for chunk in out.chunks:
            r = chunk.request
            if r.request_id in sent:
                continue
            known = self._sent.get(r.request_id)
            preemptions = r.metrics.num_preemptions
            if (known is None or known[0] is not r or known[3] != preemptions
                    or len(r.output_ids) < known[1] or len(r.pages) < known[2]):
                states.append((r.request_id, r.params, r.seed, list(r.prompt_ids),
                               list(r.output_ids), list(r.pages), preemptions))
            else:
                states.append((r.request_id, r.output_ids[known[1]:], r.pages[known[2]:]))
            sent[r.request_id] = (r, len(r.output_ids), len(r.pages), preemptions)
        self._sent = sent
        return {"states": states,
                "chunks": [(c.request.request_id, c.start, c.num_tokens, c.num_samples,
                            None if c.draft is None else list(c.draft)) for c in out.chunks],
                "decode_steps": out.decode_steps, "batch_rows": out.batch_rows,
                "speculative": out.speculative}


class Decoder:
    """A follower's side: the leader's messages back into scheduler outputs over stand-ins."""

    def __init__(self):
        self._requests: dict[str, StandIn] = {}

    def decode(self, message: dict[str, Any]) -> SchedulerOutput:
        requests = {}
        for state in message["states"]:
            if len(state) == 3:  # what a request it holds appended
                rid, outputs, pages = state
                request = self._requests[rid]
                request.output_ids += outputs
                request.pages += pages
            else:
                rid, params, seed, prompt, outputs, pages, preemptions = state
                request = StandIn(rid, params, seed, prompt, outputs, pages,
                                  SimpleNamespace(num_preemptions=preemptions))
            requests[rid] = request
        self._requests = requests
        return SchedulerOutput(
            chunks=[ScheduledChunk(requests[rid], start, n, samples, draft)
                    for rid, start, n, samples, draft in message["chunks"]],
            decode_steps=message["decode_steps"], batch_rows=message["batch_rows"],
            speculative=message["speculative"])

    def set_masks(self, rows: dict[str, np.ndarray]) -> None:
        """The leader's token masks for the step it finishes, by request (the others: none)."""
        for rid, request in self._requests.items():
            row = rows.get(rid)
            request.token_mask = None if row is None else FixedMask(row)
