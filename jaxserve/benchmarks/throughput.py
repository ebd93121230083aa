"""`jaxserve bench throughput`, as `vllm bench throughput`: every request at once through the
offline `LLM`, warm-up excluded; requests/s, total tokens/s, output tokens/s.

    jaxserve bench throughput --model bench/models/llama-20m --load-format dummy \\
        --num-prompts 200 --input-len 128 --output-len 64 --output-json out.json

Beside tokens/s it prints the FLOP rate the run achieved (model FLOPs of the tokens it fed), so
a CPU figure can be read against the machine's matmul rate.
"""

import json
import time
from pathlib import Path

from jaxserve.benchmarks.datasets import (
    add_dataset_arguments,
    dataset_of,
    get_samples,
    workload_options,
)
from jaxserve.benchmarks.roofline import workload_flops
from jaxserve.request import SamplingParams


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="a local model directory, or demo "
                        "(default)")
    parser.add_argument("--num-prompts", type=int, default=200)
    add_dataset_arguments(parser)
    parser.add_argument("--output-json", type=Path, help="write the results here")
    parser.add_argument("--disable-tqdm", action="store_true")


def run(args, engine_options: dict) -> dict:
    from jaxserve.llm import LLM

    start = time.perf_counter()
    llm = LLM(args.model, **engine_options)
    engine = llm.engine
    print(f"loaded {engine.model_path} and compiled in {time.perf_counter() - start:.1f} s")
    samples = get_samples(dataset_of(args), args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.random_range_ratio,
                          vocab_size=engine.model_config.vocab_size, seed=args.seed,
                          tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                          **workload_options(args))
    # as vllm bench throughput: sampling at temperature 1, every output at its full length
    params = [SamplingParams(max_tokens=s.output_len, temperature=1.0, ignore_eos=True)
              for s in samples]
    prompts = [s.engine_prompt for s in samples]
    llm.generate(prompts[:4], [SamplingParams(max_tokens=4, ignore_eos=True)] * len(prompts[:4]))
    llm.reset_prefix_cache()  # the warm-up's prompts are not the run's cached prefixes
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    total = sum(prompt_lens) + sum(output_lens)
    flops = workload_flops(engine.model_config, prompt_lens, output_lens)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    result = {
        "elapsed_time": elapsed, "num_requests": len(outputs), "total_num_tokens": total,
        "requests_per_second": len(outputs) / elapsed, "tokens_per_second": total / elapsed,
        "output_tokens_per_second": sum(output_lens) / elapsed,
        "total_output_tokens": sum(output_lens), "model_flops": flops,
        "achieved_gflops_per_second": flops / elapsed / 1e9,
        "mean_ttft_ms": 1e3 * sum(ttfts) / len(ttfts),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "engine": {k: list(v) if isinstance(v, tuple) else v for k, v in engine_options.items()},
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Mean TTFT: {result['mean_ttft_ms']:.1f} ms (every request arrives at the start); "
          f"prefix cache hit rate {result['prefix_cache_hit_rate']:.1%}")
    print(f"Total num prompt tokens:  {sum(prompt_lens)}")
    print(f"Total num output tokens:  {sum(output_lens)}")
    print(f"Model FLOPs: {flops / 1e9:.1f} GFLOP, achieved "
          f"{result['achieved_gflops_per_second']:.1f} GFLOP/s")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2))
    return result
