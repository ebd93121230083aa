"""Data parallelism in the engine (LLMEngine over several replicas, each its own scheduler, KV
pool and runner): routing to the least-loaded replica or to the one caching the prompt, abort, stats, the async engine, on the
tests' fake runners (tests/fake_runner.py, tokens worked out by hand, no model compiled). The
real model's replicas on their own host devices are checked by test_tensor_parallel.py."""

import asyncio
import json

import pytest
from fake_runner import FakeRunner, expected_output
from test_engine_fake import CONFIG  # the fake model's config.json

from jaxserve import LLM
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine, merge_stats
from jaxserve.request import RequestOutputKind, SamplingParams
from jaxserve.text.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fake-model")
    (path / "config.json").write_text(json.dumps(CONFIG))
    ByteTokenizer().save(path)
    return path


def make_engine(model_dir, dp: int = 2, num_pages: int = 33, **overrides) -> LLMEngine:
    runners = [FakeRunner(num_pages=num_pages, max_model_len=64) for _ in range(dp)]
    config = EngineConfig.from_overrides(**(dict(
        page_size=4, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_sizes=(16,),
        data_parallel_size=dp) | overrides))
    engine = LLMEngine(model_dir, config, runner=runners)
    for runner, core in zip(runners, engine.cores, strict=True):
        runner.scheduler = core.scheduler  # each fake checks its own replica's invariants
    return engine


def prompt(i: int, length: int = 5) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 3 for j in range(length)]


def per_replica(engine: LLMEngine) -> list[list[str]]:
    return [sorted(c.scheduler.requests) for c in engine.cores]


def test_requests_go_to_the_least_loaded_replica(model_dir):
    """Waiting requests weigh 4, running ones 1 (vLLM's score): a burst alternates, and a
    replica with only running requests takes new ones before one whose queue waits."""
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt(i)}, params)
    assert per_replica(engine) == [["r0", "r2"], ["r1", "r3"]]
    assert engine.stats()["num_requests_per_replica"] == [2, 2]
    engine.step()  # both replicas admit theirs: running now
    engine.add_request("r4", {"prompt_token_ids": prompt(4)}, params)  # equals: the first
    engine.step()
    engine.abort("r3")  # replica 0 runs 3 requests, replica 1 runs 1
    engine.add_request("r5", {"prompt_token_ids": prompt(5)}, params)
    assert per_replica(engine) == [["r0", "r2", "r4"], ["r1", "r5"]]
    # replica 1 holds fewer requests (2 against 3), but one waits: 1 + 4 against 3
    engine.add_request("r6", {"prompt_token_ids": prompt(6)}, params)
    assert per_replica(engine) == [["r0", "r2", "r4", "r6"], ["r1", "r5"]]


def test_a_request_goes_where_its_prefix_is_cached_unless_that_replica_is_busier(model_dir):
    """The replica caching half the prompt or more takes it while it is within a waiting
    request's load of the least loaded; past that, the least loaded does."""
    engine = make_engine(model_dir, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    shared = prompt(9, 12)  # three full pages of 4 tokens
    engine.add_request("a", {"prompt_token_ids": [*shared, 5]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cores[0].scheduler.kv.num_cached_pages >= 3  # replica 0 ran it
    engine.add_request("f", {"prompt_token_ids": prompt(1)}, params)  # loads 4 and 0
    engine.add_request("c", {"prompt_token_ids": [*shared, 6]}, params)  # loads 8 and 0
    engine.add_request("d", {"prompt_token_ids": [*shared, 7]}, params)
    engine.add_request("e", {"prompt_token_ids": prompt(3, 13)}, params)  # nothing cached
    assert per_replica(engine) == [["c", "f"], ["d", "e"]]


def test_each_request_gets_what_it_gets_alone_whatever_its_replica(model_dir):
    engine = make_engine(model_dir)
    lengths = [3, 9, 5, 14, 4, 7, 11, 2]
    for i, n in enumerate(lengths):
        engine.add_request(str(i), {"prompt_token_ids": prompt(i, 3 + i)},
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.request_id not in finished
            finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {str(i): expected_output(prompt(i, 3 + i), n)
                        for i, n in enumerate(lengths)}
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] == 2 * 32
    assert stats["data_parallel_size"] == 2 and stats["num_requests_per_replica"] == [0, 0]
    assert all(r.num_dispatches > 0 for r in engine.runners)  # both replicas worked
    assert stats["num_steps"] == sum(c.num_steps for c in engine.cores)


def test_abort_finds_the_request_in_its_replica(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt(i)}, params)
    engine.step()
    assert engine.abort("r3") and engine.abort("r0")
    assert not engine.abort("r3") and not engine.abort("unknown")
    assert per_replica(engine) == [["r2"], ["r1"]]
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_stats_merge_sums_counts_and_pools_the_cache_usage():
    a = {"num_requests_running": 2, "num_requests_waiting": 1, "kv_pages_total": 10,
         "kv_pages_free": 4, "kv_cache_usage": 0.6, "kv_fragmentation": 0.2,
         "spec_decode_num_accepted_tokens_per_pos": [3, 1]}
    b = {"num_requests_running": 1, "num_requests_waiting": 0, "kv_pages_total": 10,
         "kv_pages_free": 10, "kv_cache_usage": 0.0, "kv_fragmentation": 0.0,
         "spec_decode_num_accepted_tokens_per_pos": [2, 2]}
    merged = merge_stats([a, b])
    assert merged["num_requests_running"] == 3 and merged["kv_pages_free"] == 14
    assert merged["kv_cache_usage"] == pytest.approx(0.3)
    assert merged["kv_fragmentation"] == pytest.approx(0.1)
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [5, 3]


def test_the_async_engine_serves_every_replica(model_dir):
    """The server's engine over two replicas: concurrent streams, each its own tokens; the
    queue's limit counts both replicas' slots and pages."""
    engine = make_engine(model_dir)
    async_engine = AsyncEngine(engine)
    assert async_engine.max_waiting_requests == 2 * 32  # both pools' pages

    async def one(i: int) -> list[int]:
        stream = await async_engine.add_request(
            f"a{i}", {"prompt_token_ids": prompt(i)},
            SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True,
                           output_kind=RequestOutputKind.DELTA))
        tokens = []
        async for out in stream:
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await async_engine.shutdown()

    results = asyncio.run(main())
    assert results == [expected_output(prompt(i), 6 + i) for i in range(8)]
    assert all(r.num_dispatches > 0 for r in engine.runners)


def test_bad_data_parallel_settings_are_clear_errors(model_dir):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size 3: 2 runners given"):
        make_engine(model_dir, dp=2, data_parallel_size=3)
    # the model's replicas need dp x tp devices; this process has one
    import jax

    devices = len(jax.devices())
    with pytest.raises(ValueError, match=f"data_parallel_size {devices + 1} x "
                                         f"tensor_parallel_size 1 needs {devices + 1} devices; "
                                         f"{devices} found"):
        LLM(model_dir, data_parallel_size=devices + 1, load_format="dummy")
    # the one-replica surfaces say where to look
    with pytest.raises(RuntimeError, match="2 data-parallel replicas"):
        _ = make_engine(model_dir).scheduler
