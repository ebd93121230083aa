"""Prefix caching on against off, one engine, one process, the same workloads (issue 31).

    python bench/prefix_caching.py --model bench/models/llama-20m --load-format dummy

Workloads (token ids, greedy, ignore_eos, every request submitted at the start):

    prefix_repetition  vLLM's: N requests, `--num-prefixes` shared prefixes of `--prefix-len`
                       tokens, suffixes of `--suffix-len`, outputs of `--output-len`
    multiturn          chats of `--turns` turns, each turn resending the conversation so far
                       (user messages of `--suffix-len`, replies of `--output-len`), turn by turn
    chat               closed-loop chats: `--max-num-seqs` chats at a time, each turn sent when
                       the chat's previous turn ends, its prompt the previous prompt, the reply
                       the model gave (`--output-len` tokens) and a new user message
                       (`--suffix-len`), `--turns` turns; N turns in all
    chat_prefixed      the same chats shaped as vLLM's multi-turn benchmark
                       (benchmarks/multi_turn/generate_multi_turn.json): each chat's first
                       message opens with a system prompt every chat shares
                       (`--common-prefix-len`, its common_prefix_num_tokens) and a document of
                       its own (`--chat-prefix-len`, its prefix_num_tokens); messages and
                       replies vary by +-20% (as its uniform ranges do), so the chats do not
                       run in step
    no_sharing         N random prompts as long as prefix_repetition's: nothing to hit, so the
                       cache's own cost shows

Each runs with the cache off, then on (the cache emptied before it), on one engine whose
scheduler alone changes (`use_scheduler`): mean time to first token, throughput (total and
output tokens/s), the prefix cache's hit rate, and whether the two runs' tokens agree.
"""

import argparse
import json
import statistics
import time

import numpy as np

from jaxserve.benchmarks.datasets import (
    multiturn_samples,
    prefix_repetition_samples,
    random_samples,
)
from jaxserve.benchmarks.offline import run_load, use_scheduler, warm_up
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.request import SamplingParams

VARIATION = 0.2  # chat_prefixed's messages and replies: +-20% of their lengths


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


def chat(engine: LLMEngine, cache: bool, n: int, turns: int, message_len: int,
         reply_len: int, concurrency: int, seed: int = 0, common_prefix_len: int = 0,
         chat_prefix_len: int = 0, range_ratio: float = 0.0) -> dict:
    """Closed-loop chats on the engine; the same measures as `measure`. Each chat's first
    message opens with `common_prefix_len` tokens every chat shares and `chat_prefix_len` of
    its own. range_ratio: messages and replies vary uniformly within that share of their
    lengths (so the chats do not run in step)."""
    use_scheduler(engine, enable_prefix_caching=cache)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    chats = -(-n // turns)

    def length(mean: int) -> int:
        return int(rng.integers(round(mean * (1 - range_ratio)),
                                round(mean * (1 + range_ratio)) + 1))

    messages = [[rng.integers(3, vocab, length(message_len)).tolist() for _ in range(turns)]
                for _ in range(chats)]
    replies = [[length(reply_len) for _ in range(turns)] for _ in range(chats)]
    common = rng.integers(3, vocab, common_prefix_len).tolist()
    for chat_messages in messages:
        chat_messages[0] = common + rng.integers(3, vocab, chat_prefix_len).tolist() + (
            chat_messages[0])
    history: dict[int, list[int]] = {}  # chat -> its conversation so far
    turn_of = dict.fromkeys(range(chats), 0)
    sent: dict[str, float] = {}
    ttfts, outputs, prompt_tokens, ids = [], 0, 0, {}
    start = time.monotonic()

    def send(c: int) -> None:
        nonlocal prompt_tokens
        prompt = history.get(c, []) + messages[c][turn_of[c]]
        history[c] = prompt
        rid = f"{c}-{turn_of[c]}"
        sent[rid] = time.monotonic()
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(
            max_tokens=replies[c][turn_of[c]], temperature=0.0, ignore_eos=True))
        prompt_tokens += len(prompt)

    waiting = list(range(chats))
    active = 0
    while waiting or active:
        while waiting and active < concurrency:
            send(waiting.pop(0))
            active += 1
        for out in engine.step():
            rid = out.request_id
            if rid in sent and out.outputs[0].token_ids:
                ttfts.append(time.monotonic() - sent.pop(rid))
            if out.finished:
                c = int(rid.split("-")[0])
                reply = list(out.outputs[0].token_ids)
                ids[rid] = reply
                outputs += len(reply)
                history[c] = history[c] + reply
                turn_of[c] += 1
                active -= 1
                if turn_of[c] < turns and len(ids) + active < n:
                    waiting.insert(0, c)  # the chat's next turn, before new chats
    duration = time.monotonic() - start
    stats = engine.stats()
    return {"prefix_caching": cache, "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
            "duration_s": duration, "total_tokens_per_s": (prompt_tokens + outputs) / duration,
            "output_tokens_per_s": outputs / duration,
            "hit_rate": stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]),
            "token_ids": [ids[k] for k in sorted(ids)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench/models/llama-20m")
    parser.add_argument("--load-format", default=None,
                        help="default: auto for a GGUF file (its weights), else dummy")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--common-prefix-len", type=int, default=128,
                        help="chat_prefixed: the system prompt every chat shares")
    parser.add_argument("--chat-prefix-len", type=int, default=256,
                        help="chat_prefixed: each chat's own document")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--workloads", nargs="+",
                        default=["prefix_repetition", "multiturn", "chat", "chat_prefixed",
                                 "no_sharing"])
    args = parser.parse_args()
    n, prompt_len = args.num_prompts, args.prefix_len + args.suffix_len
    chats_len = args.turns * (args.suffix_len + args.output_len)
    if "chat_prefixed" in args.workloads:
        chats_len = round(chats_len * (1 + VARIATION)) + args.common_prefix_len + (
            args.chat_prefix_len)
    config = EngineConfig.from_overrides(
        load_format=args.load_format or (
            "auto" if str(args.model).endswith(".gguf") else "dummy"), max_num_seqs=args.max_num_seqs,
        max_model_len=max(prompt_len + args.output_len, chats_len),
        max_num_batched_tokens=512, prefill_chunk_sizes=(64, 128, 256, 512))
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
        if name in ("chat", "chat_prefixed"):
            prefixes = ({"common_prefix_len": args.common_prefix_len,
                         "chat_prefix_len": args.chat_prefix_len, "range_ratio": VARIATION}
                        if name == "chat_prefixed" else {})
            off, on = (chat(engine, cache, n, args.turns, args.suffix_len, args.output_len,
                            args.max_num_seqs, **prefixes) for cache in (False, True))
        else:
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
