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


def test_a_bf16_kv_pool_gives_the_references_greedy_ids_whatever_the_batch(stories_dir):
    # kv_cache_dtype="bfloat16": keys and values rounded to bfloat16, held as their bits, half
    # the pool's bytes; the tiny real model's greedy ids still match the C reference's, batched
    # or one at a time (the kernels' sums do not depend on the batch)
    cases = json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]
    llm = LLM(stories_dir, page_size=4, prefill_chunk_sizes=(8,), max_num_seqs=8,
              max_num_batched_tokens=32, num_pages=512, kv_cache_dtype="bfloat16")
    runner = llm.engine.runner
    assert runner.kv.pools[0].dtype == np.uint16 and runner.kv_dtype_name == "bfloat16"
    m = runner.model_config
    assert runner.kv_bytes_per_page == 2 * m.num_layers * 4 * m.num_kv_heads * m.head_dim * 2
    batched = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                           [_params(c) for c in cases])
    for out, case in zip(batched, cases, strict=True):
        assert out.outputs[0].token_ids == case["generated_ids"]
        alone = llm.generate({"prompt_token_ids": case["prompt_ids"]}, _params(case))[0]
        assert alone.outputs[0].token_ids == case["generated_ids"]


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
    # each entry names its token, leading space included, as the text spells it
    names = [gen[token].decoded_token for token, gen in zip(first.outputs[0].token_ids,
                                                            first.outputs[0].logprobs, strict=True)]
    assert "".join(names).strip() == first.outputs[0].text.strip()
    assert all(isinstance(x.decoded_token, str) for gen in first.outputs[0].logprobs
               for x in gen.values())


def test_stop_strings_and_stop_tokens(stories):
    llm, cases = stories
    case = cases[0]
    full = case["text"][len(case["prompt"]):]  # ", there was a little girl named Lily. ..."
    out = llm.generate(case["prompt"], SamplingParams(max_tokens=60, temperature=0.0,
                                                      stop=["Lily", "zzz"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Lily"
    assert out.text == full[:full.index("Lily")]
    stop_id = case["generated_ids"][5]
    out = llm.generate(case["prompt"], SamplingParams(max_tokens=60, temperature=0.0,
                                                      stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == case["generated_ids"][:6]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # the stop token's text stays in with include_stop_str_in_output, as vLLM keeps it
    kept = llm.generate(case["prompt"], SamplingParams(
        max_tokens=60, temperature=0.0, stop_token_ids=[stop_id],
        include_stop_str_in_output=True))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert kept.token_ids == out.token_ids and kept.stop_reason == stop_id
    assert kept.text.startswith(out.text) and len(kept.text) > len(out.text)
    assert kept.text.strip() == tokenizer.decode(case["generated_ids"][:6]).strip()


def test_stop_strings_end_the_same_token_whatever_the_steps(stories, stories_dir):
    """Four decode steps per dispatch deliver tokens in fours: the first token completing a
    stop string still ends the output, the tokens after it are dropped, and a stop token's text
    is left out, as one step at a time gives."""
    llm, cases = stories
    four = LLM(stories_dir, page_size=4, prefill_chunk_sizes=(8,), max_num_seqs=8,
               max_num_batched_tokens=32, num_pages=512, decode_steps=4)
    params = [SamplingParams(max_tokens=60, temperature=0.0, stop=["Lily", "little", "was a"],
                             logprobs=1),
              SamplingParams(max_tokens=60, temperature=0.0, stop=["zzz"],
                             stop_token_ids=[cases[0]["generated_ids"][5]])]
    for p in params:
        prompts = [c["prompt"] for c in cases]
        one_step, four_steps = (m.generate(prompts, p) for m in (llm, four))
        for a, b in zip(one_step, four_steps, strict=True):
            a, b = a.outputs[0], b.outputs[0]
            assert (a.text, a.token_ids, a.stop_reason) == (b.text, b.token_ids, b.stop_reason)
            assert len(b.token_ids) == len(b.logprobs or b.token_ids)
    tokenizer = llm.get_tokenizer()
    out = one_step[0].outputs[0]  # ended by the stop token: its text is not in the output
    assert out.stop_reason == out.token_ids[-1]
    assert tokenizer.decode(out.token_ids[:-1]).strip() == out.text.strip()


def test_bad_requests_are_value_errors_naming_the_field(stories):
    llm, _ = stories
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match=rf"prompt \(3 tokens\) \+ max_tokens \({limit}\) exceeds"):
        llm.engine.add_request(None, {"prompt_token_ids": [1, 2, 3]},
                               SamplingParams(max_tokens=limit))  # as the server must
    for bad, message in [([], "sampling_params has 0 entries for 2 prompts"),
                         ({"temperature": 0}, "sampling_params must be a SamplingParams"),
                         ((SamplingParams(), 5), "sampling_params must be a SamplingParams")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["a b", "c d"], bad)
    with pytest.raises(ValueError, match="prompts must be a string, a dict"):
        llm.generate(5)
    with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list of ids"):
        llm.generate({"prompt_token_ids": [1, 99999]})
    with pytest.raises(ValueError, match="logprobs 50 exceeds max_top_logprobs 20"):
        llm.generate("hi", SamplingParams(logprobs=50))
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
        SamplingParams(top_p=0.0)
    for field, value in [("temperature", 10**400), ("temperature", "0.5"), ("priority", "high"),
                         ("slo_ms", float("inf")), ("max_tokens", True), ("ignore_eos", "yes"),
                         ("stop_token_ids", 5)]:
        with pytest.raises(ValueError, match=rf"^{field} must be"):
            SamplingParams(**{field: value})
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    # nothing was left behind by the rejected requests
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_a_prompt_that_encodes_to_nothing_is_a_value_error(stories, monkeypatch):
    """A tokenizer without BOS encodes "" to no tokens: an error, not a request that never runs
    (and the call's earlier prompt, already queued, is withdrawn)."""
    llm, _ = stories
    encode = llm.engine.tokenizer.encode
    monkeypatch.setattr(llm.engine.tokenizer, "encode",
                        lambda text, **kwargs: [] if text == "" else encode(text, **kwargs))
    with pytest.raises(ValueError, match="prompt encodes to no tokens"):
        llm.generate(["Once", ""])
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_a_text_prompt_past_the_models_vocabulary_is_a_value_error(stories, monkeypatch):
    """A tokenizer with more tokens than the model's embedding (an id past the table would
    embed as NaN and poison the pages it writes): refused when the request is added."""
    llm, _ = stories
    encode = llm.engine.tokenizer.encode
    monkeypatch.setattr(llm.engine.tokenizer, "encode",
                        lambda text, **kwargs: [*encode(text, **kwargs), 512])
    with pytest.raises(ValueError, match="token id 512, outside the model's vocabulary of 512"):
        llm.generate("Once")
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_everything_at_once(stories):
    llm, cases = stories
    engine = llm.engine
    ids = [engine.add_request(None, c["prompt"], _params(c)).request_id for c in cases]
    for _ in range(6):
        engine.step()
    assert engine.abort(ids[1]) and not engine.abort(ids[1])
    engine.abort(ids[3])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in (ids[1], ids[3])
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_a_request_id_reused_while_its_aborted_step_is_in_flight(stories):
    """The aborted request's prompt logprobs and tokens, read one step later, never land on the
    new request with the same id."""
    llm, cases = stories
    engine = llm.engine
    engine.add_request("x", cases[0]["prompt"], SamplingParams(max_tokens=4, prompt_logprobs=0))
    engine.step()  # its first prompt chunk is in flight
    assert engine.abort("x")
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, short)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3]]
    assert outs[0].outputs[0].token_ids == llm.generate(
        {"prompt_token_ids": [1, 2, 3]}, short)[0].outputs[0].token_ids
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_top_k_past_the_vocabulary_is_no_cut(stories):
    llm, cases = stories
    params = dict(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    huge, plain = (llm.generate(cases[0]["prompt"], SamplingParams(**params, top_k=k))[0]
                   for k in (2**31, None))
    assert huge.outputs[0].token_ids == plain.outputs[0].token_ids


def test_offline_requests_as_vllm_users_write_them(stories):
    llm, cases = stories
    case = cases[0]
    limit = llm.engine.max_model_len
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    # a max_tokens past the context ends at max_model_len ("length"), as vLLM's LLM does
    long = {"prompt_token_ids": case["prompt_ids"] * (limit // len(case["prompt_ids"]))}
    room = limit - len(long["prompt_token_ids"])
    out = llm.generate(long, SamplingParams(max_tokens=room + 50, temperature=0.0,
                                            ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == room and out.finish_reason == "length"
    # {"prompt": text} (vLLM's TextPrompt), a tuple of params, numpy ids
    by_text = llm.generate({"prompt": case["prompt"]}, greedy)[0]
    assert by_text.prompt_token_ids == case["prompt_ids"]
    assert by_text.outputs[0].token_ids == case["generated_ids"][:6]
    by_numpy = llm.generate([{"prompt_token_ids": list(np.asarray(case["prompt_ids"]))}] * 2,
                            (greedy, greedy))
    assert [o.outputs[0].token_ids for o in by_numpy] == [case["generated_ids"][:6]] * 2
    # cumulative_logprob: the sum of the sampled tokens' logprobs, when logprobs are asked for
    sampled = llm.generate(case["prompt"], SamplingParams(max_tokens=8, seed=3, logprobs=2))[0]
    c = sampled.outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(
        lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)))
    assert c.cumulative_logprob < 0
    assert llm.generate(case["prompt"], greedy)[0].outputs[0].cumulative_logprob is None


def test_generate_without_params_takes_the_models_defaults(stories, monkeypatch):
    llm, cases = stories
    case = cases[0]
    # stories260K's generation_config.json sets no sampling defaults: vLLM's SamplingParams()
    assert llm.get_default_sampling_params() == SamplingParams()
    monkeypatch.setattr(llm.engine, "sampling_defaults", {"temperature": 0.0, "max_tokens": 7})
    out = llm.generate(case["prompt"])[0].outputs[0]
    assert out.token_ids == case["generated_ids"][:7]


def test_generation_config_stop_ids_are_named_as_stop_reasons(stories):
    # stories260K: the tokenizer's EOS is 2; generation_config.json also stops on 1 (BOS, where
    # the reference implementation stops): vLLM reports 1 as the stop reason, 2 as None
    llm, _ = stories
    assert llm.engine.eos_token_ids == {1, 2} and llm.engine.named_eos_ids == {1}
