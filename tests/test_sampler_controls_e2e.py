"""The sampler controls (issue 32) end to end on the demo model: a plain row beside controlled
ones samples as it does alone, each control acts, penalised greedy output follows the numpy
reference (sampler_reference.py) on the model's raw logits, and nothing compiles after warm-up,
ragged prefill or padded. The controls alone against the reference: test_sampler_controls.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sampler_reference import EOS, VOCAB, _explained, _log_softmax, reference_logits

from jaxserve import LLM, SamplingParams
from jaxserve.config.model import ModelConfig
from jaxserve.demo import demo_model_dir
from jaxserve.demo.train import causal_logits
from jaxserve.model.loader import load_state

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
