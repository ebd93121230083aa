"""Speculative decoding's host half, on the fake runner (no jax): verification rows, the roll
back of rejected proposals, the counters, speculation turning itself off for a large batch, the
prompt-lookup proposer and the option's errors."""

import numpy as np
import pytest
from fake_runner import (
    Driver,
    expected,
    make_request,
    mixed_requests,
    run,
    small_scheduler,
    token_after,
)

from jaxserve.config.engine import EngineConfig, SpeculativeConfig
from jaxserve.core.scheduler import BATCHING_MODES
from jaxserve.spec.ngram import NgramProposer, propose_ngram


class HalfRightProposer:
    """Proposes the fake model's own next tokens, but gets one wrong (0: never sampled) at an
    index that moves with the context's length, and proposes nothing at every fourth length:
    every accepted run length from 0 to k shows up."""

    def propose(self, request, k):
        known = len(request.prompt_ids) + len(request.output_ids)
        if known % 4 == 0:
            return []
        tokens = [token_after(request.prompt_ids, known - 1 + j) for j in range(k)]
        wrong = known % (k + 2)
        if wrong < k:
            tokens[wrong] = 0
        return tokens


def spec_scheduler(k=3, spec_max_batch=None, **kw):
    return small_scheduler(num_spec_tokens=k, proposer=HalfRightProposer(),
                           spec_max_batch=spec_max_batch, **kw)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("batching", BATCHING_MODES)
def test_outputs_unchanged_by_speculation_in_every_mode_with_preemption(batching, overlap):
    want = expected(mixed_requests())
    for num_pages in (65, 12):  # a pool small enough to preempt too
        s = spec_scheduler(batching=batching, num_pages=num_pages, max_batch_size=3,
                           max_chunk_tokens=8)
        result = run(s, mixed_requests(), overlap=overlap)
        assert result.outputs == want
        rows = [r for entry in result.log for r in entry.rows if r.num_samples > 1]
        assert rows, "nothing was verified"
        if num_pages == 12 and batching == "continuous":
            assert s.num_preemptions > 0


@pytest.mark.parametrize("budget", [5, 6, 9])
def test_proposals_fit_the_budget_and_chunked_prompts(budget):
    """A tight budget trims the drafts (decodes first, then prompt chunks of what is left)."""
    s = spec_scheduler(k=4, max_num_batched_tokens=budget, max_chunk_tokens=4)
    result = run(s, mixed_requests())
    assert result.outputs == expected(mixed_requests())
    assert all(sum(r.num_tokens for r in entry.rows) <= budget for entry in result.log)


def test_a_lone_request_verifies_and_rolls_back_by_hand():
    """One request, k = 3: each verification row feeds its newest token and the draft, keeps
    the drafts up to the first wrong one plus the model's own token there, and its computed
    tokens come back to the tokens it kept."""
    request = make_request("a", 5, 20)
    s = spec_scheduler(k=3)
    s.add_request(request)
    d = Driver(s)
    entry = d.step()  # the prompt, overlapped (nothing ran yet to speculate)
    assert [(r.start, r.num_tokens, r.num_samples) for r in entry.rows] == [(0, 5, 1)]
    d.step()  # reads it, dispatching nothing: the proposals need its token on the host
    assert len(d.log) == 1 and d.inflight is None and len(request.output_ids) == 1
    kept_per_pos = [0, 0, 0]
    drafts = draft_tokens = 0
    while d.busy():
        known = len(request.prompt_ids) + len(request.output_ids)
        proposal = HalfRightProposer().propose(request, min(3, request.remaining_tokens - 1))
        entry = d.step()
        (row,) = entry.rows
        assert (row.start, row.num_tokens) == (known - 1, 1 + len(proposal))
        right = next((j for j, t in enumerate(proposal) if t == 0), len(proposal))
        assert len(request.output_ids) + len(request.prompt_ids) == min(known + right + 1,
                                                                         request.max_len)
        assert request.num_computed_tokens == known + right or request.status.finished
        drafts += bool(proposal)
        draft_tokens += len(proposal)
        for j in range(right):
            kept_per_pos[j] += 1
    assert request.output_ids == expected([request])["a"]
    stats = s.stats()
    assert stats["spec_decode_num_drafts"] == drafts
    assert stats["spec_decode_num_draft_tokens"] == draft_tokens
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == kept_per_pos
    assert stats["spec_decode_num_accepted_tokens"] == sum(kept_per_pos)


def test_stops_inside_an_accepted_run_end_the_request_there():
    a = make_request("a", 5, 30)
    stop = expected([a])["a"][6]
    requests = [make_request("a", 5, 30, eos=frozenset({stop}))]
    result = run(spec_scheduler(k=4), requests)
    assert result.outputs == {"a": expected([a])["a"][:7]}
    assert result.finish_reasons == {"a": "stop"}


def test_speculation_turns_off_for_a_large_batch_and_overlaps_again():
    """More running than spec_max_batch: plain decode rows, overlapped; fewer: verification
    rows again, each read before the next is scheduled."""
    requests = [make_request(f"r{i}", 3 + i, 6 + 3 * i, arrival=i / 1000) for i in range(4)]
    s = spec_scheduler(k=2, spec_max_batch=2, max_num_seqs=4)
    for r in requests:
        s.add_request(r)
    d = Driver(s)
    overlapped = verified_when_large = verified_when_small = 0
    while d.busy():
        running, logged = len(s.running), len(d.log)
        entry = d.step()
        verifying = any(r.num_samples > 1 and r.num_tokens == r.num_samples
                        for r in entry.rows)
        if running > 2:
            verified_when_large += verifying
            overlapped += d.inflight is not None
        elif running and len(d.log) > logged:
            verified_when_small += verifying
            assert d.inflight is None
    assert verified_when_large == 0 and overlapped > 0 and verified_when_small > 0
    assert {r.request_id: r.output_ids for r in requests} == expected(requests)


def test_rows_with_sampler_controls_and_static_batches_still_decode():
    requests = [make_request("a", 5, 9, presence_penalty=0.5), make_request("b", 7, 9)]
    s = spec_scheduler(k=3, batching="static")
    result = run(s, requests)
    assert result.outputs == expected(requests)
    for entry in result.log:
        for row in entry.rows:
            if row.request_id == "a":
                assert row.num_samples <= 1  # never proposes: its masks follow each token


# -- the prompt-lookup proposer ----------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ctx = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert propose_ngram(ctx, 1, 3, 2) == [7, 8]  # the latest "1 2 3"
    assert propose_ngram(ctx, 1, 3, 9) == [7, 8, 1, 2, 3]  # to the end of the context
    ctx = np.array([4, 2, 3, 5, 6, 1, 2, 3, 7, 8, 9, 2, 3])
    assert propose_ngram(ctx, 2, 3, 1) == [7]  # "2 3" (no earlier "9 2 3")
    assert propose_ngram(ctx, 3, 3, 4) == []
    assert propose_ngram(np.array([5]), 1, 2, 3) == []
    assert propose_ngram(np.array([5, 5]), 1, 2, 3) == [5]


def test_ngram_proposer_reads_prompt_and_output():
    r = make_request("a", [10, 11, 12, 13, 14, 10, 11], 8)
    r.output_ids = [12]
    assert NgramProposer(2, 3).propose(r, 3) == [13, 14, 10]
    assert NgramProposer(2, 3).propose(r, 0) == []


# -- the option ---------------------------------------------------------------------------------


def test_speculative_config_defaults_and_errors():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert cfg.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=5, prompt_lookup_max=5,
        disable_by_batch_size=8)
    assert SpeculativeConfig(model="draft", num_speculative_tokens=2).method == "draft_model"
    assert EngineConfig(speculative_config='{"num_speculative_tokens": 2, '
                        '"prompt_lookup_max": 3}').speculative_config.prompt_lookup_min == 3
    for bad, field in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "draft": 1}, "unknown"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
                       ({"num_speculative_tokens": 2, "disable_by_batch_size": 0},
                        "disable_by_batch_size"),
                       ("{not json", "JSON"), (3, "mapping")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(speculative_config=bad)


def test_the_cli_flag_takes_json_and_refuses_bad_values_before_loading(capsys):
    from jaxserve.cli import main

    for text, message in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                          ('{"method": "ngram", "num_speculative_tokens": 99}',
                           "num_speculative_tokens"), ("ngram", "JSON object")]:
        assert main(["generate", "/nonexistent", "--prompt", "hi",
                     "--speculative-config", text]) == 2
        err = capsys.readouterr().err
        assert "speculative_config" in err and message in err
