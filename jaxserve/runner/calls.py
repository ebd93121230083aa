"""Each kind of jitted call of an iteration: its padded host arrays, gathered from the input
batch's slots, and its dispatch (decode, verification, prefill, ragged), with the attention and
sampling metadata they share. `ModelRunner._dispatch` decides which calls an iteration makes;
this mixin makes each one. The attributes it reads are the runner's (model_runner.py: the
input batch, the jitted steps, the weights, the KV pools, the carries).

Row i of a call samples its token into a carry (carry 0: the decode call's rows; carry 1: the
other calls' rows, one after another), where the next iteration's rows find the tokens still on
the device (`_carry_rows`).
"""

import jax
import numpy as np

from jaxserve.core.buckets import bucket
from jaxserve.core.scheduler_output import ScheduledChunk
from jaxserve.model.decode_rows import HOST_TOKEN, LOGPROBS, SRC
from jaxserve.model.kv_cache import AttentionMetadata, RaggedMetadata
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.runner.inflight import Inflight, PrefillCall
from jaxserve.runner.sampler_controls import Head


class StepCalls:
    """ModelRunner's calls, one method a kind (a mixin: the state is the runner's)."""

    @property
    def _carry_rows(self) -> dict[str, int]:
        """By request id, the carry row (into the two carries, one after the other) that holds
        the token the last iteration sampled for it (built when a step first asks: a step
        that repeats the last decode rows never does)."""
        if self._carry_map is None:
            ids, order = self._carried
            self._carry_map = dict(zip(ids, range(len(ids)), strict=True))
            self._carry_map |= {c.request.request_id: self.carry_size + i
                                for i, c in enumerate(order) if c.num_samples}
        return self._carry_map

    @staticmethod
    def _on_device(chunk: ScheduledChunk) -> bool:
        """Whether a row's input token was sampled by the previous iteration and is still on
        the device (only a decode row's can be: a prompt chunk's tokens are all known)."""
        request = chunk.request
        return chunk.start >= len(request.prompt_ids) + len(request.output_ids)

    def _dispatch_decode(self, chunks: list[ScheduledChunk], again: bool, num_rows: int,
                         steps: int, flight: Inflight):
        """`again`: the chunks' requests are the last decode call's, in order. One array
        crosses to the device (its rows: model/decode_rows.py)."""
        b, n = bucket(num_rows, self.row_buckets, "decode rows"), len(chunks)
        rows, slots = self.input_batch.decode_rows(chunks, b)  # [b, PAGES + pages_per_seq]
        host, src = rows[:, HOST_TOKEN], rows[:, SRC]  # (views: written into rows)
        if again:  # each row's input token is the one the last call sampled for it, on the
            # device at its own row of the carry (the same token as on the host, if it was
            # read since)
            src[:n] = np.arange(n, dtype=np.int32)
        else:  # the carry row of each input token still on the device (-1: read on the host)
            carry_rows = self._carry_rows  # (_on_device inline: per row per step)
            src[:n] = [
                carry_rows[c.request.request_id]
                if c.start >= len(c.request.prompt_ids) + len(c.request.output_ids) else -1
                for c in chunks]
            for i in np.flatnonzero(src[:n] < 0).tolist():
                chunk = chunks[i]
                host[i] = chunk.request.token_ids(chunk.start, chunk.start + 1)[0]
        flight.decode_logprobs = bool(rows[:, LOGPROBS].any())
        if self.input_batch.controlled[slots].any():  # one step (the scheduler's rule);
            # sampled at finish
            md, sm, _ = self._metadata(chunks, b, 1)
            last, self.kv = self.fns.decode_hidden(self.weights, self.kv, host.copy(),
                                                   src.copy(), *self._carries, md)
            flight.heads.append(Head(chunks, last, sm, slots,
                                     0, np.arange(b, dtype=np.int32), None))
            return None, self._zeros
        packed, carry, self.kv = self.fns.decode(self.weights, self.kv, rows, *self._carries,
                                                 steps=steps)
        return packed, carry

    def _dispatch_verify(self, chunks: list[ScheduledChunk]) -> jax.Array:
        """Speculative decoding's verification call: each row its newest token and its draft
        (the host holds both: the iteration before was read), K + 1 tokens a row."""
        b = bucket(len(chunks), self.row_buckets, "verification rows")
        k = bucket(max(len(c.draft) for c in chunks) + 1, self.verify_widths, "drafts") - 1
        first = np.zeros((b,), np.int32)
        drafts = np.zeros((b, k), np.int32)
        num_drafts = np.zeros((b,), np.int32)
        for i, chunk in enumerate(chunks):
            n = len(chunk.draft)
            first[i] = chunk.request.token_ids(chunk.start, chunk.start + 1)[0]
            drafts[i, :n] = chunk.draft
            num_drafts[i] = n
        md, _, slots = self._metadata(chunks, b, k + 1)
        sm = self._sampling(slots, md.seq_lens - md.query_lens + 1)  # the first sampled token's
        probs = None
        if self.draft is not None:  # the drafts are the draft model's, on the device
            drafts, probs = self.draft.propose(chunks, md.page_table, sm)
        packed, self.kv = self.fns.verify(self.weights, self.kv, first, drafts, num_drafts, md,
                                          sm, probs)
        return packed

    def _dispatch_prefill(self, chunks: list[ScheduledChunk], carry_rows: list[int],
                          carry: jax.Array, flight: Inflight) -> tuple[PrefillCall, jax.Array]:
        """One prefill call; row i's sampled token goes to carry[carry_rows[i]]."""
        b = bucket(len(chunks), self.prefill_row_buckets, "prefill rows")
        c = bucket(max(ch.num_tokens for ch in chunks), self.chunk_buckets, "chunk length")
        tokens = np.zeros((b, c), np.int32)
        targets = np.zeros((b, c), np.int32)
        carry_index = np.full((b,), self.carry_size, np.int32)  # out of range: dropped
        carry_index[:len(chunks)] = carry_rows
        with_prompt = False
        for i, chunk in enumerate(chunks):
            start, n = chunk.start, chunk.num_tokens
            tokens[i, :n] = chunk.request.token_ids(start, start + n)
            if chunk.request.params.prompt_logprobs is not None:
                with_prompt = True
                nxt = chunk.request.token_ids(start + 1, start + n + 1)
                targets[i, :len(nxt)] = nxt
        md, sm, slots = self._metadata(chunks, b, c)
        controlled = self.input_batch.controlled[slots].any()
        if with_prompt:  # a controlled row's token is sampled again at finish
            packed, prompt, carry, last, self.kv = self.fns.prefill_with_prompt_logprobs(
                self.weights, self.kv, tokens, md, sm, carry, carry_index, targets)
            call = PrefillCall(chunks, packed, prompt)
        elif controlled:
            last, self.kv = self.fns.prefill_hidden(self.weights, self.kv, tokens, md)
            call = PrefillCall(chunks, None)
        else:
            packed, carry, self.kv = self.fns.prefill(self.weights, self.kv, tokens, md, sm,
                                                      carry, carry_index)
            return PrefillCall(chunks, packed), carry
        if controlled:
            flight.heads.append(Head(chunks, last, sm, slots, 1, carry_index, call))
        return call, carry

    def _dispatch_ragged(self, chunks: list[ScheduledChunk], carry_rows: list[int], t: int,
                         carry: jax.Array, flight: Inflight | None = None,
                         rows: int = 0) -> tuple[PrefillCall, jax.Array]:
        """One ragged call of `t` tokens (a token bucket): the chunks one after another, prompt
        chunks and decode rows alike; row i's sampled token goes to carry[carry_rows[i]]. Its
        head samples `rows` rows (0: the row bucket of the chunks)."""
        m = self.carry_size  # the metadata's rows, whatever the call holds
        b = rows or bucket(max(len(chunks), 1), self.prefill_row_buckets, "ragged rows")
        slots, starts, lens = self.input_batch.columns(chunks, m)  # [m] each
        seq_lens = starts + lens
        query_starts = np.zeros((m + 1,), np.int32)  # row i's tokens: [q[i], q[i + 1])
        np.cumsum(lens, out=query_starts[1:])
        n = int(query_starts[-1])
        token_rows = np.full((t,), m, np.int32)  # padding: no row
        token_rows[:n] = np.repeat(np.arange(m, dtype=np.int32), lens)
        positions = np.zeros((1, t), np.int32)
        positions[0, :n] = (starts[token_rows[:n]] + np.arange(n, dtype=np.int32)
                            - query_starts[token_rows[:n]])
        page_table = self.input_batch.page_table[slots]  # [m, pages_per_seq]
        carry_index = np.full((b,), self.carry_size, np.int32)  # out of range: dropped
        carry_index[:len(chunks)] = carry_rows
        tokens = np.zeros((1, t), np.int32)
        src = np.full((t,), -1, np.int32)
        for chunk, at in zip(chunks, query_starts.tolist(), strict=False):
            if self._on_device(chunk):  # a decode row
                src[at] = self._carry_rows[chunk.request.request_id]
            else:
                tokens[0, at:at + chunk.num_tokens] = chunk.request.token_ids(chunk.start,
                                                           chunk.start + chunk.num_tokens)
        md = RaggedMetadata(positions=positions, token_rows=token_rows,
                            query_starts=query_starts, seq_lens=seq_lens, page_table=page_table,
                            lora_slots=None if self.loras is None
                            else self.input_batch.lora[slots])
        last, self.kv = self.fns.ragged(self.weights, self.kv, tokens, src, *self._carries, md)
        sm = self._sampling(slots[:b], seq_lens[:b])
        if flight is not None and self.input_batch.controlled[slots].any():  # sampled at finish
            call = PrefillCall(chunks, None)
            flight.heads.append(Head(chunks, last, sm, slots[:b], 1, carry_index, call))
            return call, carry
        packed, carry = self.fns.ragged_head(self.weights, last, sm, carry, carry_index, rows=b)
        return PrefillCall(chunks, packed), carry

    def _metadata(self, chunks: list[ScheduledChunk], b: int, c: int):
        """A call's attention and sampling arrays, b rows of c tokens (padding rows empty),
        and each row's slot in the input batch."""
        slots, starts, query_lens = self.input_batch.columns(chunks, b)  # [b] each
        positions = starts[:, None] + np.arange(c, dtype=np.int32)
        positions[len(chunks):] = 0
        seq_lens = starts + query_lens
        md = AttentionMetadata(positions=positions, query_lens=query_lens, seq_lens=seq_lens,
                               page_table=self.input_batch.page_table[slots],
                               lora_slots=None if self.loras is None
                               else self.input_batch.lora[slots])
        return md, self._sampling(slots, seq_lens), slots

    def _sampling(self, slots: np.ndarray, positions: np.ndarray) -> SamplingMetadata:
        """The sampling arrays of the rows in `slots` [B], sampling at `positions` [B]."""
        batch = self.input_batch
        return SamplingMetadata(temperature=batch.temperature[slots], top_k=batch.top_k[slots],
                                top_p=batch.top_p[slots], seeds=batch.seeds[slots],
                                positions=positions, logprobs=batch.logprobs[slots] != 0)
