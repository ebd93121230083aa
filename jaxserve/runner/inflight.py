"""An iteration the runner dispatched and has not read yet, and the host's reading of its
results.

`ModelRunner.dispatch` returns an `Inflight`: each call's chunks and its packed results on the
device ([rows, W] int32 per sampled token: the token, its logprob's bits and rank, the top-K
ids and logprobs' bits; model/sampler.py). `ModelRunner.collect` copies them to the host (the
runner alone moves arrays between the worlds) and `read_results` turns them into each
request's `Samples` (request.py), what the engine loop hands the output processor: numpy
only here.
"""

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve.core.scheduler_output import ScheduledChunk
from jaxserve.request import Samples, TokenLogprobs
from jaxserve.runner.sampler_controls import Head


@dataclass
class PrefillCall:
    """One dispatched prefill call: its rows and their packed results."""

    chunks: list[ScheduledChunk]
    packed: jax.Array  # [B, W]
    prompt: jax.Array | None = None  # [B, C, W - 1]


@dataclass
class Inflight:
    """One dispatched iteration whose results have not been read yet."""

    decode_chunks: list[ScheduledChunk] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)  # decode_chunks' request ids
    decode_packed: jax.Array | None = None  # [steps, B, W]
    decode_logprobs: bool = False  # some decode row asked for logprobs
    prefills: list[PrefillCall] = field(default_factory=list)
    heads: list[Head] = field(default_factory=list)  # for finish, in order
    verify_chunks: list[ScheduledChunk] = field(default_factory=list)
    verify_packed: jax.Array | None = None  # [B, K + 1, W]


def read_results(flight: Inflight, decode: np.ndarray | None, verify: np.ndarray | None,
                 prefills: list[tuple[np.ndarray, np.ndarray | None]]) -> dict[str, Samples]:
    """By request id, the tokens each request of `flight` sampled (and their logprobs, and its
    prompt's, where it asked), from its calls' results as the runner copied them to the host:
    `decode` [steps, B, W] ([B, W]: a head's), `verify` [B, K + 1, W], and per prefill call
    (packed [B, W], prompt [B, C, W - 1] or None)."""
    results: dict[str, Samples] = {}
    if decode is not None:
        packed = decode[None] if decode.ndim == 2 else decode
        chunks = flight.decode_chunks
        # every decode row samples every step: one conversion for all rows' tokens
        tokens = packed[:, :len(chunks), 0].T.tolist()
        if flight.decode_logprobs:
            for i, (chunk, row) in enumerate(zip(chunks, tokens, strict=True)):
                logprobs = None
                if chunk.request.params.logprobs is not None:
                    logprobs = [unpack_logprobs(step[1:]) for step in packed[:, i]]
                results[chunk.request.request_id] = Samples(row, logprobs)
        else:  # (most steps: no loop of ours over the rows)
            results.update(zip(flight.decode_ids, map(Samples, tokens), strict=True))
    if verify is not None:
        for chunk, rows in zip(flight.verify_chunks, verify, strict=False):
            results[chunk.request.request_id] = _samples(
                chunk, rows[:int(np.argmax(np.append(rows[:, 0], -1) < 0))])
    for call, (packed, prompt) in zip(flight.prefills, prefills, strict=True):
        for i, chunk in enumerate(call.chunks):
            samples = _samples(chunk, packed[i:i + 1])
            if prompt is not None and chunk.request.params.prompt_logprobs is not None:
                n = min(chunk.num_tokens, len(chunk.request.prompt_ids) - 1 - chunk.start)
                samples.prompt_start = chunk.start
                samples.prompt_logprobs = [unpack_logprobs(prompt[i, j])
                                           for j in range(max(n, 0))]
            results[chunk.request.request_id] = samples
    return results


def unpack_logprobs(packed: np.ndarray) -> TokenLogprobs:
    """[2 + 2K] int32 (logprob bits, rank, top ids, top bits) -> TokenLogprobs."""
    k = (packed.shape[-1] - 2) // 2
    return TokenLogprobs(float(packed[0:1].view(np.float32)[0]), int(packed[1]),
                         packed[2:2 + k], packed[2 + k:].view(np.float32))


def _samples(chunk: ScheduledChunk, packed: np.ndarray) -> Samples:  # packed [steps, W]
    rows = packed[:chunk.num_samples]
    logprobs = None
    if chunk.request.params.logprobs is not None:
        logprobs = [unpack_logprobs(row[1:]) for row in rows]
    return Samples(tokens=rows[:, 0].tolist(), logprobs=logprobs)
