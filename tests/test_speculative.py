"""Speculative decoding on real models: the verification's sampling is exactly the model's
(a chi-square test, whose power a wrong acceptance rule shows), and greedy ids, their logprobs
and seeded samples do not change with speculation, in every batching mode, under preemption and
chunked prefill, on the demo model, stories260K (against its C reference) and a tiny
transformers-made model."""

import dataclasses
import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from scipy.stats import chi2_contingency, chisquare

from jaxserve import LLM, SamplingParams
from jaxserve.backends.base import REFERENCE
from jaxserve.model import sampler
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.request import RequestOutputKind

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}

# -- the verification's sampling ---------------------------------------------------------------

V, SAMPLES = 8, 40_000
LOGITS = np.array([[1.0, 2.0, 0.5, -1.0, 0.0, 1.5, -0.5, 0.2],
                   [0.3, -0.2, 2.5, 1.0, 0.0, -1.0, 0.7, 1.2],
                   [0.0, 0.4, -0.3, 1.1, 2.0, 0.1, -2.0, 0.9]], np.float32)  # [K + 1, V]
DRAFTS = np.array([0, 2], np.int32)  # a middling token, then the likeliest


def _target(logits, temperature, top_p):
    """The filtered distribution a plain step draws from, by numpy."""
    logits = logits.astype(np.float64)
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = (np.cumsum(p[order]) - p[order]) < top_p
    q = np.zeros_like(p)
    q[order[keep]] = p[order[keep]]
    return q / q.sum()


DRAFT_LOGITS = np.array([[2.0, 0.0, 1.0, 0.5, -1.0, 0.3, 0.0, 1.0],
                         [0.0, 0.5, 1.5, 1.4, -0.5, 0.0, 0.9, 0.2]], np.float32)  # [K, V]


def _verify_many(temperature, top_p, draft_model=False):
    """SAMPLES rows (seeds 0..SAMPLES-1) verifying proposals over LOGITS -> (their tokens
    [N, 3], the proposals [N, 2]): DRAFTS, or (draft_model) each row's draws from a draft whose
    logits are DRAFT_LOGITS."""
    n = SAMPLES
    sm = SamplingMetadata(temperature=np.full((n,), temperature, np.float32),
                          top_k=np.full((n,), V, np.int32), top_p=np.full((n,), top_p, np.float32),
                          seeds=np.arange(n, dtype=np.uint32),
                          positions=np.full((n,), 7, np.int32), logprobs=np.zeros((n,), bool))
    drafts, probs = jnp.broadcast_to(DRAFTS, (n, 2)), None
    if draft_model:
        draws = [sampler.draft_sample(jnp.broadcast_to(DRAFT_LOGITS[j], (n, V)), dataclasses.replace(
            sm, positions=sm.positions + 1 + j), REFERENCE.ops) for j in range(2)]
        drafts = jnp.stack([d for d, _ in draws], axis=1)
        probs = jnp.stack([q for _, q in draws], axis=1)
    fn = jax.jit(lambda logits, drafts, num, sm, probs: sampler.verify(
        logits, drafts, num, sm, 0, REFERENCE.ops, probs))
    packed = fn(jnp.broadcast_to(LOGITS, (n, 3, V)), drafts, jnp.full((n,), 2, jnp.int32), sm,
                probs)
    return np.asarray(packed[:, :, 0]), np.asarray(drafts)


def _fits(observed_tokens, p) -> float:
    """The chi-square p-value of the tokens against p (tokens p gives no mass must not occur)."""
    counts = np.bincount(observed_tokens, minlength=V)
    assert counts[p == 0].sum() == 0, f"tokens outside the distribution: {counts}"
    support = p > 0
    expected = p[support] / p[support].sum() * counts.sum()
    return chisquare(counts[support], expected).pvalue


def _position_checks(tokens, drafts, temperature, top_p) -> list[float]:
    """Each position's token, given the tokens before it were the accepted drafts: p-values."""
    pvalues = []
    reached = np.ones(len(tokens), bool)
    for j in range(3):
        p = _target(LOGITS[j], temperature, top_p)
        pvalues.append(_fits(tokens[reached, j], p))
        if j < 2:  # past an accepted draft only: a refused one ends the row
            assert (tokens[reached & (tokens[:, j] != drafts[:, j]), j + 1:] == -1).all()
            reached &= tokens[:, j] == drafts[:, j]
    return pvalues


@pytest.mark.parametrize("draft_model", [False, True], ids=["lookup", "draft"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_verification_draws_each_token_with_the_models_probability(temperature, top_p,
                                                                   draft_model):
    tokens, drafts = _verify_many(temperature, top_p, draft_model)
    assert min(_position_checks(tokens, drafts, temperature, top_p)) > 1e-4
    if draft_model:  # the draft's own draws: a token it proposed is often kept, often not
        kept = (tokens[:, 0] == drafts[:, 0]).mean()
        assert 0.2 < kept < 0.9


@pytest.mark.parametrize("draft_model", [False, True], ids=["lookup", "draft"])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, draft_model):
    """The test's power: keeping a proposal with probability sqrt(p(d)) / q(d) fails."""
    monkeypatch.setattr(sampler, "_accepts", lambda uniform, p, q: uniform * q < jnp.sqrt(p))
    tokens, drafts = _verify_many(1.0, 1.0, draft_model)
    assert _position_checks(tokens, drafts, 1.0, 1.0)[0] < 1e-6


def test_greedy_verification_keeps_the_argmax_run():
    sm = SamplingMetadata(*(np.array(x) for x in ([0.0, 0.0], [V, V], [1.0, 1.0], [0, 0], [3, 3],
                                                   [False, False])))
    logits = jnp.broadcast_to(LOGITS, (2, 3, V))
    drafts = jnp.array([[1, 2], [1, 5]], jnp.int32)  # row 0 right twice, row 1 once
    packed = sampler.verify(logits, drafts, jnp.array([2, 2]), sm, 0, REFERENCE.ops)
    assert np.asarray(packed[:, :, 0]).tolist() == [[1, 2, 4], [1, 2, -1]]
    packed = sampler.verify(logits, drafts, jnp.array([0, 1]), sm, 0, REFERENCE.ops)
    assert np.asarray(packed[:, :, 0]).tolist() == [[1, -1, -1], [1, 2, -1]]


# -- engines ------------------------------------------------------------------------------------

CODE = '''def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x

# The same, renamed to limit:
def limit(x, low, high):
'''  # 150 bytes: room for 40 more in the demo's 256
PROMPTS = [CODE, "The king said to the queen that the king", "Once upon a time, there was",
           CODE.replace("clamp", "bound"), "abc abc abc abc abc", "To be or not to be, that is"]
DEMO = dict(max_num_seqs=4, max_num_batched_tokens=256, prefill_chunk_sizes=(32, 128),
            num_pages=96, page_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def plain():
    return LLM("demo", **DEMO)


@pytest.fixture(scope="module")
def spec():
    return LLM("demo", **DEMO, speculative_config=NGRAM)


def _ids(llm, prompts=PROMPTS, params=None):
    params = params or SamplingParams(max_tokens=40, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_ids_and_logprobs_unchanged_and_proposals_accepted(plain, spec):
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    before = spec.stats()
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 and x[t].rank == y[t].rank
                       for t in x)
    stats = spec.stats()
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 40  # the code prompts repeat themselves
    assert stats["num_compilations_after_warmup"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


@pytest.mark.parametrize("options", [
    dict(batching="static", max_batch_size=3),
    dict(batching="dynamic", window_ms=5.0),
    dict(num_pages=20),  # preempts
    dict(max_num_batched_tokens=24, prefill_chunk_sizes=(8, 16)),  # chunked prompts, short drafts
], ids=["static", "dynamic", "preemption", "chunked"])
def test_greedy_ids_unchanged_in_every_mode(plain, options):
    llm = LLM("demo", **(DEMO | options), speculative_config=NGRAM)
    assert _ids(llm) == _ids(plain)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if "num_pages" in options:
        assert stats["num_preemptions"] > 0


def test_seeded_samples_do_not_depend_on_the_batch(spec):
    """A seeded sampled request speculates to the same tokens alone or among others."""
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=11)
    alone = _ids(spec, [CODE], params)
    crowd = _ids(spec, [PROMPTS[1], CODE, PROMPTS[2], PROMPTS[4]], params)
    assert crowd[1] == alone[0]
    assert _ids(spec, [CODE], params) == alone


def test_stories_greedy_ids_match_the_c_reference(stories_dir):
    cases = json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]
    llm = LLM(stories_dir, page_size=4, prefill_chunk_sizes=(8,), max_num_seqs=8,
              max_num_batched_tokens=32, num_pages=512, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                        [SamplingParams(max_tokens=len(c["generated_ids"]), temperature=0.0,
                                        ignore_eos=True) for c in cases], use_tqdm=False)
    for out, case in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == case["generated_ids"]
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("fixture", ["llama", "qwen3"])
def test_tiny_transformers_models_greedy_ids_unchanged(fixture):
    prompts = [{"prompt_token_ids": ids} for ids in
               ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10], [3, 4, 5, 6, 7, 8])]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(max_num_seqs=4, prefill_chunk_sizes=(16,), num_pages=64, page_size=4,
                   max_model_len=64)
    want = _ids(LLM(HF_FIXTURES / fixture, **options), prompts, params)
    llm = LLM(HF_FIXTURES / fixture, **options, speculative_config=NGRAM | {
        "prompt_lookup_min": 1})
    assert _ids(llm, prompts, params) == want
    assert llm.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_tokens_follow_the_same_distribution_with_and_without(plain, spec, temperature,
                                                                      top_p):
    """The engine end to end: the code prompt, whose continuation may copy it (so proposals
    come, some kept, some refused: the residual draws), 1,000 seeds each way; each of the
    first four output positions' tokens, with and without speculation, pass a two-sample
    chi-square test."""
    prompt = CODE
    n = 1000
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, seed=s,
                             ignore_eos=True)
              for s in range(n)]
    before = spec.stats()
    with_spec = np.array(_ids(spec, [prompt] * n, params))
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"] > n // 2
    assert stats["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    without = np.array(_ids(plain, [prompt] * n, [SamplingParams(
        max_tokens=4, temperature=temperature, top_p=top_p, seed=s + n, ignore_eos=True)
        for s in range(n)]))
    for j in range(4):
        tokens = sorted(set(with_spec[:, j]) | set(without[:, j]))
        table = np.array([[np.sum(run[:, j] == t) for t in tokens] for run in (with_spec,
                                                                               without)])
        common = table.sum(axis=0) >= 10  # rare tokens pooled into one column
        table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] > 1:
            assert chi2_contingency(table).pvalue > 1e-4, (j, table)


def test_stops_and_streamed_deltas_as_without_speculation(plain, spec):
    """Stop strings and stop tokens inside a kept run end the output where they would without
    speculation; streamed deltas (several tokens a step now) add up to the same text."""
    def run(llm, params):
        engine = llm.llm_engine
        ids = [f"s{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS, strict=True):
            engine.add_request(rid, prompt, params)
        text, tokens, reasons = dict.fromkeys(ids, ""), {rid: [] for rid in ids}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                text[out.request_id] += out.outputs[0].text
                tokens[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    reasons[out.request_id] = (out.outputs[0].finish_reason,
                                               out.outputs[0].stop_reason)
        return text, tokens, reasons

    token = _ids(plain)[1][12]  # a token the outputs hold, somewhere past their start
    for stop in (dict(stop=["ring to"]), dict(stop_token_ids=[token])):
        params = SamplingParams(max_tokens=40, temperature=0.0, output_kind=RequestOutputKind.DELTA,
                                **stop)
        got = run(spec, params)
        assert got == run(plain, params)
        assert any(reason == "stop" for reason, _ in got[2].values())


def test_served_streams_and_metrics(spec):
    """Over HTTP: a streamed completion with speculation gives the offline greedy text, and
    /metrics carries vLLM's spec_decode counters, moved by it."""
    from prometheus_client.parser import text_string_to_metric_families
    from served import metrics_of, uvicorn_url

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server import ServerConfig, build_app

    want = spec.generate([CODE], SamplingParams(max_tokens=40, temperature=0.0),
                         use_tqdm=False)[0].outputs[0].text
    engine = AsyncEngine(spec.llm_engine)
    with uvicorn_url(build_app(engine, ServerConfig(), "demo")) as url, httpx.Client(
            base_url=url, timeout=60) as http:
        before = metrics_of(http)
        body = {"model": "demo", "prompt": CODE, "max_tokens": 40, "temperature": 0,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        after = metrics_of(http)
        metrics_text = http.get("/metrics").text
    drafts, kept = (after[f"jaxserve:spec_decode_num_{k}_total"]
                    - before.get(f"jaxserve:spec_decode_num_{k}_total", 0)
                    for k in ("draft_tokens", "accepted_tokens"))
    assert drafts > 0 and 0 < kept <= drafts
    (family,) = [f for f in text_string_to_metric_families(metrics_text)
                 if f.name == "jaxserve:spec_decode_num_accepted_tokens_per_pos"]
    per_pos = {s.labels["position"]: s.value for s in family.samples}
    assert list(per_pos) == ["0", "1", "2"]
    assert per_pos["0"] >= per_pos["1"] >= per_pos["2"]


# -- a draft model -------------------------------------------------------------------------------

DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}  # the demo's shipped draft


def test_the_model_as_its_own_draft_keeps_every_proposal(plain):
    """Proposals by the model itself are what it would generate: every one kept, greedy and
    sampled (q = p: min(1, p/q) = 1), which only holds if the draft's K/V (its catch-up over
    each prompt, its roll back) is right; and the outputs are the model's."""
    from jaxserve.demo import CHECKPOINT_DIR

    llm = LLM("demo", **DEMO, speculative_config=DRAFT | {"model": str(CHECKPOINT_DIR)})
    assert _ids(llm) == _ids(plain)
    sampled = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=5)
    assert _ids(llm, params=sampled) == _ids(llm, params=sampled)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_compilations_after_warmup"] == 0


@pytest.mark.parametrize("options", [{}, dict(num_pages=20), dict(
    max_num_batched_tokens=24, prefill_chunk_sizes=(8, 16))], ids=["plain", "preemption",
                                                                  "chunked"])
def test_the_demos_draft_leaves_greedy_ids_unchanged(plain, options):
    llm = LLM("demo", **(DEMO | options), speculative_config=DRAFT)
    assert _ids(llm) == _ids(plain)
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=11)
    alone = _ids(llm, [CODE], params)
    assert _ids(llm, [PROMPTS[1], CODE, PROMPTS[2]], params)[1] == alone[0]


def test_a_draft_must_share_the_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config.model.*vocabulary"):
        LLM("demo", **DEMO, speculative_config=DRAFT | {"model": str(HF_FIXTURES / "llama")})
    with pytest.raises(ValueError, match=r"speculative_config.model.*not a local model"):
        LLM("demo", **DEMO, speculative_config=DRAFT | {"model": str(tmp_path / "none")})
    with pytest.raises(ValueError, match=r"speculative_config.model.*required"):
        LLM(HF_FIXTURES / "llama", max_num_seqs=2, speculative_config=DRAFT)
