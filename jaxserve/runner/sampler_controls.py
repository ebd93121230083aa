"""The runner's half of the sampler controls: the per-slot device state and each controlled
call's head.

A call holding a row with controls (penalties, logit_bias, min_p, a token mask) runs the model
without its head at dispatch and leaves a `Head`; the runner's `finish` hands each to
`SamplerControls.sample`, which makes the rows' token bitmasks on the host (structured/token_masks.py,
structured/grammar.py) and dispatches the head (model/step.py), keeping the device state
(model/sampler.py: SamplerState: per slot, output-token counts, prompt tokens, logit_bias)
current. A controlled request's slot state is written when it takes the slot (`write`).
"""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler_output import ScheduledChunk
from jaxserve.model.sampler import Controls, SamplerState, SamplingMetadata
from jaxserve.request import MAX_LOGIT_BIAS
from jaxserve.runner.input_batch import InputBatch
from jaxserve.structured.token_masks import chunk_bitmask


@dataclass
class Head:
    """A controlled call's sampling, dispatched by `finish` once the host has its rows' masks."""

    chunks: list[ScheduledChunk]
    last: jax.Array  # [M, hidden] each row's last hidden state (rows past its own: padding)
    sm: SamplingMetadata
    slots: np.ndarray  # [rows] the rows' slots (0: padding)
    carry: int  # which carry its tokens go to: 0 (a decode call) or 1
    carry_index: np.ndarray  # [rows]
    call: Any  # the runner's PrefillCall whose packed it gives (None: the decode call's)


class SamplerControls:
    """The device state of the controlled requests' slots, and the sampling of their calls."""

    def __init__(self, vocab_size: int, num_slots: int, placement=None, put=jax.device_put):
        """`placement`: the device or sharding the state lives on (None: the first device);
        `put`: how arrays get there (the runner's: compile only, their shapes)."""
        self.vocab_size = vocab_size
        self.placement = placement or jax.devices()[0]
        self._put = put
        self.state = self._zeros(num_slots)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.state))

    def _zeros(self, slots: int) -> SamplerState:
        vocab = self.vocab_size
        state = SamplerState(counts=jnp.zeros((slots, vocab), jnp.int32),
                             prompt=jnp.zeros((slots, vocab), bool),
                             bias_ids=jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.int32),
                             bias_values=jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.float32))
        return self._put(state, self.placement)

    def write(self, fns, batch: InputBatch) -> None:
        """Write the state of the controlled requests the batch's latest update gave a slot:
        the counts of the tokens they generated so far, their prompt's tokens, their bias."""
        vocab = self.vocab_size
        if batch.num_slots > self.state.counts.shape[0]:  # the batch grew its slots
            old, self.state = self.state, self._zeros(batch.num_slots)
            self.state = jax.tree.map(lambda new, o: new.at[:o.shape[0]].set(o), self.state, old)
        for slot, request in batch.written:
            counts = np.bincount(request.output_ids, minlength=vocab).astype(np.int32)
            prompt = np.zeros((vocab,), bool)
            prompt[request.prompt_ids] = True
            ids = np.zeros((MAX_LOGIT_BIAS,), np.int32)
            values = np.zeros((MAX_LOGIT_BIAS,), np.float32)
            bias = request.params.logit_bias or {}
            ids[:len(bias)] = list(bias)
            values[:len(bias)] = list(bias.values())
            self.state = fns.write_slot(self.state, np.int32(slot), counts, prompt, ids, values)

    def warm(self, fns) -> None:
        """Compile the write of a slot's state (slot 0, the padding one, with nothing)."""
        vocab = self.vocab_size
        self.state = fns.write_slot(self.state, np.int32(0), np.zeros((vocab,), np.int32),
                                    np.zeros((vocab,), bool), np.zeros((MAX_LOGIT_BIAS,), np.int32),
                                    np.zeros((MAX_LOGIT_BIAS,), np.float32))

    def sample(self, fns, weights, head: Head, carry: jax.Array, batch: InputBatch,
               bitmask: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """Dispatch a head with its rows' token bitmask: (packed [rows, W], the carry with
        its rows' tokens)."""
        packed, carry, self.state = fns.head(weights, head.last, head.sm,
                                             self._controls(head, batch, bitmask), self.state,
                                             carry, head.carry_index, rows=len(head.slots))
        if isinstance(packed, jax.Array):  # (compile only: a shape)
            packed.copy_to_host_async()
        return packed, carry

    def bitmask(self, head: Head) -> np.ndarray:
        """[rows, vocab / 32] int32: the tokens each row of the head may sample (its grammar's
        and its own limits'; -1 words: every token) from its requests' current masks."""
        return chunk_bitmask(head.chunks, self.vocab_size, len(head.slots))

    def _controls(self, head: Head, batch: InputBatch, bitmask: np.ndarray) -> Controls:
        slots = head.slots
        counted = np.zeros((len(slots),), bool)
        for i, chunk in enumerate(head.chunks):
            counted[i] = chunk.num_samples > 0 and chunk.request.params.controlled
        return Controls(slots=slots, presence=batch.presence[slots],
                        frequency=batch.frequency[slots], repetition=batch.repetition[slots],
                        min_p=batch.min_p[slots], counted=counted,
                        owns_state=batch.controlled[slots], bitmask=bitmask)
