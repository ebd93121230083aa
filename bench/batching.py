"""Continuous vs static batching on one workload, in one process; and batch-1 decode vs roofline.

    python bench/batching.py --model bench/models/llama-20m --load-format dummy

Workload (as the engine issue sets it): N requests, prompts uniform in [32, 256] tokens, output
lengths lognormal with median 48 capped at 256, greedy, ignore_eos, all submitted at once, both
modes capped at the same number of concurrent sequences. Warm-up (compilation) is excluded.
"""

import argparse
import contextlib
import json
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import make_scheduler


def workload(n: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(32, 257, size=n)
    output_lens = np.minimum(np.round(rng.lognormal(np.log(48), 0.8, size=n)), 256).astype(int)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, size=int(p)).tolist()}
               for p in prompt_lens]
    params = [SamplingParams(max_tokens=max(1, int(o)), temperature=0.0, ignore_eos=True)
              for o in output_lens]
    return prompts, params


def device_copy_bandwidth_gbs() -> float:
    """Measured accelerator memory bandwidth: bytes read + written per second by a 1 GiB
    copy on the device (the ceiling a memory-bound decode step is held against)."""
    x = jnp.ones((2**28,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / min(times) / 1e9


def copy_bandwidth_gbs() -> float:
    """Measured host memory copy bandwidth, bytes read + written per second."""
    src = np.ones(64 * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / min(times) / 1e9


@contextlib.contextmanager
def loop_profile(engine):
    """Seconds the engine loop spends in each part, summed: scheduling, dispatching (building
    the step's arrays and launching it), collecting (mostly waiting for the device to finish the
    step before; the copy of its tokens) and processing outputs (stops, detokenizing). With one
    step in flight, a loop whose collect time is small is bound by the host, not the device."""
    totals = dict.fromkeys(("schedule", "dispatch", "collect", "outputs"), 0.0)
    parts = {"schedule": (engine.scheduler, "schedule"), "dispatch": (engine.runner, "dispatch"),
             "collect": (engine.runner, "collect"), "outputs": (engine, "_process")}

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
        return call

    for name, (owner, attr) in parts.items():
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    try:
        yield totals
    finally:
        for owner, attr in parts.values():
            owner.__dict__.pop(attr, None)


@contextlib.contextmanager
def device_idle(runner):
    """The device's idle share while the engine runs: a watcher thread blocks on each
    dispatched iteration's results and notes when they are ready; the device idles between
    one iteration's results and the next iteration's dispatch, when that comes later (the
    host was late). Ready times are noted a little late (the thread's wake-up), so the share
    is, if anything, low."""
    events: queue.Queue = queue.Queue()
    marks: list[tuple[float, float]] = []  # (dispatched, ready) per iteration
    dispatch = runner.dispatch

    def watch():
        while (item := events.get()) is not None:
            dispatched, arrays = item
            jax.block_until_ready(arrays)
            marks.append((dispatched, time.perf_counter()))

    def dispatched(out):
        at = time.perf_counter()
        flight = dispatch(out)
        arrays = [a for a in vars(flight).values() if isinstance(a, jax.Array)]
        arrays += [call.packed for call in getattr(flight, "prefills", [])]
        events.put((at, arrays))
        return flight

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    runner.dispatch = dispatched
    result = {}
    try:
        yield result
    finally:
        runner.__dict__.pop("dispatch", None)
        events.put(None)
        thread.join()
        idle = sum(max(0.0, d - ready) for (d, _), (_, ready) in zip(marks[1:], marks[:-1],
                                                                     strict=True))
        span = marks[-1][1] - marks[0][0] if marks else 0.0
        result["idle_share"] = idle / span if span else 0.0


def run_mode(llm: LLM, config: EngineConfig, prompts, params) -> dict:
    engine = llm.engine
    engine.scheduler = make_scheduler(config, engine.runner.num_pages,
                                      engine.runner.chunk_buckets[-1])
    steps_before = engine.num_steps
    with device_idle(engine.runner) as device, loop_profile(engine) as loop:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    iterations = max(1, engine.num_steps - steps_before)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"batching": config.batching, "elapsed_s": elapsed, "num_requests": len(outs),
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
            "requests_per_s": len(outs) / elapsed,
            "compilations_after_warmup": engine.stats()["num_compilations_after_warmup"],
            "iterations": iterations, "device_idle_share": device["idle_share"],
            "loop_ms_per_iteration": {k: 1e3 * v / iterations for k, v in loop.items()},
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def batch1(llm: LLM, vocab: int, tokens: int = 128) -> float:
    prompt = {"prompt_token_ids": list(range(3, 35))}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompt, params)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/models/llama-20m")
    parser.add_argument("--load-format", default=None,
                        help="default: auto for a GGUF file (its weights), else dummy")
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--prefill-chunk-sizes", default="32,64,128,256")
    parser.add_argument("--decode-steps", type=int, default=1)
    parser.add_argument("--row-buckets", default=None,
                        help="padded row counts to compile, e.g. 8,32 (default: powers of two)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--matmul-impl", default="auto", help="as the engine's option (amx: "
                        "bf16x3 on AMX tiles, opt-in)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the engine's option")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    overrides = dict(
        load_format=args.load_format or (
            "auto" if str(args.model).endswith(".gguf") else "dummy"), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
        prefill_chunk_sizes=tuple(int(c) for c in args.prefill_chunk_sizes.split(",")),
        decode_steps=args.decode_steps, num_pages=args.num_pages, enable_prompt_logprobs=False,
        max_model_len=args.max_model_len, max_batch_size=args.max_num_seqs,
        matmul_impl=args.matmul_impl, kv_cache_dtype=args.kv_cache_dtype,
        row_buckets=None if args.row_buckets is None
        else tuple(int(r) for r in args.row_buckets.split(",")))
    start = time.perf_counter()
    llm = LLM(args.model, **overrides)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    print(f"model {args.model}: {engine.model_config.num_params / 1e6:.1f}M parameters, "
          f"{engine.runner.weight_bytes / 2**20:.0f} MiB weights, backend "
          f"{engine.runner.platform}, attention {engine.runner.attention_impl}, matmul "
          f"{engine.runner.matmul_impl}, {engine.runner.kv_dtype_name} KV; "
          f"load + warm-up {time.perf_counter() - start:.1f} s")
    prompts, params = workload(args.num_prompts, vocab, args.seed)
    rows = [run_mode(llm, EngineConfig.from_overrides(**overrides, batching=mode), prompts, params)
            for mode in ("static", "continuous")]
    same = rows[0].pop("token_ids") == rows[1].pop("token_ids")
    tps1 = batch1(llm, vocab)
    weight_bytes = engine.runner.weight_bytes
    bandwidth = (copy_bandwidth_gbs() if engine.runner.platform == "cpu"
                 else device_copy_bandwidth_gbs())
    roof = bandwidth * 1e9 / weight_bytes
    print(f"\n{args.num_prompts} requests, max {args.max_num_seqs} concurrent sequences")
    print(f"{'batching':<12}{'elapsed s':>10}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'compiles':>10}")
    for r in rows:  # compiles: after warm-up, cumulative (must stay 0: a compile is seconds)
        print(f"{r['batching']:<12}{r['elapsed_s']:>10.2f}{r['requests_per_s']:>9.2f}"
              f"{r['output_tokens_per_s']:>11.1f}{r['total_tokens_per_s']:>13.1f}"
              f"{r['compilations_after_warmup']:>10}")
    print("engine loop, ms per iteration (collect is mostly waiting for the device):")
    for r in rows:
        ms = r["loop_ms_per_iteration"]
        print(f"  {r['batching']:<12}{r['iterations']:>6} iterations, "
              f"{1e3 * r['elapsed_s'] / r['iterations']:6.2f} ms each: "
              + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
              + f"; device idle {100 * r['device_idle_share']:.1f}% of the time")
    ratio = rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    print(f"continuous / static throughput: {ratio:.2f}x; greedy ids identical: {same}")
    print(f"batch-1 decode: {tps1:.1f} tok/s; roofline (weights {weight_bytes / 1e6:.0f} MB / "
          f"copy bandwidth {bandwidth:.0f} GB/s) {roof:.1f} tok/s = {100 * tps1 / roof:.0f}%")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"modes": rows, "ratio": ratio, "identical": same,
                       "batch1_tokens_per_s": tps1, "roofline_tokens_per_s": roof}, f, indent=2)


if __name__ == "__main__":
    main()
