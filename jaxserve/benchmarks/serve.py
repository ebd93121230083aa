"""`jaxserve bench serve`, as `vllm bench serve`: load on any OpenAI-compatible server's
/v1/completions (streamed over SSE with httpx), TTFT/TPOT/ITL/E2EL, throughput and goodput.

    jaxserve serve &                       # or any OpenAI-compatible server
    jaxserve bench serve --num-prompts 200 --request-rate 8 --max-concurrency 32 \\
        --random-input-len 128 --random-output-len 64 --save-result

Synthetic prompts are sent as token ids (the completions API takes them), so their lengths are
exact; their ids need the model's vocabulary size: from --tokenizer (a local model directory),
or from the served model's name when it is a local directory or "demo". The output length of a
request is the server's `usage.completion_tokens` (without usage: its text's tokens, else its
chunks). As vLLM's: the random dataset always ignores EOS; no temperature is sent unless
--temperature is given (the server's default applies); arrivals are gamma gaps scaled so the
last request is sent at num_prompts / request_rate; the per-request lists are saved with
--save-detailed.
"""

import asyncio
import json
import os
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxserve.benchmarks.datasets import (
    Sample,
    add_dataset_arguments,
    dataset_of,
    get_samples,
    workload_options,
)
from jaxserve.benchmarks.metrics import (
    detailed,
    format_result,
    parse_percentile_metrics,
    parse_percentiles,
    serving_result,
)
from jaxserve.sim.metrics import RequestRecord, parse_slos
from jaxserve.sim.workload import arrival_times


def add_arguments(parser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--tokenizer", default=None,
                        help="a local model directory, for the vocabulary and text lengths")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--num-prompts", type=int, default=200)
    add_load_arguments(parser)
    add_dataset_arguments(parser, "--random-input-len", "--random-output-len")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request generates its full output length (always on for "
                             "the random dataset, as in vLLM)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sent only when given (else the server's default)")
    parser.add_argument("--top-p", type=float, default=None, help="sent only when given")
    parser.add_argument("--top-k", type=int, default=None, help="sent only when given")
    parser.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    parser.add_argument("--metric-percentiles", default="99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--save-detailed", action="store_true",
                        help="also save the per-request lists (input_lens, output_lens, ttfts, "
                             "itls, start_times, latencies, generated_texts, errors)")
    parser.add_argument("--result-dir", type=Path, default=Path("."))
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")


def add_load_arguments(parser) -> None:
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between arrivals; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight")


async def _one(client, url: str, model: str, sample: Sample, ignore_eos: bool,
               start: float, sampling: dict | None = None, tokenizer=None
               ) -> tuple[RequestRecord, str | None, str]:
    """One streamed completion; the record's times are seconds since `start`. `sampling`:
    fields sent as given (temperature, top_p, top_k)."""
    body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.output_len,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos} | (sampling or {})
    record = RequestRecord(time.perf_counter() - start, sample.prompt_len)
    text, usage = [], None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return record, f"HTTP {response.status_code}: {(await response.aread())[:500]!r}", ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):  # as vLLM: each chunk with a choice is a delivery
                    record.deliver(time.perf_counter() - start, 1)
                    text.append(chunk["choices"][0].get("text") or "")
    except Exception as err:  # a benchmark counts any failure and carries on
        return record, f"{type(err).__name__}: {err}", "".join(text)
    if not record.times:
        return record, "no tokens received", ""
    generated = "".join(text)
    if usage and usage.get("completion_tokens"):  # the server's counts are exact (a chunk
        # may hold several tokens, or none); a missing or zero count leaves the chunks' own
        record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
        set_output_len(record, usage["completion_tokens"])
    elif tokenizer is not None:  # as vLLM without usage: the text's tokens
        set_output_len(record, len(tokenizer.encode(generated, add_special_tokens=False)))
    return record, None, generated


def set_output_len(record: RequestRecord, n: int) -> None:
    """Make the record's deliveries hold n tokens in all: more tokens than deliveries spread
    over them evenly (a server that merges outputs for a slow reader sends several a chunk; put
    on the last chunk they would make a false peak of output tokens/s), fewer come off the last
    ones, never below zero."""
    diff = n - record.output_len
    if diff > 0 and record.counts:
        share, extra = divmod(diff, len(record.counts))
        for i in range(len(record.counts)):
            record.counts[i] += share + (i >= len(record.counts) - extra)
        return
    for i in range(len(record.counts) - 1, -1, -1):
        if diff >= 0:
            return
        take = min(record.counts[i], -diff)
        record.counts[i] -= take
        diff += take


async def benchmark(base_url: str, endpoint: str, model: str, samples: list[Sample], *,
                    request_rate: float = float("inf"), burstiness: float = 1.0,
                    max_concurrency: int | None = None, ignore_eos: bool = False,
                    api_key: str | None = None, seed: int = 0, progress: bool = False,
                    sampling: dict | None = None, tokenizer=None
                    ) -> tuple[list[RequestRecord], list[str | None], list[str], float]:
    """Send every sample at its arrival time (at most max_concurrency in flight)."""
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    arrivals = serve_arrivals(len(samples), request_rate, burstiness, seed)
    semaphore = asyncio.Semaphore(max_concurrency or len(samples))
    url = base_url.rstrip("/") + endpoint
    bar = tqdm(total=len(samples), desc="requests", disable=not progress)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                 headers=headers) as client:
        probe = Sample(samples[0].prompt, samples[0].prompt_len, 2)
        _, error, _ = await _one(client, url, model, probe, ignore_eos, time.perf_counter(),
                                 sampling)
        if error is not None:
            raise ValueError(f"the first test request to {url} failed: {error}")

        async def limited(sample: Sample, start: float):
            async with semaphore:
                out = await _one(client, url, model, sample, ignore_eos, start, sampling,
                                 tokenizer)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for sample, at in zip(samples, arrivals, strict=True):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(limited(sample, start)))
        outs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    records, errors, texts = (list(x) for x in zip(*outs, strict=True))
    return records, errors, texts, duration


def serve_arrivals(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """vLLM's send times: `arrival_times` drawn from numpy's legacy generator seeded with
    `seed` (as vLLM seeds it), scaled so the last request goes out at n / rate."""
    times = arrival_times(n, rate, np.random.RandomState(seed), burstiness)
    return times * (n / rate / times[-1]) if n and rate < float("inf") else times


def first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def model_info(tokenizer_dir: str | None, model: str) -> tuple[int, object, int | None]:
    """(vocab size, tokenizer or None, max_model_len) from a local model directory or GGUF
    file: --tokenizer, else the served model's name when it names one (or "demo")."""
    from jaxserve.config.model import ModelConfig

    candidate = tokenizer_dir or model
    if candidate == "demo":
        from jaxserve.demo import demo_model_dir

        candidate = str(demo_model_dir())
    from jaxserve.config.gguf import gguf_file

    path = Path(candidate)
    gguf = gguf_file(path) if path.exists() else None
    if not (path / "config.json").is_file() and gguf is None:
        raise ValueError(f"cannot tell the vocabulary of model {model!r}: pass --tokenizer "
                         "with its local model directory or GGUF file")
    cfg = ModelConfig.from_hf_dir(path)
    tokenizer = None
    if gguf is not None or any((path / f).is_file()
                               for f in ("tokenizer.json", "byte_tokenizer.json")):
        from jaxserve.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
    return cfg.vocab_size, tokenizer, cfg.max_position_embeddings


def run(args, engine_options: dict | None = None) -> dict:
    metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_slos(args.goodput)
    model = args.model or first_model(args.base_url, args.api_key)
    vocab, tokenizer, max_len = model_info(args.tokenizer, model)
    samples = get_samples(dataset_of(args), args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.random_range_ratio,
                          vocab_size=vocab, seed=args.seed, tokenizer=tokenizer,
                          max_model_len=max_len, **workload_options(args))
    ignore_eos = args.ignore_eos or dataset_of(args) == "random"
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                  ("top_k", args.top_k)) if v is not None}
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness}"
          f"\nMaximum request concurrency: {args.max_concurrency}")
    records, errors, texts, duration = asyncio.run(benchmark(
        args.base_url, args.endpoint, model, samples, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        ignore_eos=ignore_eos, api_key=args.api_key, seed=args.seed,
        progress=not args.disable_tqdm, sampling=sampling, tokenizer=tokenizer))
    result = serving_result(records, errors, duration, goodput, metrics, percentiles)
    if args.save_detailed:
        result |= detailed(records, errors) | {"generated_texts": texts}
    extra = {"Maximum request concurrency:": args.max_concurrency} if args.max_concurrency else {}
    print(format_result(result, metrics, extra=extra))
    if args.save_result:
        now = datetime.now()
        result = {"date": now.strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai",
                  "backend": "openai", "label": None, "model_id": model,
                  "tokenizer_id": args.tokenizer or model, "num_prompts": args.num_prompts,
                  "request_rate": args.request_rate if args.request_rate < float("inf")
                  else "inf", "burstiness": args.burstiness,
                  "max_concurrency": args.max_concurrency} | result
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (f"openai-{args.request_rate}qps{concurrency}-"
                                        f"{Path(model).name}-{result['date']}.json")
        args.result_dir.mkdir(parents=True, exist_ok=True)
        (args.result_dir / name).write_text(json.dumps(result, indent=2))
        print(f"saved {args.result_dir / name}")
    return result
