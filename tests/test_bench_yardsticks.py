"""Yardsticks run at tiny sizes: issue 29's bench/compile_time.py (compile seconds, layers
scanned and unrolled) and bench/host_overhead.py (the host's cost per engine iteration), issue
31's bench/prefix_caching.py (cache on against off), issue 54's bench/lora.py (adapters in the
mix)."""

from bench_scripts import ROOT, _load


def test_compile_time_bench_lowers_from_abstract_shapes_and_times_both_layer_forms(capsys):
    """bench/compile_time.py compiles the steps from abstract shapes, layers scanned and
    unrolled, and (--run-steps) times both forms' decode step on real weights."""
    out = _load(ROOT / "bench" / "compile_time.py").main(["--quick", "--run-steps", "2",
                                                          "--layers", "1,3"])
    for form in ("scan", "unrolled"):
        for layers in (1, 3):
            row = out[f"llama-20m x{layers} {form}"]
            assert row["decode_s"] > 0 and row["prefill_s"] > 0 and row["decode_ms"] > 0
        assert out[f"ratio {form}"] > 0
    assert "3 layers compile" in capsys.readouterr().out


def test_host_overhead_bench_splits_an_iteration_over_the_stand_in_device():
    """bench/host_overhead.py: the real engine over a stand-in device whose decode steps take a
    set time; every phase it names is timed, the device waited on, idle below 1, every measured
    iteration ran every row (measure raises otherwise), and the one long request's halves are
    compared."""
    bench = _load(ROOT / "bench" / "host_overhead.py")
    row = bench.measure(seqs=4, context=48, step_ms=2.0, steps=6)
    phases = row["host_us_by_phase"]
    assert set(phases) == {*bench.PHASES, "other"}
    assert all(phases[k] > 0 for k in ("schedule", "batch", "dispatch", "collect", "output"))
    assert row["wait_us_per_iteration"] > 0
    assert 0 <= row["device_idle_share"] < 1
    long = bench.long_request(tokens=2100, step_ms=0.1)
    assert long["host_ms_first_1024"] > 0 and long["last_over_first"] > 0


def test_host_overhead_bench_detokenizes_with_a_tokenizer(stories_dir):
    """--tokenizer: the model takes the tokenizer's vocabulary, and the stand-in "samples" a
    story's tokens, which the requests' DELTA outputs spell."""
    bench = _load(ROOT / "bench" / "host_overhead.py")
    engine, _, _ = bench.build(2, 16, 0.1, tokenizer=stories_dir)
    assert engine.tokenizer is not None and engine.runner.model_config.vocab_size == 512
    params = bench.SamplingParams(max_tokens=12, ignore_eos=True,
                                  output_kind=bench.RequestOutputKind.DELTA)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 19))}, params)
    text, out_ids = "", []
    while engine.has_unfinished_requests():
        for o in engine.step():
            text += o.outputs[0].text
            out_ids += o.outputs[0].token_ids
    # the first token is the prompt's (the real model's), then the story's from position 17
    ids = engine.tokenizer.encode(bench.TEXT, False)
    assert out_ids[1:] == ids[17:28]
    assert text.endswith(engine.tokenizer.decode(ids[17:28]))
    row = bench.measure(seqs=2, context=16, step_ms=2.0, steps=4, tokenizer=stories_dir)
    assert row["host_us_by_phase"]["output"] > 0


def test_prefix_caching_bench_compares_on_and_off_on_one_engine(stories_dir):
    """bench/prefix_caching.py: the open-loop workloads and the closed-loop chat, cache off then
    on, on one engine: the same tokens, hits only with the cache."""
    from jaxserve.benchmarks.datasets import prefix_repetition_samples
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    bench = _load(ROOT / "bench" / "prefix_caching.py")
    engine = LLMEngine(stories_dir, EngineConfig.from_overrides(
        max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_sizes=(32,), page_size=8,
        num_pages=64, max_model_len=128))
    samples = prefix_repetition_samples(6, 24, 4, 2, 3, 512)
    off, on = bench.measure(engine, samples, False), bench.measure(engine, samples, True)
    assert off["token_ids"] == on["token_ids"] and off["hit_rate"] == 0 < on["hit_rate"]
    off, on = (bench.chat(engine, cache, 6, 3, 8, 4, 2) for cache in (False, True))
    assert off["token_ids"] == on["token_ids"] and len(on["token_ids"]) == 6
    assert off["hit_rate"] == 0 < on["hit_rate"] and on["mean_ttft_ms"] > 0
    # chat_prefixed: a shared system prompt and each chat's own document open its first turn:
    # the first turns hit the shared part too
    off_p, on_p = (bench.chat(engine, cache, 6, 3, 8, 4, 2, common_prefix_len=16,
                              chat_prefix_len=8) for cache in (False, True))
    assert off_p["token_ids"] == on_p["token_ids"] and len(on_p["token_ids"]) == 6
    assert off_p["hit_rate"] == 0 and on_p["hit_rate"] > on["hit_rate"]


def test_lora_bench_runs_each_mix_on_engines_with_and_without_lora(stories_dir, capsys):
    """bench/lora.py: LoRA off, then on with 0 and 2 adapters in the mix (written in PEFT's
    format, every projection), no compile after warm-up, a ratio each."""
    rows = _load(ROOT / "bench" / "lora.py").main([
        "--model", str(stories_dir), "--adapters", "0", "2", "--num-seqs", "4", "--input-len",
        "8", "--output-len", "4", "--repeats", "1", "--targets", "all", "--rank", "4"])
    assert [(r["lora"], r["adapters"]) for r in rows] == [(False, 0), (True, 0), (True, 2)]
    assert all(r["output_tokens_per_s"] > 0 and r["compiles_after_warmup"] == 0 for r in rows)
    assert "| LoRA on (max_loras 2) | 2 |" in capsys.readouterr().out
