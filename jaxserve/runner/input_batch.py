"""The runner's host arrays, kept across steps (vLLM V1's persistent batch): numpy only.

The runner (model_runner.py) updates it once per dispatch with the step's chunks and gathers each
call's padded arrays from it; nothing here touches the device.
"""

from collections.abc import Callable

import numpy as np

from jaxserve.core.scheduler_output import ScheduledChunk
from jaxserve.model.decode_rows import (
    LOGPROBS,
    LORA,
    PAGES,
    QUERY_LEN,
    SEED,
    SRC,
    START,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)
from jaxserve.request import Request


def device_seed(seed: int) -> int:
    """A request's seed as the device's 32-bit key: a 64-bit seed (as vLLM takes) folded, its
    high word into its low, so seeds 2**32 apart still differ (seeds below 2**32 keep theirs)."""
    seed %= 2**64
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF



class InputBatch:
    """The runner's host arrays, kept across steps (vLLM V1's persistent batch): each request the
    scheduler runs holds a slot, a row of every per-request array. A request's sampling
    parameters and seed are written when it takes its slot; after that a step writes only the
    pages its requests appended. A step's padded arrays are gathered from the slots in one
    indexing op per array (slot 0 is padding: the null page, greedy, no logprobs). The page
    table and the sampling parameters a decode call takes are views of one table whose rows
    are a decode call's (model/decode_rows.py): a decode call gathers them in one op.

    A request keeps its slot while every step schedules it; one that a step leaves out
    (finished, aborted, preempted, or waiting for budget) gives it up, and takes a slot afresh,
    its pages written in full, when it is scheduled again. Its page list only grows while it
    runs; a preemption (counted in its metrics) rebuilds it from scratch, which a slot kept by a
    step the runner never saw would otherwise miss.
    """

    def __init__(self, pages_per_seq: int, vocab_size: int, num_slots: int = 8,
                 lora_slot: Callable[[Request], int] | None = None):
        """`lora_slot`: a request's LoRA slot (runner/lora_slots.py), where LoRA is on."""
        self.vocab_size = vocab_size
        self.lora_slot = lora_slot
        self.slots: dict[Request, int] = {}  # by request object: a reused id is a new request
        self._free: list[int] = []
        self._num_pages: list[int] = [0]  # per slot: the pages written to its row
        self._preemptions: list[int] = [0]  # per slot: its request's count when written
        # [slots, PAGES + pages_per_seq]: page_table, temperature, top_k, top_p, seeds and
        # logprobs (int32 0/1) are views of it (_views)
        self.table = np.zeros((1, PAGES + pages_per_seq), np.int32)
        self.table[0, SRC] = -1
        self._views()
        self.top_k[0], self.top_p[0] = vocab_size, 1.0  # off
        # the sampler controls (model/sampler.py: Controls), off in padding and plain rows
        self.controlled = np.zeros((1,), bool)  # [slots] the request has any control on
        self.presence = np.zeros((1,), np.float32)  # [slots]
        self.frequency = np.zeros((1,), np.float32)  # [slots]
        self.repetition = np.ones((1,), np.float32)  # [slots]
        self.min_p = np.zeros((1,), np.float32)  # [slots]
        # controlled requests written to a slot by the latest update: the runner writes their
        # slot's device state (token counts, prompt tokens, logit_bias)
        self.written: list[tuple[int, Request]] = []
        # the latest update's chunks, their requests and each one's slot, in order
        self._chunks: list[ScheduledChunk] = []
        self.requests: list[Request] = []
        self._row_slots: list[int] = []
        self._grow(num_slots)

    @property
    def num_slots(self) -> int:  # padding slot 0 included
        return len(self._num_pages)

    def update(self, chunks: list[ScheduledChunk]) -> None:
        """Apply a step: free the slots of requests it leaves out, give new ones a slot, write
        the pages appended since the last step."""
        self.written = []
        requests = [chunk.request for chunk in chunks]
        slots, preemptions, num_pages = self.slots, self._preemptions, self._num_pages
        self._chunks = chunks
        if requests == self.requests:  # (identity: a Request has no __eq__)
            # the last step's requests again, in order (most steps): each holds its slot
            for request, slot in zip(requests, self._row_slots, strict=True):
                if preemptions[slot] != request.metrics.num_preemptions:
                    self._write(request, slot)
                elif len(request.pages) != num_pages[slot]:
                    self._append(slot, request.pages)
            return
        for request in slots.keys() - set(requests):
            self._free.append(slots.pop(request))
        for request in requests:
            slot = slots.get(request)
            if slot is None or preemptions[slot] != request.metrics.num_preemptions:
                self._write(request, slot)
            elif len(request.pages) != num_pages[slot]:
                self._append(slot, request.pages)
        self.requests = requests
        self._row_slots = [slots[request] for request in requests]

    def decode_rows(self, chunks: list[ScheduledChunk], b: int) -> tuple[np.ndarray, np.ndarray]:
        """A decode call's rows [b, PAGES + pages_per_seq] (model/decode_rows.py: the per-slot
        columns gathered, START and QUERY_LEN written; HOST_TOKEN 0 and SRC -1, for the runner
        to fill) and each row's slot [b]."""
        slots, starts, query_lens = self.columns(chunks, b)
        rows = self.table[slots]
        rows[:, START], rows[:, QUERY_LEN] = starts, query_lens
        return rows, slots

    def columns(self, chunks: list[ScheduledChunk], b: int) -> np.ndarray:
        """[3, b] int32: each row's slot, start and tokens; padding rows slot 0, 0, 0."""
        columns = np.zeros((3, b), np.int32)
        if chunks:  # a list per column: numpy reads a flat list of ints fastest
            n, slots = len(chunks), self.slots
            columns[0, :n] = (self._row_slots if chunks is self._chunks
                              else [slots[c.request] for c in chunks])
            columns[1, :n] = [c.start for c in chunks]
            columns[2, :n] = [c.num_tokens for c in chunks]
        return columns

    def _write(self, request: Request, slot: int | None) -> None:
        if slot is None:
            if not self._free:
                self._grow(max(1, len(self._num_pages) - 1))  # doubles
            slot = self.slots[request] = self._free.pop()
        p = request.params
        self.temperature[slot] = 0.0 if p.greedy else p.temperature
        self.top_k[slot] = min(p.top_k or self.vocab_size, self.vocab_size)  # past it: off
        self.top_p[slot] = p.top_p
        self.seeds[slot] = device_seed(request.seed)
        self.logprobs[slot] = p.logprobs is not None
        self.lora[slot] = 0 if self.lora_slot is None else self.lora_slot(request)
        self.controlled[slot] = p.controlled
        self.presence[slot], self.frequency[slot] = p.presence_penalty, p.frequency_penalty
        self.repetition[slot], self.min_p[slot] = p.repetition_penalty, p.min_p
        if p.controlled:
            self.written.append((slot, request))
        self._preemptions[slot] = request.metrics.num_preemptions
        self._num_pages[slot] = 0
        self.page_table[slot] = 0
        self._append(slot, request.pages)

    def _append(self, slot: int, pages: list[int]) -> None:
        n = len(pages)
        if n < self._num_pages[slot]:  # rebuilt: a page list only grows
            self.page_table[slot] = 0
            self._num_pages[slot] = 0
        self.page_table[slot, self._num_pages[slot]:n] = pages[self._num_pages[slot]:]
        self._num_pages[slot] = n

    def _grow(self, more: int) -> None:
        """`more` slots past the current ones, at padding values, on the free list."""
        old = len(self._num_pages)
        for name in ("table", "controlled", "presence", "frequency", "repetition", "min_p"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.repeat(array[:1], more, axis=0)]))
        self._views()
        self._num_pages += [0] * more
        self._preemptions += [0] * more
        self._free += range(old + more - 1, old - 1, -1)

    def _views(self) -> None:
        table = self.table
        self.page_table = table[:, PAGES:]  # [slots, pages_per_seq]
        self.temperature = table[:, TEMPERATURE].view(np.float32)  # [slots] 0: greedy
        self.top_k = table[:, TOP_K]  # [slots] vocab_size: off
        self.top_p = table[:, TOP_P].view(np.float32)  # [slots] 1.0: off
        self.seeds = table[:, SEED].view(np.uint32)  # [slots] device_seed(request.seed)
        self.logprobs = table[:, LOGPROBS]  # [slots] 1: the request asked for logprobs
        self.lora = table[:, LORA]  # [slots] the request's LoRA slot; 0: the base model
