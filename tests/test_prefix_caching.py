"""Automatic prefix caching through the engine (issue 31): the same greedy ids and, on the CPU
backend, the same logprobs bit for bit with the cache on and off (a cached page holds exactly
the bits a recompute would write: the kernels are batch invariant); the counters and each
request's cached tokens worked out by hand; preemption with shared pages. The pages and keys
themselves are tested in test_prefix_cache.py, the scheduler's invariants with shared prefixes
in test_scheduler_random.py."""

import numpy as np
import pytest
from conftest import HF_FIXTURES

from jaxserve import LLM, SamplingParams
from jaxserve.server.responses import usage

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_sizes=(32,), page_size=8,
             num_pages=80, max_model_len=128)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


def shared_prompts(seed: int, vocab: int, system: int = 37) -> list[dict]:
    """A system prompt shared by most, cut at and off page boundaries, a prompt that is
    another's prefix, a prompt that is exactly whole pages, and one sharing nothing."""
    rng = np.random.default_rng(seed)
    head = rng.integers(3, vocab, system).tolist()
    prompts = [head + rng.integers(3, vocab, int(k)).tolist() for k in (1, 5, 11, 19, 26)]
    prompts += [head[:16], head[:17], [*head[:24], 5, 6, 7], prompts[3][:40],
                rng.integers(3, vocab, 30).tolist()]
    return [{"prompt_token_ids": p} for p in prompts]


def runs(llm: LLM, prompts: list[dict], params: SamplingParams) -> list:
    """The prompts all at once, then again (the second time the first run's pages are
    cached), then one at a time."""
    out = llm.generate(prompts, params, use_tqdm=False)
    out += llm.generate(prompts, params, use_tqdm=False)
    for prompt in prompts[::3]:
        out += llm.generate([prompt], params, use_tqdm=False)
    return out


def assert_same(off: list, on: list) -> None:
    for a, b in zip(off, on, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: lp.logprob for t, lp in la.items()} == {
                t: lp.logprob for t, lp in lb.items()}  # bit for bit


@pytest.fixture(scope="module")
def stories(stories_dir):
    return {on: LLM(stories_dir, enable_prefix_caching=on, **SMALL) for on in (False, True)}


def test_stories_same_ids_and_logprobs_with_the_cache(stories):
    prompts = shared_prompts(0, 512)
    off, on = runs(stories[False], prompts, GREEDY), runs(stories[True], prompts, GREEDY)
    assert_same(off, on)
    assert stories[False].stats()["prefix_cache_hits"] == 0
    assert all(o.num_cached_tokens == 0 for o in off)
    hits = stories[True].stats()["prefix_cache_hits"]
    assert hits > 0 and sum(o.num_cached_tokens for o in on) == hits
    assert all(o.num_cached_tokens % 8 == 0
               and o.num_cached_tokens < len(o.prompt_token_ids) for o in on)


def test_counts_by_hand(stories):
    """page_size 8: a prompt of 20 tokens has 2 full pages; a prompt can take at most the
    pages before the one holding its last token."""
    llm = stories[True]
    assert llm.reset_prefix_cache()
    base = llm.stats()["prefix_cache_queries"], llm.stats()["prefix_cache_hits"]
    prompt = list(range(40, 60))
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def cached(ids: list[int]) -> int:
        (out,) = llm.generate([{"prompt_token_ids": ids}], two, use_tqdm=False)
        return out.num_cached_tokens

    assert [cached(prompt), cached(prompt), cached(prompt[:17]), cached(prompt[:16]),
            cached(prompt[:8]), cached([9, *prompt[1:]])] == [0, 16, 16, 8, 0, 0]
    queries = llm.stats()["prefix_cache_queries"] - base[0]
    hits = llm.stats()["prefix_cache_hits"] - base[1]
    assert (queries, hits) == (20 + 20 + 17 + 16 + 8 + 20, 16 + 16 + 8)
    assert llm.reset_prefix_cache()
    assert cached(prompt) == 0  # forgotten


def test_a_tiny_hf_model_under_preemption():
    """Four rows in a pool that cannot hold them all: requests are preempted and resumed
    (finding their own pages when still cached), sharing a prefix, ids and logprobs as without
    the cache."""
    tight = SMALL | dict(num_pages=24, max_model_len=96)
    prompts = shared_prompts(1, 128, system=30)[:8]  # the fixture: 128 ids
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    llms = {on: LLM(HF_FIXTURES / "llama", enable_prefix_caching=on, **tight)
            for on in (False, True)}
    off = llms[False].generate(prompts, params, use_tqdm=False)
    on = llms[True].generate(prompts, params, use_tqdm=False)
    assert_same(off, on)
    assert llms[True].stats()["num_preemptions"] > 0
    assert llms[True].stats()["prefix_cache_hits"] > 0


def test_prompt_logprobs_skip_the_cache(stories):
    """A request asking for prompt logprobs computes its whole prompt (they come from its
    logits), and gets the same ones whether its prefix is cached or not."""
    llm = stories[True]
    prompt = {"prompt_token_ids": list(range(100, 130))}
    llm.generate([prompt], GREEDY, use_tqdm=False)  # its pages cached now
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    (with_cache,) = llm.generate([prompt], params, use_tqdm=False)
    (without,) = stories[False].generate([prompt], params, use_tqdm=False)
    assert with_cache.num_cached_tokens == 0
    assert [None if d is None else {t: lp.logprob for t, lp in d.items()}
            for d in with_cache.prompt_logprobs] == [
        None if d is None else {t: lp.logprob for t, lp in d.items()}
        for d in without.prompt_logprobs]


def test_usage_names_the_cached_prompt_tokens():
    """OpenAI's usage.prompt_tokens_details.cached_tokens, counted once per prompt as the
    prompt tokens are (n samples of a prompt are n choices); null unless the server enables
    it (vLLM's --enable-prompt-tokens-details)."""
    assert usage([40, 40, 30, 30], [5, 6, 7, 8], 2, [32, 0, 16, 16]) == {
        "prompt_tokens": 70, "completion_tokens": 26, "total_tokens": 96,
        "prompt_tokens_details": {"cached_tokens": 48}}
    assert usage([40], [5])["prompt_tokens_details"] is None


def test_the_demo_model_same_text_with_the_cache():
    """The built-in demo model (byte-level): code prompts that share their imports and a
    docstring give the same greedy text cache on and off, and the later ones hit."""
    head = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Run the tool.\"\"\"\n"
    prompts = [head + tail for tail in ("    path = ", "    for arg in argv:\n", "    if ",
                                        "    return ")]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    demo = dict(max_num_seqs=2, prefill_chunk_sizes=(64,), page_size=16, num_pages=40,
                max_num_batched_tokens=64, max_model_len=256)
    texts = {}
    for on in (False, True):
        llm = LLM(enable_prefix_caching=on, **demo)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one by one
        texts[on] = [o.outputs[0].text for o in outs]
        if on:  # each later prompt finds the full pages it shares with the ones before
            first = outs[0].prompt_token_ids
            for o in outs[1:]:
                ids = o.prompt_token_ids
                common = next(i for i, (a, b) in enumerate(zip(first, ids, strict=False))
                              if a != b)
                assert o.num_cached_tokens == min(common, len(ids) - 1) // 16 * 16 > 0
    assert texts[False] == texts[True]
