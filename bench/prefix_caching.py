"""Prefix caching on against off, one engine, one process, the same workloads (issue 31).

    python bench/prefix_caching.py --model bench/models/llama-20m --load-format dummy

Workloads (token ids, greedy, ignore_eos, every request submitted at the start):

    prefix_repetition  vLLM's: N requests, `--num-prefixes` shared prefixes of `--prefix-len`
                       tokens, suffixes of `--suffix-len`, outputs of `--output-len`
    multiturn          chats of `--turns` turns, each turn resending the conversation so far
                       (user messages of `--suffix-len`, replies of `--output-len`), turn by turn
    no_sharing         N random prompts as long as prefix_repetition's: nothing to hit, so the
                       cache's own cost shows

Each runs with the cache off, then on (the cache emptied before it), on one engine whose
scheduler alone changes (`use_scheduler`): mean time to first token, throughput (total and
output tokens/s), the prefix cache's hit rate, and whether the two runs' tokens agree.
"""

import argparse
import json
import statistics

from jaxserve.benchmarks.datasets import (
    multiturn_samples,
    prefix_repetition_samples,
    random_samples,
)
from jaxserve.benchmarks.offline import run_load, use_scheduler, warm_up
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine


def measure(engine: LLMEngine, samples, cache: bool) -> dict:
    use_scheduler(engine, enable_prefix_caching=cache)  # a fresh scheduler: an empty cache
    run = run_load(engine, samples)
    stats = engine.stats()
    prompt = sum(r.prompt_len for r in run.records)
    output = sum(len(ids) for ids in run.token_ids)
    ttfts = [r.ttft for r in run.records]
    return {"prefix_caching": cache, "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
            "duration_s": run.duration,
            "total_tokens_per_s": (prompt + output) / run.duration,
            "output_tokens_per_s": output / run.duration,
            "hit_rate": stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]),
            "token_ids": run.token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench/models/llama-20m")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--workloads", nargs="+",
                        default=["prefix_repetition", "multiturn", "no_sharing"])
    args = parser.parse_args()
    n, prompt_len = args.num_prompts, args.prefix_len + args.suffix_len
    config = EngineConfig.from_overrides(
        load_format=args.load_format, max_num_seqs=args.max_num_seqs,
        max_model_len=max(prompt_len, args.turns * (args.suffix_len + args.output_len))
        + args.output_len, max_num_batched_tokens=512, prefill_chunk_sizes=(64, 128, 256, 512))
    engine = LLMEngine(args.model, config)
    vocab = engine.model_config.vocab_size
    workloads = {
        "prefix_repetition": lambda: prefix_repetition_samples(
            n, args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len, vocab),
        "multiturn": lambda: multiturn_samples(n, args.turns, args.suffix_len, args.output_len,
                                               vocab),
        "no_sharing": lambda: random_samples(n, prompt_len, args.output_len, 0.0, vocab),
    }
    results = {}
    for name in args.workloads:
        samples = workloads[name]()
        warm_up(engine, samples)
        off, on = measure(engine, samples, False), measure(engine, samples, True)
        same = off.pop("token_ids") == on.pop("token_ids")
        results[name] = {"off": off, "on": on, "same_tokens": same,
                         "ttft_off_over_on": off["mean_ttft_ms"] / on["mean_ttft_ms"],
                         "throughput_on_over_off": on["total_tokens_per_s"]
                         / off["total_tokens_per_s"]}
        print(f"{name}: mean TTFT {off['mean_ttft_ms']:.0f} -> {on['mean_ttft_ms']:.0f} ms "
              f"({results[name]['ttft_off_over_on']:.2f}x lower), throughput "
              f"{off['total_tokens_per_s']:.0f} -> {on['total_tokens_per_s']:.0f} tok/s "
              f"({results[name]['throughput_on_over_off']:.2f}x), hit rate "
              f"{on['hit_rate']:.1%}, same tokens: {same}", flush=True)
    print(json.dumps({"model": args.model, "num_prompts": n, "results": results}, indent=2))


if __name__ == "__main__":
    main()
