"""The real pretrained stories260K against its independent C reference, token for token."""

import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def stories(stories_dir):
    cases = json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]
    llm = LLM(stories_dir, page_size=4, prefill_chunk_sizes=(8,), max_num_seqs=8,
              max_num_batched_tokens=32, num_pages=512)
    return llm, cases


def _params(case):
    return SamplingParams(max_tokens=len(case["generated_ids"]), temperature=0.0, ignore_eos=True)


def test_greedy_ids_from_prompt_ids_batched(stories):
    llm, cases = stories
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                        [_params(c) for c in cases])
    for out, case in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == case["generated_ids"]
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_greedy_from_text_through_the_tokenizer(stories):
    llm, cases = stories
    for case in cases:
        out = llm.generate(case["prompt"], _params(case))[0]
        assert out.prompt_token_ids == case["prompt_ids"]
        assert out.outputs[0].token_ids == case["generated_ids"]
        assert case["prompt"] + out.outputs[0].text == case["text"]


def test_prompt_logprobs_agree_with_generation_logprobs(stories):
    """A prompt token's logprob equals the logprob the model gave it when it was generated."""
    llm, cases = stories
    case = cases[0]
    first = llm.generate({"prompt_token_ids": case["prompt_ids"]},
                         SamplingParams(max_tokens=12, temperature=0.0, logprobs=2))[0]
    ids = case["prompt_ids"] + first.outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": ids},
                         SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))[0]
    assert again.prompt_logprobs[0] is None
    prompt_lps = again.prompt_logprobs[len(case["prompt_ids"]):]
    for token, gen, lp in zip(first.outputs[0].token_ids, first.outputs[0].logprobs, prompt_lps,
                              strict=True):
        assert lp[token].rank == 1 == gen[token].rank  # greedy: the top token
        np.testing.assert_allclose(lp[token].logprob, gen[token].logprob, atol=1e-4)
        assert len(lp) == 3 and len(gen) == 2
