"""The real LLMEngine over the tests' fake runner (tests/fake_runner.py): stops, stop strings,
deltas, logprobs, abort and preemption, with tokens worked out by hand and no model compiled.

The model directory holds only a config.json and the demo's byte tokenizer, so token t < 256 is
the byte t: a prompt made by `prompt_for("A")` generates "ABCDEFG..." (the fake model's tokens
go up by one per position).
"""

import json
from types import SimpleNamespace

import pytest
from bpe_tokenizer import byte_level_bpe_hf
from fake_runner import FakeRunner, expected_output, fake_logprob, token_after

from jaxserve.config.engine import EngineConfig
from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import OutputProcessor
from jaxserve.llm import LLM
from jaxserve.request import Request, RequestOutputKind, RequestStatus, Samples, SamplingParams
from jaxserve.text.detokenizer import StreamDetokenizer, make_detokenizer
from jaxserve.text.tokenizer import ByteTokenizer, Tokenizer

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": ByteTokenizer.VOCAB_SIZE,
          "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": False,
          "bos_token_id": ByteTokenizer.BOS_ID, "eos_token_id": ByteTokenizer.EOS_ID,
          "dtype": "float32"}
KINDS = list(RequestOutputKind)
DELTA, CUMULATIVE, FINAL_ONLY = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                 RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fake-model")
    (path / "config.json").write_text(json.dumps(CONFIG))
    ByteTokenizer().save(path)
    return path


def make_engine(model_dir, num_pages=65, max_model_len=64, **overrides) -> LLMEngine:
    runner = FakeRunner(num_pages=num_pages, max_model_len=max_model_len, chunk_buckets=(16,))
    config = EngineConfig.from_overrides(**(dict(
        page_size=4, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_sizes=(16,))
        | overrides))
    engine = LLMEngine(model_dir, config, runner=runner)
    runner.scheduler = engine.scheduler  # the fake checks the scheduler's invariants too
    return engine


def prompt_for(first: str, length: int = 3) -> dict:
    """Prompt ids after which the fake model generates `first`, then the bytes after it."""
    head = [3] * (length - 1)
    last = (ord(first) - 3 - sum(head) - (length - 1)) % 97
    ids = [*head, last]
    assert token_after(ids, length - 1) == ord(first)
    return {"prompt_token_ids": ids}


def run(engine: LLMEngine, requests: dict[str, tuple[dict, SamplingParams]]):
    """Add the requests, step until all finish; every output of each, in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not outputs[out.request_id] or not outputs[out.request_id][-1].finished
            outputs[out.request_id].append(out)
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    return outputs


def gathered(outs):
    """A request's outputs as one: the last (cumulative, final) or the deltas added together."""
    first = outs[0]
    completion = first.outputs[0]
    if len(outs) == 1 or completion.token_ids is outs[-1].outputs[0].token_ids:
        return outs[-1]
    total = type(first)(first.request_id, first.prompt, first.prompt_token_ids,
                        [type(completion)(0, "", [])], prompt_logprobs=None)
    for out in outs:
        total.add(out)
    return total


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_stop_string_is_held_back_then_cut_and_the_tokens_after_it_dropped(model_dir,
                                                                             decode_steps):
    engine = make_engine(model_dir, decode_steps=decode_steps)
    params = SamplingParams(max_tokens=20, stop=["FGH", "zz"], logprobs=1, output_kind=DELTA)
    outs = run(engine, {"a": (prompt_for("A"), params)})["a"]
    texts = [o.outputs[0].text for o in outs]
    assert "".join(texts) == "ABCDE"
    ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert bytes(ids) == b"ABCDEFGH"  # up to the token that completed it, none after
    lps = [lp for o in outs for lp in o.outputs[0].logprobs]
    assert [lp[t].logprob for t, lp in zip(ids, lps, strict=True)] == [
        fake_logprob(t) for t in ids]
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", "FGH")
    assert last.cumulative_logprob == pytest.approx(sum(map(fake_logprob, ids)))
    if decode_steps == 1:  # one token per step: text that could begin "FGH" waits
        assert texts == ["", "", "A", "B", "C", "D", "E", ""]
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_every_output_kind_tells_the_same_story(model_dir, decode_steps):
    """DELTA outputs added together, the last CUMULATIVE output and the one FINAL_ONLY output
    agree, whatever the stop, and whatever the steps' grouping of tokens."""
    cases = {
        "stop-string": dict(stop=["KL"], logprobs=2),
        "kept-stop-string": dict(stop=["KL"], include_stop_str_in_output=True),
        "stop-token": dict(stop_token_ids=[ord("E")], logprobs=0),
        "kept-stop-token": dict(stop_token_ids=[ord("E")], include_stop_str_in_output=True),
        "length": dict(max_tokens=7, prompt_logprobs=1),
        "string-on-the-last-token": dict(max_tokens=6, stop=["EF"]),
    }
    want = {"stop-string": ("ABCDEFGHIJ", b"ABCDEFGHIJKL", "stop", "KL"),
            "kept-stop-string": ("ABCDEFGHIJKL", b"ABCDEFGHIJKL", "stop", "KL"),
            "stop-token": ("ABCD", b"ABCDE", "stop", ord("E")),
            "kept-stop-token": ("ABCDE", b"ABCDE", "stop", ord("E")),
            "length": ("ABCDEFG", b"ABCDEFG", "length", None),
            "string-on-the-last-token": ("ABCD", b"ABCDEF", "stop", "EF")}
    results = {}
    for kind in KINDS:
        engine = make_engine(model_dir, decode_steps=decode_steps)
        requests = {name: (prompt_for("A", 5), SamplingParams(**({"max_tokens": 30} | p),
                                                             output_kind=kind))
                    for name, p in cases.items()}
        outs = run(engine, requests)
        if kind is FINAL_ONLY:
            assert all(len(o) == 1 and o[0].finished for o in outs.values())
        results[kind] = {name: gathered(o) for name, o in outs.items()}
    for name, (text, ids, finish, reason) in want.items():
        got = [results[kind][name] for kind in KINDS]
        for out in got:
            c = out.outputs[0]
            assert (c.text, bytes(c.token_ids), c.finish_reason, c.stop_reason) == (
                text, ids, finish, reason), (name, out)
            assert out.finished
            assert (c.logprobs is None) == (cases[name].get("logprobs") is None)
            if c.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
            assert (out.prompt_logprobs is None) == ("prompt_logprobs" not in cases[name])
        assert len({repr(o.outputs[0].logprobs) for o in got}) == 1
        assert len({repr(o.prompt_logprobs) for o in got}) == 1


def test_prompt_logprobs_come_once_in_the_first_delta(model_dir):
    engine = make_engine(model_dir)
    prompt = prompt_for("A", 40)  # three prompt chunks of at most 16
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, output_kind=DELTA)
    outs = run(engine, {"a": (prompt, params)})["a"]
    first, *rest = outs
    ids = prompt["prompt_token_ids"]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(ids)
    for t, lp in zip(ids[1:], first.prompt_logprobs[1:], strict=True):
        assert lp[t].logprob == fake_logprob(t) and lp[t].rank == 1
        assert len(lp) == 2  # the token and the second of the top 2
    assert rest and all(o.prompt_logprobs is None for o in rest)


def test_eos_length_and_max_model_len(model_dir):
    engine = make_engine(model_dir, max_model_len=40)
    eos = ByteTokenizer.EOS_ID
    outs = run(engine, {
        "to-the-limit": (prompt_for("A", 10), SamplingParams(max_tokens=None)),
        "max-tokens": (prompt_for("A"), SamplingParams(max_tokens=5)),
        "stop-ids": (prompt_for("A"), SamplingParams(stop_token_ids=[eos, ord("C")])),
    })
    limit = outs["to-the-limit"][-1].outputs[0]
    assert len(limit.token_ids) == 30 and limit.finish_reason == "length"
    assert len(outs["to-the-limit"]) == 30  # CUMULATIVE: one output per step
    assert outs["max-tokens"][-1].outputs[0].text == "ABCDE"
    stopped = outs["stop-ids"][-1].outputs[0]
    assert (stopped.text, stopped.stop_reason) == ("AB", ord("C"))


def test_cumulative_outputs_share_the_requests_lists(model_dir):
    """A CUMULATIVE output's ids are the request's own list, not a copy per step: the host's
    cost per token does not grow with the output."""
    engine = make_engine(model_dir)
    outs = run(engine, {"a": (prompt_for("A"), SamplingParams(max_tokens=12))})["a"]
    assert len({id(o.outputs[0].token_ids) for o in outs}) == 1
    assert bytes(outs[0].outputs[0].token_ids) == b"ABCDEFGHIJKL"


def test_abort_mid_run_and_an_id_reused_while_its_step_is_in_flight(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=10, output_kind=DELTA)
    for rid in "abc":
        engine.add_request(rid, prompt_for("A"), params)
    seen = {rid: [] for rid in "abcx"}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.abort("b") and not engine.abort("b")
    engine.add_request("b", prompt_for("a"), SamplingParams(max_tokens=3, output_kind=DELTA))
    after_abort = len(seen["b"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert "".join(o.outputs[0].text for o in seen["a"]) == "ABCDEFGHIJ"
    # the new "b" got only its own tokens, none of the aborted one's step in flight
    assert "".join(o.outputs[0].text for o in seen["b"][after_abort:]) == "abc"
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_preemption_changes_no_output(model_dir):
    """A small pool preempts (recompute); every request still gets what it gets alone."""
    engine = make_engine(model_dir, num_pages=13, max_model_len=48)
    requests = {f"r{i}": (prompt_for(chr(ord("A") + i), 9), SamplingParams(
        max_tokens=20, stop=["zz"], output_kind=DELTA)) for i in range(4)}
    outs = run(engine, requests)
    assert engine.stats()["num_preemptions"] > 0
    for rid, (prompt, _) in requests.items():
        ids = [t for o in outs[rid] for t in o.outputs[0].token_ids]
        assert ids == expected_output(prompt["prompt_token_ids"], 20)
        assert "".join(o.outputs[0].text for o in outs[rid]) == bytes(ids).decode()


def test_a_runner_without_the_interface_is_named(model_dir):
    class Partial:
        num_pages, max_model_len = 9, 64

        def dispatch(self, out): ...

    with pytest.raises(TypeError, match=r"runner Partial lacks chunk_buckets, "
                       r"num_compilations_after_warmup, warmup, finish, collect of the engine's"):
        LLMEngine(model_dir, EngineConfig(), runner=Partial())


def test_n_samples_through_llm_generate(model_dir):
    llm = LLM.__new__(LLM)
    llm.engine = make_engine(model_dir)
    out = llm.generate([prompt_for("A")], SamplingParams(n=3, max_tokens=4, stop=["D"]),
                       use_tqdm=False)[0]
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (i, "ABC", "stop") for i in range(3)]
    deltas = llm.generate([prompt_for("A")], SamplingParams(max_tokens=5, output_kind=DELTA),
                          use_tqdm=False)[0]
    assert (deltas.outputs[0].text, bytes(deltas.outputs[0].token_ids)) == ("ABCDE", b"ABCDE")


def test_a_stop_string_ending_in_byte_tokens_stops_at_its_last_byte(stories_dir):
    """stories260K spells 日 as three byte tokens: the stop string is found when its last byte
    arrives, not when a later ordinary token ends the byte run (7 tokens late here)."""
    tokenizer = Tokenizer.from_dir(stories_dir)
    generated = tokenizer.encode("日本語 is nice", add_special_tokens=False)
    assert generated[1:4] == tokenizer.encode("日", add_special_tokens=False)[1:]  # ▁ + 3 bytes
    request = Request("byte-stop", tokenizer.encode("Hello"), SamplingParams(stop=["日"]), 0.0,
                      seed=0, max_len=64, eos_token_ids=tokenizer.eos_token_ids)
    request.set_status(RequestStatus.RUNNING)  # as the scheduler runs it; never queued here
    scheduler = SimpleNamespace(
        clock=lambda: 0.0,
        finish=lambda r, status, reason=None: (r.set_status(status),
                                               setattr(r, "stop_reason", reason)))
    processor = OutputProcessor(tokenizer)
    for token in generated:  # one token at a time, as single-step decode delivers them
        step = SchedulerOutput([ScheduledChunk(request, 0, 1, 1)])
        processor.update(scheduler, step, {"byte-stop": Samples([token])})
        if request.status.finished:
            break
    assert request.stop_reason == "日" and request.output_ids == generated[:4]
    assert processor.output(request).outputs[0].text == " "


def test_text_through_decode_stream_on_a_byte_level_bpe_model(tmp_path):
    """A byte-level BPE tokenizer's text comes from DecodeStream: the deltas add up to the
    decode of the kept ids, and a stop string cuts it there, whatever the output kind."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {"vocab_size": 400}))
    byte_level_bpe_hf().save(str(tmp_path / "tokenizer.json"))
    prompt = prompt_for("A", 4)
    tokenizer = make_engine(tmp_path).tokenizer
    assert isinstance(make_detokenizer(tokenizer), StreamDetokenizer)
    full = expected_output(prompt["prompt_token_ids"], 30)
    text = tokenizer.decode(full)
    stop = text[12:15]
    cut = text.index(stop)
    for kind in KINDS:
        engine = make_engine(tmp_path, decode_steps=3)
        outs = run(engine, {"all": (prompt, SamplingParams(max_tokens=30, output_kind=kind)),
                            "stop": (prompt, SamplingParams(max_tokens=30, stop=[stop],
                                                            output_kind=kind))})
        whole, stopped = (gathered(outs[rid]).outputs[0] for rid in ("all", "stop"))
        assert (whole.text, whole.token_ids) == (text, full)
        assert stopped.text == text[:cut] and stopped.stop_reason == stop
        ids = stopped.token_ids  # up to the first token whose text completes the stop string
        assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])


def test_min_tokens_hold_off_every_stop_but_the_length(model_dir):
    """As vLLM counts: a stop token may be the min_tokens-th token, a stop string must end
    past it; the length limit still ends the output."""
    engine = make_engine(model_dir)
    outs = run(engine, {
        "token-early": (prompt_for("A"), SamplingParams(max_tokens=8, min_tokens=3,
                                                       stop_token_ids=[ord("B"), ord("F")])),
        "token-at-min": (prompt_for("A"), SamplingParams(max_tokens=8, min_tokens=2,
                                                        stop_token_ids=[ord("B")])),
        "string": (prompt_for("A"), SamplingParams(max_tokens=8, min_tokens=2,
                                                  stop=["AB", "BC", "CD"])),
        "length": (prompt_for("A"), SamplingParams(max_tokens=4, min_tokens=4,
                                                  stop_token_ids=[ord("C")])),
        # a short stop string that ended within min_tokens is no stop later, whatever the
        # longer stop strings beside it
        "string-early": (prompt_for("A"), SamplingParams(max_tokens=8, min_tokens=3,
                                                        stop=["BC", "XYZW"])),
    })
    final = {rid: o[-1].outputs[0] for rid, o in outs.items()}
    assert (final["token-early"].text, final["token-early"].stop_reason) == ("ABCDE", ord("F"))
    assert (final["token-at-min"].text, final["token-at-min"].stop_reason) == ("A", ord("B"))
    assert (final["string"].text, final["string"].stop_reason) == ("A", "BC")  # not "AB"
    assert (final["length"].text, final["length"].finish_reason) == ("ABCD", "length")
    assert (final["string-early"].text, final["string-early"].finish_reason) == ("ABCDEFGH",
                                                                                "length")
    with pytest.raises(ValueError, match="min_tokens must be an integer from 0 to max_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


@pytest.mark.parametrize("kind", KINDS)
def test_the_text_held_back_stays_short_whatever_the_output_length(model_dir, kind):
    """What a step costs the host per token does not grow with the output: the text searched
    for stop strings is what may still begin one, plus the step's new text."""
    engine = make_engine(model_dir, max_model_len=400, num_pages=120, decode_steps=2)
    params = SamplingParams(max_tokens=390, stop=["never", "zzz"], output_kind=kind)
    request = engine.add_request("a", prompt_for("A", 2), params)
    longest = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if kind is DELTA:
                assert len(out.outputs[0].token_ids) <= 2
        if request.output_state is not None:
            longest = max(longest, len(request.output_state.held))
    assert len(request.output_ids) == 390 and longest <= len("never") - 1 + 2


def test_cumulative_outputs_through_the_async_engine_are_snapshots(model_dir):
    """A cumulative output's lists are the request's own, which the engine thread goes on
    appending to; AsyncEngine hands the caller's event loop copies, so an output read late
    still matches its text. The engine reads no third step before the first output is read,
    so the request cannot finish before it (however the threads are scheduled), and two more
    steps are read (tokens appended) before that output is checked."""
    import asyncio
    import threading
    import time

    from jaxserve.engine.async_engine import AsyncEngine

    engine = make_engine(model_dir)
    collect, collected, first_read = engine.runner.collect, [], threading.Event()

    def gated(flight):  # on the engine thread
        if len(collected) >= 2:
            assert first_read.wait(60)
        result = collect(flight)
        collected.append(flight)
        return result

    engine.runner.collect = gated

    async def main():
        async_engine = AsyncEngine(engine)
        stream = await async_engine.add_request("a", prompt_for("A"),
                                                SamplingParams(max_tokens=40))
        held = []  # each output read, with its text and length as read
        async for out in stream:
            completion = out.outputs[0]
            held.append((completion, completion.text, len(completion.token_ids), out.finished))
            if len(held) == 1:
                read_at = len(collected)
                first_read.set()
                deadline = time.monotonic() + 60
                while len(collected) < read_at + 2:  # the engine appends to the request
                    assert time.monotonic() < deadline, len(collected)
                    await asyncio.sleep(0.001)
            if out.finished:
                break
        await async_engine.shutdown()
        return held

    held = asyncio.run(main())
    assert len(held) > 1 and not held[0][3]
    assert all(len(c.token_ids) == n and bytes(c.token_ids).decode() == text
               for c, text, n, _ in held)
