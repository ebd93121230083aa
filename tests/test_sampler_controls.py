"""The sampler controls (issue 32) against an independent numpy reference written from vLLM's
definitions (V1 sampler; sampler_reference.py), and the host's token masks; end to end on the
demo model: test_sampler_controls_e2e.py.

    allowed bitmask (-inf elsewhere) -> + logit_bias -> repetition (tokens in the prompt or the
    output: positive logits / r, negative * r) -> - frequency * count - presence * [count > 0]
    -> greedy argmax, or temperature -> min_p -> top-k -> top-p -> a draw

Logprobs are those of the raw logits (vLLM's default raw_logprobs).
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sampler_reference import (
    EOS,
    VOCAB,
    _explained,
    _log_softmax,
    reference_logits,
    reference_support,
)

from jaxserve import SamplingParams
from jaxserve.backends import Ops
from jaxserve.demo import demo_model_dir
from jaxserve.model.sampler import (
    Controls,
    SamplerState,
    SamplingMetadata,
    allowed_mask,
    apply_controls,
    sample,
)
from jaxserve.structured.bitmask import pack_bits
from jaxserve.structured.token_masks import TokenMask, bad_word_ids
from jaxserve.text.tokenizer import load_tokenizer


def _pack(allowed: np.ndarray) -> np.ndarray:
    """[V] bool -> int32 words, bit t % 32 of word t // 32 (written here, not jaxserve's)."""
    words = np.zeros(-(-allowed.shape[0] // 32), np.uint64)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint64(1 << (t % 32))
    return words.astype(np.uint32).view(np.int32)


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.arange(vocab)
    return ((words.view(np.uint32)[ids // 32] >> (ids % 32).astype(np.uint32)) & 1).astype(bool)


# -- apply_controls and sample against the reference -------------------------------------------

SHAPES = ((1, 37), (3, 258), (8, 300))  # (rows, vocab): one compile each
SLOTS, BIAS = 11, 6  # slot 0 is padding; rows take shuffled slots among the rest
NUM_TOP = 2
_apply = jax.jit(apply_controls)
_sample = jax.jit(lambda logits, sm, c, s: sample(logits, sm, NUM_TOP, Ops(), c, s))


@dataclasses.dataclass
class Row:
    """One row of a batch: its controls, and the prompt and output its slot's state holds."""

    prompt: list[int]
    output: list[int]
    controlled: bool = False
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    bias: dict = dataclasses.field(default_factory=dict)
    allowed: set | None = None
    banned: set = dataclasses.field(default_factory=set)

    def reference(self, logits):
        return reference_logits(logits, self.prompt, self.output, self.presence, self.frequency,
                                self.repetition, self.bias, self.allowed, self.banned)


def _off_or(value, strategy):
    return st.one_of(st.just(value), strategy)


@st.composite
def rows(draw, vocab):
    token = st.integers(0, vocab - 1)
    repeated = st.one_of(st.integers(0, 7), token)  # outputs that repeat tokens, often
    # a plain row's slot may hold what an earlier request left: the controls must ignore it
    row = Row(draw(st.lists(token, max_size=12)), draw(st.lists(repeated, max_size=16)))
    if not draw(st.booleans()):
        return row
    allowed = draw(st.one_of(st.none(), st.sets(token, min_size=1, max_size=40)))
    banned = draw(st.sets(token, max_size=6))
    if allowed is not None:
        banned.discard(min(allowed))  # one token stays allowed
    return dataclasses.replace(
        row, controlled=True,
        presence=draw(_off_or(0.0, st.floats(-2, 2))),
        frequency=draw(_off_or(0.0, st.floats(-2, 2))),
        repetition=draw(_off_or(1.0, st.floats(0.1, 3))),
        min_p=draw(st.sampled_from([0.0, 1.0]) | st.floats(0, 1)),
        bias=draw(st.dictionaries(token, st.floats(-100, 100), max_size=5)),
        allowed=allowed, banned=banned)


@st.composite
def batches(draw):
    b, vocab = draw(st.sampled_from(SHAPES))
    return vocab, [draw(rows(vocab)) for _ in range(b)], draw(st.integers(0, 2**32 - 1))


def _inputs(vocab, batch, seed):
    """The device inputs of a batch: logits (distinct values), Controls, SamplerState (unused
    slots hold junk no row may read)."""
    rng = np.random.default_rng(seed)
    b = len(batch)
    logits = (rng.standard_normal((b, vocab)) * 3).astype(np.float32)
    slots = rng.permutation(np.arange(1, SLOTS))[:b].astype(np.int32)
    counts = rng.integers(0, 3, (SLOTS, vocab)).astype(np.int32)
    prompt = rng.random((SLOTS, vocab)) < 0.3
    bias_ids = rng.integers(0, vocab, (SLOTS, BIAS)).astype(np.int32)
    bias_values = rng.uniform(-50, 50, (SLOTS, BIAS)).astype(np.float32)
    bitmask = np.zeros((b, -(-vocab // 32)), np.int32)
    for i, row in enumerate(batch):
        s = slots[i]
        counts[s] = np.bincount(row.output, minlength=vocab)
        prompt[s] = False
        prompt[s, row.prompt] = True
        if row.controlled:  # a plain row's slot keeps an earlier request's bias: unread
            bias_ids[s], bias_values[s] = 0, 0.0  # padding: token 0, a bias of 0
            bias_ids[s, :len(row.bias)] = list(row.bias)
            bias_values[s, :len(row.bias)] = list(row.bias.values())
        ok = np.ones(vocab, bool) if row.allowed is None else np.isin(np.arange(vocab),
                                                                      list(row.allowed))
        ok[list(row.banned)] = False
        bitmask[i] = _pack(ok)

    def column(name, dtype):
        return np.array([getattr(r, name) for r in batch], dtype)

    controls = Controls(slots=slots, presence=column("presence", np.float32),
                        frequency=column("frequency", np.float32),
                        repetition=column("repetition", np.float32),
                        min_p=column("min_p", np.float32), counted=column("controlled", bool),
                        owns_state=column("controlled", bool), bitmask=bitmask)
    state = SamplerState(counts=counts, prompt=prompt, bias_ids=bias_ids, bias_values=bias_values)
    return logits, controls, state


def _meta(b, vocab, temperature, top_k=None, top_p=None, seeds=None):
    return SamplingMetadata(
        temperature=np.asarray(temperature, np.float32),
        top_k=np.full((b,), vocab, np.int32) if top_k is None else np.asarray(top_k, np.int32),
        top_p=np.ones((b,), np.float32) if top_p is None else np.asarray(top_p, np.float32),
        seeds=np.arange(b, dtype=np.uint32) if seeds is None else seeds,
        positions=np.full((b,), 5, np.int32), logprobs=np.ones((b,), bool))


@settings(max_examples=40, deadline=None)
@given(batches())
def test_apply_controls_and_greedy_equal_the_reference(case):
    vocab, batch, seed = case
    logits, controls, state = _inputs(vocab, batch, seed)
    got = np.asarray(_apply(logits, controls, state))
    for i, row in enumerate(batch):
        if not row.controlled:  # every control is exactly the identity on a plain row
            np.testing.assert_array_equal(got[i], logits[i])
            continue
        want = row.reference(logits[i])
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want), err_msg=str(row))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[i][finite], want[finite], rtol=2e-6, atol=2e-5,
                                   err_msg=str(row))

    b = len(batch)
    packed, after = _sample(logits, _meta(b, vocab, np.zeros(b)), controls, state)
    packed = np.asarray(packed)
    for i, row in enumerate(batch):
        token = packed[i, 0]
        assert _explained(row.reference(logits[i]), token), (row, token)
        # logprobs and top ids are the raw logits'
        raw = _log_softmax(logits[i])
        assert abs(packed[i, 1:2].view(np.float32)[0] - raw[token]) < 1e-5
        assert packed[i, 2] == 1 + np.sum(raw > raw[token])
        np.testing.assert_array_equal(packed[i, 3:3 + NUM_TOP], np.argsort(-raw)[:NUM_TOP])
    want_counts = state.counts.copy()
    for i, row in enumerate(batch):
        want_counts[controls.slots[i], packed[i, 0]] += row.controlled
    np.testing.assert_array_equal(np.asarray(after.counts), want_counts)
    for name in ("prompt", "bias_ids", "bias_values"):
        np.testing.assert_array_equal(np.asarray(getattr(after, name)), getattr(state, name))


@settings(max_examples=25, deadline=None)
@given(batches(), st.data())
def test_draws_stay_in_the_reference_support(case, data):
    """temperature -> min_p -> top-k -> top-p: over 64 seeds every draw lies in the reference's
    kept set, each token the reference gives a fair chance (> 0.2) comes out, min_p = 1 gives
    only the likeliest token, and greedy rows beside sampled ones stay the argmax."""
    vocab, batch, seed = case
    b = len(batch)
    temperature = data.draw(st.lists(_off_or(0.0, st.floats(0.3, 2)), min_size=b, max_size=b))
    top_k = data.draw(st.lists(_off_or(vocab, st.integers(1, vocab)), min_size=b, max_size=b))
    top_p = data.draw(st.lists(_off_or(1.0, st.floats(0.05, 1)), min_size=b, max_size=b))
    logits, controls, state = _inputs(vocab, batch, seed)
    draws = np.stack([np.asarray(_sample(
        logits, _meta(b, vocab, temperature, top_k, top_p,
                      np.arange(b, dtype=np.uint32) + 1000 * k), controls, state)[0])[:, 0]
        for k in range(64)])  # [64, B]
    for i, row in enumerate(batch):
        ref = row.reference(logits[i])
        tokens = draws[:, i]
        if temperature[i] == 0:
            assert all(_explained(ref, t) for t in tokens), (row, tokens)
            continue
        loose, q = reference_support(ref, temperature[i], row.min_p, top_k[i], top_p[i], 1e-4)
        assert loose[tokens].all(), (row, temperature[i], top_k[i], top_p[i],
                                     sorted(set(tokens) - set(np.flatnonzero(loose))))
        strict, _ = reference_support(ref, temperature[i], row.min_p, top_k[i], top_p[i], -1e-4)
        likely = np.flatnonzero(strict & (q / q[loose].sum() > 0.2))
        assert set(likely) <= set(tokens.tolist()), (row, likely, np.unique(tokens))
        if row.min_p == 1.0:
            assert all(_explained(ref / temperature[i], t) for t in tokens), (row, tokens)


# -- the bitmask's layout --------------------------------------------------------------------

_allowed_mask = jax.jit(allowed_mask, static_argnums=1)


@pytest.mark.parametrize("vocab", [33, 258, 511])
def test_pack_bits_and_allowed_mask_round_trip(vocab):
    rng = np.random.default_rng(vocab)
    cases = [np.zeros(vocab, bool), np.ones(vocab, bool), rng.random(vocab) < 0.5,
             np.arange(vocab) % 32 == 31]
    for token in (0, 31, 32, vocab - 1):
        one = np.zeros(vocab, bool)
        one[token] = True
        cases += [one, ~one]
    for allowed in cases:
        words = pack_bits(allowed)
        assert words.dtype == np.int32 and words.shape == (-(-vocab // 32),)
        np.testing.assert_array_equal(words, _pack(allowed))  # bit t % 32 of word t // 32
        np.testing.assert_array_equal(np.asarray(_allowed_mask(words[None], vocab))[0], allowed)


# -- TokenMask: the host's masks -----------------------------------------------------------------


def _mask_after(params, output, stop_ids=frozenset({EOS}), tokenizer=None):
    mask = TokenMask(params, VOCAB, frozenset(stop_ids), tokenizer, None)
    mask.accept(list(output))
    row = np.full((mask.width,), -7, np.int32)  # whatever the buffer held before
    mask.fill(row)
    return _unpack(row, VOCAB)


def test_allowed_token_ids_allow_exactly_those():
    allowed = {0, 31, 32, 97, 255, 257}
    got = _mask_after(SamplingParams(allowed_token_ids=sorted(allowed)), [5, 6])
    assert set(np.flatnonzero(got)) == allowed


def test_bad_words_mask_a_word_only_where_its_last_token_would_end_it():
    tokenizer = load_tokenizer(demo_model_dir())
    assert bad_word_ids(("x", "ab", " cd"), tokenizer, VOCAB) == [[120], [97, 98], [99, 100]]
    params = SamplingParams(bad_words=["x", "ab"])
    for output in ([], [97], [120, 97], [98, 97, 32]):
        got = _mask_after(params, output, tokenizer=tokenizer)
        ends_with_a = bool(output) and output[-1] == 97
        assert set(np.flatnonzero(~got)) == ({120, 98} if ends_with_a else {120}), output


def test_min_tokens_masks_eos_and_stop_ids_until_the_output_holds_them():
    # stop ids 31 and 257 (the last token): bit 31 of a word and the last word's last bit
    params = SamplingParams(min_tokens=3, stop_token_ids=[31], max_tokens=8)
    for n in range(6):
        got = _mask_after(params, [65] * n, stop_ids={31, EOS})
        assert set(np.flatnonzero(~got)) == ({31, EOS} if n < 3 else set()), n
    # with allowed_token_ids: the stop ids are cleared from the allowed set, the rest stays
    params = SamplingParams(min_tokens=2, allowed_token_ids=[31, 65, EOS])
    assert set(np.flatnonzero(_mask_after(params, [65], stop_ids={31, EOS}))) == {65}
    assert set(np.flatnonzero(_mask_after(params, [65, 65], stop_ids={31, EOS}))) == {
        31, 65, EOS}
