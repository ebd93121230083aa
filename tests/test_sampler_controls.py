"""The sampler controls (issue 32) against an independent numpy reference written from vLLM's
definitions (V1 sampler), then end to end on the demo model.

    allowed bitmask (-inf elsewhere) -> + logit_bias -> repetition (tokens in the prompt or the
    output: positive logits / r, negative * r) -> - frequency * count - presence * [count > 0]
    -> greedy argmax, or temperature -> min_p -> top-k -> top-p -> a draw

Logprobs are those of the raw logits (vLLM's default raw_logprobs).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams
from jaxserve.backends import Ops
from jaxserve.config.model import ModelConfig
from jaxserve.demo import demo_model_dir
from jaxserve.demo.train import causal_logits
from jaxserve.model.loader import load_state
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

# -- the reference ---------------------------------------------------------------------------


def reference_logits(logits, prompt_ids, output_ids, presence, frequency, repetition,
                     bias: dict, allowed: set | None, banned: set) -> np.ndarray:
    """One row's logits [V] as vLLM's sampler sees them before temperature (float32)."""
    x = np.array(logits, np.float32)
    vocab = x.shape[0]
    ok = np.zeros(vocab, bool) if allowed is not None else np.ones(vocab, bool)
    if allowed is not None:
        ok[sorted(allowed)] = True
    ok[sorted(banned)] = False
    x[~ok] = -np.inf
    for token, value in bias.items():
        x[token] += np.float32(value)
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab)
    seen = counts > 0
    in_prompt = np.zeros(vocab, bool)
    in_prompt[list(prompt_ids)] = True
    r = np.float32(repetition)
    penalised = in_prompt | seen
    x = np.where(penalised & (x > 0), x / r, np.where(penalised, x * r, x))
    x = x - np.float32(frequency) * counts.astype(np.float32)
    return (x - np.float32(presence) * seen.astype(np.float32)).astype(np.float32)


def reference_support(processed, temperature, min_p, top_k, top_p, slack):
    """The tokens a draw may give: temperature -> min_p -> top-k -> top-p over `processed`
    (float64). `slack` > 0 widens every cut by that relative margin (a superset of what
    float32 keeps), < 0 narrows it (a subset)."""
    z = processed.astype(np.float64) / temperature
    finite = np.isfinite(z)
    p = np.where(finite, np.exp(z - z[finite].max()), 0.0)
    keep = finite & ((p >= min_p * (1 - slack)) | (p == 1))  # p is relative to the max
    kth = np.sort(z[finite])[::-1][min(top_k, finite.sum()) - 1]
    keep &= z >= kth - max(slack, 0) * (1 + abs(kth))  # ties at the cut stay in
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    before = np.cumsum(q[order]) - q[order]
    kept = np.zeros_like(keep)
    kept[order] = before < top_p + slack
    return keep & kept, q


def _explained(ref: np.ndarray, token: int, tol: float = 1e-5) -> bool:
    """The greedy `token` is the reference's argmax (or ties it within `tol`, relative)."""
    top = ref.max()
    return int(token) == int(np.argmax(ref)) or ref[token] >= top - tol * (1 + abs(top))


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


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


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

VOCAB = 258  # the demo's bytes, BOS 256, EOS 257
EOS = 257


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


# -- end to end on the demo model ----------------------------------------------------------------

ENGINE = dict(max_num_seqs=8, prefill_chunk_sizes=(16, 64), max_num_batched_tokens=128)
PROMPTS = ["def f(x):", "import os\n", "class Foo(object):\n    def __init__(self, a):",
           "for i in range(10):\n"]
LONG = ("import os\nimport sys\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a "
        "file.\"\"\"\n    with open(path) as f:\n        return f.read().splitlines()\n\n\n"
        "def main(argv):\n")  # > 128 tokens: prefilled in chunks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=2)
# each control on its own; logit_bias last: see test_a_plain_request_gets_no_logit_bias_...
CONTROLS = {
    "presence": SamplingParams(max_tokens=14, temperature=0.0, presence_penalty=1.5),
    "frequency": SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=1.5),
    "repetition": SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.8),
    "min_p": SamplingParams(max_tokens=14, temperature=1.0, seed=3, min_p=0.2),
    "bad_words": SamplingParams(max_tokens=14, temperature=0.0, bad_words=["e", "Re"]),
    "allowed_token_ids": SamplingParams(max_tokens=14, temperature=0.0,
                                        allowed_token_ids=list(range(97, 123))),
    "min_tokens": SamplingParams(max_tokens=14, temperature=0.0, min_tokens=8,
                                 stop_token_ids=[32]),
    "logit_bias": SamplingParams(max_tokens=14, temperature=0.0, logit_bias={65: 100.0}),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(model="demo", **ENGINE)


@pytest.fixture(scope="module")
def alone(llm):
    """The plain requests of the batch-invariance test, each run by itself (plain calls)."""
    return [_trace(llm.generate([p], [sp], use_tqdm=False)[0])
            for p, sp in ((PROMPTS[0], GREEDY), (PROMPTS[3], SEEDED))]


@pytest.fixture(scope="module")
def forward():
    """The demo model's direct forward (demo.train.causal_logits): ids -> raw logits [T, V]."""
    cfg = ModelConfig.from_hf_dir(demo_model_dir())
    model = nnx.merge(*load_state(demo_model_dir(), cfg, jnp.float32))
    return lambda ids: np.asarray(causal_logits(model, jnp.array([ids]))[0])


def _trace(out):
    """A request's ids and logprobs (token, logprob, rank), for exact comparisons."""
    c = out.outputs[0]
    return c.token_ids, c.logprobs and [[(t, lp.logprob, lp.rank) for t, lp in step.items()]
                                        for step in c.logprobs]


def _run(llm, prompt, params):
    return llm.generate([prompt], [params], use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("control", list(CONTROLS))
def test_plain_rows_sample_the_same_beside_a_controlled_row(llm, alone, control):
    """A plain row in a controlled call (its head samples with every control off) gets the ids
    and logprobs it gets alone, bit for bit: prefill (ragged) and decode calls alike."""
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                        [GREEDY, CONTROLS[control], SEEDED], use_tqdm=False)
    assert [_trace(outs[0]), _trace(outs[2])] == alone


def test_a_plain_request_gets_no_logit_bias_from_its_slots_earlier_request(llm, alone):
    """A slot keeps its device state (SamplerState) after its request leaves; a plain request
    that takes the slot next must not sample with the logit_bias left there."""
    biased = _run(llm, PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0,
                                                  logit_bias={65: 100.0}))
    assert biased.token_ids == [65] * 3
    # the plain request takes the slot the biased one freed (the free list is last in, first
    # out); its neighbour's penalty makes the calls controlled
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, CONTROLS["presence"]],
                        use_tqdm=False)
    assert _trace(outs[0]) == alone[0]


def test_logit_bias_allowed_token_ids_and_bad_words_end_to_end(llm):
    assert _run(llm, PROMPTS[0], CONTROLS["logit_bias"]).token_ids == [65] * 14
    low = set(range(97, 123))
    for params in (CONTROLS["allowed_token_ids"],
                   SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                  allowed_token_ids=sorted(low | {10, 32}))):
        tokens = _run(llm, PROMPTS[2], params).token_ids
        assert len(tokens) == params.max_tokens and set(tokens) <= low | {10, 32}, tokens
    plain = _run(llm, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0)).text
    assert "e" in plain and "init" in plain, plain  # so the words below are ones it would write
    one = _run(llm, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, bad_words=["e"]))
    assert "e" not in one.text and len(one.token_ids) == 24, one.text
    two = _run(llm, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0,
                                               bad_words=["init"]))
    assert "init" not in two.text and len(two.token_ids) == 24, two.text


def test_min_tokens_holds_back_eos_and_stop_ids(llm):
    # a space (32) stops the plain request at its second token
    stop = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[32])
    early = _run(llm, PROMPTS[0], stop)
    assert early.token_ids[-1] == 32 and len(early.token_ids) < 8, early.token_ids
    held = _run(llm, PROMPTS[0], dataclasses.replace(stop, min_tokens=8))
    assert len(held.token_ids) >= 8 and not {32, EOS} & set(held.token_ids[:8]), held.token_ids
    # EOS too (here sampled at temperature: a row with min_tokens samples no EOS before it)
    for seed in range(3):
        out = _run(llm, PROMPTS[3], SamplingParams(max_tokens=12, temperature=1.5, seed=seed,
                                                   min_tokens=12, logit_bias={EOS: 8.0}))
        assert EOS not in out.token_ids and len(out.token_ids) == 12, out.token_ids


PENALTIES = {
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=2.0),
    "repetition": dict(repetition_penalty=2.0),
    "repetition_below_1": dict(repetition_penalty=0.5),
    # every logit moved below 0 (the same shift for all: the plain argmax stays), so the
    # repetition penalty multiplies where it divided above
    "repetition_of_negative_logits": dict(repetition_penalty=2.0,
                                          logit_bias={t: -40.0 for t in range(VOCAB)}),
    "all_three": dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3),
}


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalties_at_greedy_follow_the_reference(llm, forward, penalty):
    """The penalised greedy output differs from the plain one, and every token of it (the first
    that differs included) is the argmax of the reference applied to the model's raw logits
    after the tokens before it; the plain token there was the raw argmax."""
    penalty = PENALTIES[penalty]
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=20)
    plain = llm.generate([PROMPTS[1]], [base], use_tqdm=False)[0]
    out = llm.generate([PROMPTS[1]], [dataclasses.replace(base, **penalty)], use_tqdm=False)[0]
    prompt, ids, plain_ids = out.prompt_token_ids, out.outputs[0].token_ids, plain.outputs[
        0].token_ids
    assert ids != plain_ids
    first = next(j for j, (a, b) in enumerate(zip(ids, plain_ids, strict=True)) if a != b)
    raw = forward(prompt + ids)[len(prompt) - 1:]  # [24 + 1, V]: row j predicts output j
    # the direct forward is the engine's model: the plain run's top logprobs where they part
    top = plain.outputs[0].logprobs[first]
    lp = _log_softmax(raw[first])
    for token, logprob in top.items():
        assert abs(lp[token] - logprob.logprob) < 1e-3
    assert _explained(raw[first], plain_ids[first], 2e-4)
    assert raw.max() < 40  # so the bias above makes every logit negative

    def reference(j):
        return reference_logits(raw[j], prompt, ids[:j], penalty.get("presence_penalty", 0.0),
                                penalty.get("frequency_penalty", 0.0),
                                penalty.get("repetition_penalty", 1.0),
                                penalty.get("logit_bias", {}), None, set())

    for j, token in enumerate(ids):
        assert _explained(reference(j), token, 2e-4), (j, token, int(np.argmax(reference(j))))
    assert int(np.argmax(reference(first))) == ids[first] != plain_ids[first]


def test_a_seeded_controlled_request_samples_the_same_alone_and_batched(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11, presence_penalty=0.7,
                            frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05,
                            ignore_eos=True, logprobs=2)
    one = _trace(llm.generate([PROMPTS[1]], [params], use_tqdm=False)[0])
    outs = llm.generate([*PROMPTS, LONG], [GREEDY, params, CONTROLS["bad_words"], SEEDED,
                                           CONTROLS["repetition"]], use_tqdm=False)
    assert _trace(outs[1]) == one
    assert len(set(one[0])) > 3  # a real draw, not one token over and over


def _every_control():
    """Prompts and params running every control, plain rows among them, a long prompt (chunked
    prefill), prompt logprobs, and more requests than slots (requests join running ones)."""
    prompts = [*PROMPTS, LONG, PROMPTS[0], PROMPTS[2], LONG, PROMPTS[1], PROMPTS[3], PROMPTS[2]]
    params = [*CONTROLS.values(), GREEDY,
              dataclasses.replace(CONTROLS["logit_bias"], prompt_logprobs=1,
                                  logit_bias={66: 100.0}),
              SamplingParams(max_tokens=5, temperature=0.7, seed=1, top_k=20, top_p=0.9,
                             frequency_penalty=1.0, logit_bias={10: -5.0})]
    params = [dataclasses.replace(p, max_tokens=p.max_tokens - 2 * (i % 3))
              for i, p in enumerate(params)]
    return prompts, params


def _check_every_control(outs, params):
    for out, p in zip(outs, params, strict=True):
        tokens = out.outputs[0].token_ids
        forced = [t for t, v in (p.logit_bias or {}).items() if v == 100.0]
        if forced:
            assert tokens == forced * p.max_tokens
        if p.allowed_token_ids is not None:
            assert set(tokens) <= set(p.allowed_token_ids)
        if p.bad_words:
            assert "e" not in out.outputs[0].text
        if p.min_tokens:
            assert len(tokens) >= p.min_tokens
        if p.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_every_control_compiles_nothing_after_warmup(llm):
    prompts, params = _every_control()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check_every_control(outs, params)
    assert llm.engine.runner.num_compilations_after_warmup == 0


def test_every_control_on_the_padded_prefill_calls(llm):
    """ragged_prefill=False: prefill_hidden and the prompt-logprobs call feed the heads; the
    controls act the same, nothing compiles after warm-up, and the greedy controlled rows
    sample what the ragged engine's do."""
    padded = LLM(model="demo", max_num_seqs=4, prefill_chunk_sizes=(16, 64),
                 max_num_batched_tokens=64, ragged_prefill=False)
    assert not padded.engine.runner.ragged
    prompts, params = _every_control()
    outs = padded.generate(prompts, params, use_tqdm=False)
    _check_every_control(outs, params)
    assert padded.engine.runner.num_compilations_after_warmup == 0
    ragged = llm.generate(prompts, params, use_tqdm=False)
    for p, a, b in zip(params, outs, ragged, strict=True):
        if p.controlled and p.temperature == 0.0:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, p
