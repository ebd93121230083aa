"""The runner's persistent batch (input_batch.InputBatch): the arrays the runner hands the device equal
a from-scratch build from each step's chunks, step after step, across admissions, page appends,
preemption and resume (pages rebuilt), finishes, aborts and slot reuse."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import HF_FIXTURES

from jaxserve import LLM, SamplingParams
from jaxserve.core.scheduler_output import ScheduledChunk
from jaxserve.model.decode_rows import PAGES as PAGES_COLUMN
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import pack_decode_rows, unpack_decode_rows
from jaxserve.request import Request
from jaxserve.runner.input_batch import InputBatch, device_seed

MODEL = HF_FIXTURES / "llama"
BASE = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_sizes=(16, 64),
            num_pages=48)


# -- the from-scratch build: every row written from its request, every step -----------------------

def scratch_sampling(chunks, b, positions, vocab):
    temperature, top_k = np.zeros((b,), np.float32), np.full((b,), vocab, np.int32)
    top_p, seeds, logprobs = np.ones((b,), np.float32), np.zeros((b,), np.uint32), np.zeros(b, bool)
    for i, chunk in enumerate(chunks):
        p = chunk.request.params
        temperature[i] = 0.0 if p.greedy else p.temperature
        top_k[i] = min(p.top_k or vocab, vocab)
        top_p[i] = p.top_p
        seeds[i] = device_seed(chunk.request.seed)
        logprobs[i] = p.logprobs is not None
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds,
                positions=positions, logprobs=logprobs)


def scratch_page_table(chunks, rows, pages_per_seq):
    table = np.zeros((rows, pages_per_seq), np.int32)
    for i, chunk in enumerate(chunks):
        table[i, :len(chunk.request.pages)] = chunk.request.pages
    return table


def scratch_metadata(chunks, b, c, pages_per_seq):
    positions = np.zeros((b, c), np.int32)
    query_lens = np.zeros((b,), np.int32)
    for i, chunk in enumerate(chunks):
        positions[i] = chunk.start + np.arange(c)
        query_lens[i] = chunk.num_tokens
    return dict(positions=positions, query_lens=query_lens, seq_lens=positions[:, 0] + query_lens,
                page_table=scratch_page_table(chunks, b, pages_per_seq))


def scratch_ragged(chunks, t, m, pages_per_seq):
    positions, token_rows = np.zeros((1, t), np.int32), np.full((t,), m, np.int32)
    starts, seq_lens = np.zeros((m + 1,), np.int32), np.zeros((m,), np.int32)
    at = 0
    for i, chunk in enumerate(chunks):
        n = chunk.num_tokens
        positions[0, at:at + n] = chunk.start + np.arange(n)
        token_rows[at:at + n] = i
        seq_lens[i] = chunk.start + n
        at += n
        starts[i + 1:] = at
    return dict(positions=positions, token_rows=token_rows, query_starts=starts,
                seq_lens=seq_lens, page_table=scratch_page_table(chunks, m, pages_per_seq))


def assert_fields(got, want: dict, what: str):
    for name, value in want.items():
        array = np.asarray(getattr(got, name))
        assert array.dtype == value.dtype, (what, name, array.dtype, value.dtype)
        np.testing.assert_array_equal(array, value, err_msg=f"{what}: {name}")


def test_a_decode_calls_one_array_unpacks_to_its_arrays():
    """pack_decode_rows (the host) and unpack_decode_rows (the device, model/step.py) agree on
    every column of model/decode_rows.py: float and uint32 bits (seeds past 2**31), the LoRA
    slots, the page table."""
    rng = np.random.default_rng(0)
    b, pages = 5, 7
    starts = rng.integers(0, 4000, b).astype(np.int32)
    query_lens = np.array([1, 1, 1, 1, 0], np.int32)
    md = AttentionMetadata(positions=starts[:, None], query_lens=query_lens,
                           seq_lens=starts + query_lens,
                           page_table=rng.integers(0, 99, (b, pages)).astype(np.int32),
                           lora_slots=np.array([0, 2, 1, 16, 0], np.int32))
    sm = SamplingMetadata(temperature=np.array([0.0, 0.7, 1.3, 1e-6, 0.0], np.float32),
                          top_k=np.array([32, 5, 1, 32, 32], np.int32),
                          top_p=np.array([1.0, 0.9, 0.25, 1.0, 1.0], np.float32),
                          seeds=np.array([0, 2**31, 2**32 - 1, 12345, 0], np.uint32),
                          positions=starts + query_lens,
                          logprobs=np.array([False, True, False, True, False]))
    host = rng.integers(0, 32, b).astype(np.int32)
    src = np.array([-1, 3, -1, 0, -1], np.int32)
    rows = pack_decode_rows(host, src, md, sm)
    assert rows.shape == (b, PAGES_COLUMN + pages) and rows.dtype == np.int32
    got_host, got_src, got_md, got_sm = jax.jit(unpack_decode_rows)(rows)
    np.testing.assert_array_equal(got_host, host)
    np.testing.assert_array_equal(got_src, src)
    assert_fields(got_md, {f.name: np.asarray(getattr(md, f.name))
                           for f in dataclasses.fields(md)}, "metadata")
    assert_fields(got_sm, {f.name: np.asarray(getattr(sm, f.name))
                           for f in dataclasses.fields(sm)}, "sampling")


# -- the InputBatch alone, on hand-made steps ------------------------------------------------------

PAGES, VOCAB = 6, 32


def _request(rid, pages, **params):
    request = Request(rid, [3] * 40, SamplingParams(max_tokens=8, **params), 0.0,
                      seed=params.get("seed") or 0, max_len=48, eos_token_ids=frozenset())
    request.pages = list(pages)
    return request


def _step(batch, requests, b=8):
    """Apply a step of one decode row per request; check its gathered arrays."""
    chunks = [ScheduledChunk(r, 8 * len(r.pages) - 1, 1, 1) for r in requests]
    batch.update(chunks)
    slots, starts, lens = batch.columns(chunks, b)
    np.testing.assert_array_equal(starts[:len(chunks)], [c.start for c in chunks])
    np.testing.assert_array_equal(lens, [1] * len(chunks) + [0] * (b - len(chunks)))
    np.testing.assert_array_equal(batch.page_table[slots], scratch_page_table(chunks, b, PAGES))
    want = scratch_sampling(chunks, b, None, VOCAB)
    for name in ("temperature", "top_k", "top_p", "seeds", "logprobs"):
        np.testing.assert_array_equal(getattr(batch, name)[slots], want[name], err_msg=name)
    assert len(batch.slots) == len(requests)
    assert sorted(batch.slots.values()) == sorted(set(batch.slots.values()))  # one slot each
    return {r.request_id: batch.slots[r] for r in requests}


def test_slots_follow_admissions_appends_finishes_and_preemptions():
    batch = InputBatch(PAGES, VOCAB, num_slots=2)
    a = _request("a", [1, 2], temperature=0.7, top_k=100, top_p=0.9, seed=2**40 + 5)
    b = _request("b", [3, 4, 5], logprobs=2, seed=-3)
    slots = _step(batch, [a, b])
    a.pages.append(6)  # appended pages only
    b.pages.append(7)
    assert _step(batch, [b, a]) == slots  # slots kept, whatever the row order
    c = _request("c", [8], temperature=1.2, top_k=4)  # b finished: c takes its slot
    assert _step(batch, [a, c]) == {"a": slots["a"], "c": slots["b"]}
    # a preempted in a step the runner never saw, resumed on a rebuilt page list that starts
    # on the same page and is no shorter: only its preemption count tells
    a.pages = [1, 9, 10]
    a.metrics.num_preemptions += 1
    _step(batch, [a, c])
    a.pages = [11]  # rebuilt again, shorter: the rest of its row is cleared
    a.metrics.num_preemptions += 1
    _step(batch, [a, c])
    # a new request object under a used id (the calibration's rows) is a new request
    a2 = _request("a", [12, 13], temperature=0.5, seed=9)
    d, e = _request("d", [14], top_p=0.5), _request("e", [15, 16, 17, 18, 19, 20], logprobs=0)
    slots = _step(batch, [a2, c, d, e])  # past the slots it started with: more are added
    assert batch.page_table.shape[0] > 3
    _step(batch, [e])
    _step(batch, [])
    assert not batch.slots


# -- the real runner: every call's arrays, over workloads that preempt ---------------------------

class Checker:
    """Wraps a runner so that every array bundle it hands the jitted steps is checked against
    the from-scratch build of the call's chunks, and records the input token each decode row
    was fed (from the host or a carry row) to check against its request's tokens."""

    def __init__(self, runner):
        self.runner, self.calls, self.slots_seen = runner, {}, set()
        self.ragged = None  # the ragged call being dispatched: (chunks, t, rows)
        self.decoding = []  # the decode call being dispatched: its chunks
        self.fed = []  # (request, position, the token a decode row was fed there)
        metadata, dispatch_ragged = runner._metadata, runner._dispatch_ragged
        dispatch_decode = runner._dispatch_decode
        # a decode call's rows unpacked as the device does, compiled here for every row
        # bucket, as the runner dispatches (a compilation while dispatching counts against it)
        self._unpack = jax.jit(unpack_decode_rows)
        with jax.default_device(runner.local_device):
            for b in runner.row_buckets:
                self._unpack(np.zeros((b, runner.input_batch.table.shape[1]), np.int32))

        def recorded_decode(chunks, *args):
            self.decoding = chunks
            return dispatch_decode(chunks, *args)

        def checked_metadata(chunks, b, c):
            md, sm, slots = metadata(chunks, b, c)
            self._check_md(chunks, b, c, md, sm)
            assert slots.tolist() == [self.runner.input_batch.slots[ch.request] for ch in chunks
                                      ] + [0] * (b - len(chunks)), "each row's slot"
            return md, sm, slots

        def checked_ragged(chunks, carry_rows, t, carry, rows=0):
            self.ragged = (chunks, t, rows)
            return dispatch_ragged(chunks, carry_rows, t, carry, rows)

        runner._metadata, runner._dispatch_ragged = checked_metadata, checked_ragged
        runner._dispatch_decode = recorded_decode
        fns = runner.fns
        runner.fns = dataclasses.replace(fns, ragged=self._wrap(fns.ragged, self._check_ragged),
                                         ragged_head=self._wrap(fns.ragged_head,
                                                                self._check_head),
                                         decode=self._wrap(fns.decode, self._check_decode),
                                         decode_hidden=self._wrap(fns.decode_hidden,
                                                                  self._record_fed))

    @staticmethod
    def _wrap(fn, check):
        def call(*args, **kwargs):
            check(*args, **kwargs)
            return fn(*args, **kwargs)
        return call

    def _count(self, kind, chunks):
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.slots_seen |= {self.runner.input_batch.slots[c.request] for c in chunks}

    def _check_md(self, chunks, b, c, md, sm):
        self._count("decode" if c == 1 else "prefill", chunks)
        want = scratch_metadata(chunks, b, c, self.runner.pages_per_seq)
        assert_fields(md, want, f"metadata of {len(chunks)} rows, {b} x {c}")
        assert_fields(sm, scratch_sampling(chunks, b, want["seq_lens"], self.vocab), "sampling")

    def _check_ragged(self, weights, kv, tokens, src, carry0, carry1, md):
        chunks, t, _ = self.ragged
        self._count("ragged", chunks)
        self.want = scratch_ragged(chunks, t, self.runner.carry_size, self.runner.pages_per_seq)
        assert_fields(md, self.want, f"ragged metadata of {len(chunks)} rows, {t} tokens")

    def _check_head(self, weights, last, sm, carry, carry_index, rows):
        chunks = self.ragged[0]
        assert_fields(sm, scratch_sampling(chunks, rows, self.want["seq_lens"][:rows],
                                           self.vocab), "ragged sampling")

    def _check_decode(self, weights, kv, rows, carry0, carry1, steps):
        """A decode call's one array, unpacked as the device unpacks it."""
        host, src, md, sm = jax.tree.map(np.asarray, self._unpack(rows))
        self._check_md(self.decoding, rows.shape[0], 1, md, sm)
        self._record_fed(weights, kv, host, src, carry0, carry1)

    def _record_fed(self, weights, kv, host, src, carry0, carry1, *rest, **kwargs):
        carries = np.concatenate([np.asarray(carry0), np.asarray(carry1)])  # waits: a test
        for i, chunk in enumerate(self.decoding):
            fed = host[i] if src[i] < 0 else carries[src[i]]
            self.fed.append((chunk.request, chunk.start, int(fed)))

    def check_fed(self):
        """Each decode row was fed its request's token at its position (one it generated, or
        its prompt's last), whether that came from the host or a carry row."""
        assert self.fed
        for request, position, token in self.fed:
            ids = request.prompt_ids + request.output_ids
            if position < len(ids):  # (an aborted request's step in flight: never read)
                assert ids[position] == token, (request.request_id, position)

    @property
    def vocab(self):
        return self.runner.model_config.vocab_size


def _workload(n=24, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, size=int(k)).tolist()}
               for k in rng.integers(4, 120, size=n)]
    params = []
    for i, m in enumerate(rng.integers(2, 40, size=n)):
        sampled = dict(temperature=0.8, top_k=[0, 5, 1000][i % 3], top_p=[1.0, 0.9][i % 2],
                       seed=i * 2**33 + 1)
        params.append(SamplingParams(max_tokens=int(m), ignore_eos=True,
                                     logprobs=2 if i % 4 == 1 else None,
                                     prompt_logprobs=1 if i % 7 == 3 else None,
                                     **(sampled if i % 2 else dict(temperature=0.0))))
    return prompts, params


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(ragged_prefill=False),
    dict(decode_steps=4),
    dict(batching="static", max_batch_size=6),
], ids=["ragged", "padded-prefill", "multistep", "static"])
def test_the_device_gets_what_a_from_scratch_build_gives(overrides):
    llm = LLM(MODEL, **(BASE | overrides))
    runner = llm.engine.runner
    checker = Checker(runner)
    prompts, params = _workload()
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.stats()["num_preemptions"] > 0
    assert checker.calls.get("decode", 0) > 0
    assert checker.calls.get("ragged" if runner.ragged else "prefill", 0) > 0
    # 24 requests through 8 slots (slot 0 is padding): the slots are reused
    assert checker.slots_seen <= set(range(1, BASE["max_num_seqs"] + 1))
    assert llm.stats()["num_compilations_after_warmup"] == 0
    checker.check_fed()


def test_aborted_requests_give_their_slots_back():
    llm = LLM(MODEL, **BASE)
    engine, runner = llm.engine, llm.engine.runner
    checker = Checker(runner)
    prompts, params = _workload(12, seed=1)
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, dataclasses.replace(sp, max_tokens=30))
    for _ in range(6):
        engine.step()
    for i in range(0, 12, 2):
        engine.abort(str(i))
    # an aborted id again at once, as a one-token prompt: a decode row from its first step,
    # where the aborted request's row was (its input is its prompt's token, not that row's)
    engine.add_request("0", {"prompt_token_ids": [7]}, SamplingParams(max_tokens=5))
    while engine.has_unfinished_requests():
        engine.step()
    checker.check_fed()
    live = {r.request_id for r in runner.input_batch.slots}
    assert live <= {str(i) for i in range(1, 12, 2)} | {"0"}  # the last step's at most
    assert len(set(runner.input_batch.slots.values())) == len(runner.input_batch.slots)


def test_an_id_aborted_and_added_again_between_steps_is_fed_its_own_token():
    """Two rows decode; "b" is aborted and a new "b" (a one-token prompt, so a decode row from
    its first step) takes its place in the same row order: the new one is fed its prompt's
    token, not the carry the old "b" left in that row."""
    llm = LLM(MODEL, **BASE)
    engine = llm.engine
    checker = Checker(engine.runner)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    engine.add_request("b", {"prompt_token_ids": [9, 10, 11]}, params)
    for _ in range(4):
        engine.step()
    assert [c.request.request_id for c in checker.decoding] == ["a", "b"]
    assert engine.abort("b")
    engine.add_request("b", {"prompt_token_ids": [7]}, params)
    engine.step()
    assert [(c.request.request_id, c.start) for c in checker.decoding] == [("a", 7), ("b", 0)]
    while engine.has_unfinished_requests():
        engine.step()
    checker.check_fed()
