"""Hugging Face transformers beside jaxserve: the same model directory, workload and machine.

    python bench/peer_hf.py                    # a random ~27M-parameter Llama, 64 requests
    python bench/peer_hf.py --model tests/fixtures/hf/llama --num-prompts 8 --budgets 64 \\
        --static-batch 8                       # a tiny run

Needs torch and transformers (the `ref` extra). In one process, each timed after its warm-up,
float32, greedy, every request at its own output length (EOS ignored):

    jaxserve    LLM.generate (continuous batching), once per --attention-impl and --matmul-impl
    hf-static   model.generate on batches of --static-batch requests in order, left padded: a
                batch runs until its longest request is done (each keeps its own length)
    hf-cb       transformers' own continuous batching (ContinuousBatchingManager: paged cache,
                sdpa) at each tokens-per-step budget in --budgets, its main knob

It prints output tokens/s, the jaxserve/peer ratios against each peer's best setting, whether
the greedy ids agree, and each run against the workload's compute floor (its model FLOPs / this
machine's measured float32 matmul rate), and on a virtual machine the share of CPU time its
host took during each run (steal, from /proc/stat: a run that met a contended host says so).
The workload is the engine issue's (prompts uniform in [32, 256], outputs lognormal with median
48 capped at 256), as bench/batching.py's.
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.benchmarks.datasets import Sample, batching_samples, fit_to_context  # noqa: E402

# a ~27M-parameter Llama: 8 layers of 512, GQA 8 query / 4 KV heads, vocab 8192
PEER_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=None, pad_token_id=0, initializer_range=0.05)


# -- the pure parts (no torch): workload, agreement, ratios --------------------------------------

def workload(n: int, vocab_size: int, max_model_len: int, seed: int = 0) -> list[Sample]:
    """The engine issue's workload, trimmed to the model's context when it is short."""
    return fit_to_context(batching_samples(n, vocab_size, seed), max_model_len)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two runs' greedy ids agree: identical requests, and the mean fraction of each
    request's tokens before the first difference."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} vs {len(b)} requests")
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                 min(len(x), len(y)))
        prefixes.append(n / max(len(x), len(y), 1))
    identical = sum(x == y for x, y in zip(a, b, strict=True))
    return {"identical": identical, "total": len(a),
            "mean_prefix_fraction": sum(prefixes) / max(len(prefixes), 1)}


def ratios(rows: list[dict]) -> dict:
    """jaxserve's output tokens/s over each peer kind's best setting (rows: name, setting,
    output_tokens_per_s)."""
    ours = max(r["output_tokens_per_s"] for r in rows if r["name"] == "jaxserve")
    best: dict[str, dict] = {}
    for r in rows:
        if r["name"] != "jaxserve" and (r["name"] not in best or r["output_tokens_per_s"] >
                                        best[r["name"]]["output_tokens_per_s"]):
            best[r["name"]] = r
    return {name: {"best_setting": r["setting"], "peer_tokens_per_s": r["output_tokens_per_s"],
                   "ratio": ours / r["output_tokens_per_s"]} for name, r in best.items()}


# -- the runs ----------------------------------------------------------------------------------

def make_model(path: Path, seed: int = 0) -> Path:
    """A random Llama saved with save_pretrained (safetensors), for both engines to load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**PEER_MODEL)).save_pretrained(path)
    return path


def load_jaxserve(model: Path, options: dict):
    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **options)
    print(f"jaxserve: load + compile {time.perf_counter() - start:.1f} s", flush=True)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}] * 8,
                 [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 8)
    return llm


def run_jaxserve(llm, samples: list[Sample], options: dict) -> dict:
    from jaxserve import SamplingParams

    params = [SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True)
              for s in samples]
    prompts = [s.engine_prompt for s in samples]
    with iteration_times(llm.engine) as times:
        since = cpu_times()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    print(f"jaxserve: {len(times['prefill'])} iterations with prompt chunks "
          f"{sum(times['prefill']):.2f} s, {len(times['decode'])} decode-only iterations "
          f"{sum(times['decode']):.2f} s", flush=True)
    ids = [o.outputs[0].token_ids for o in outs]
    matmul = {"amx": "amx (bf16x3)"}.get(llm.engine.runner.matmul_impl,
                                         llm.engine.runner.matmul_impl)
    setting = (f"max_num_seqs {options['max_num_seqs']}, "
               f"{options['max_num_batched_tokens']} tok/step, "
               f"{llm.engine.runner.attention_impl} attention, {matmul} matmul"
               + (f", {llm.engine.runner.kv_dtype_name} KV"
                  if options.get("kv_cache_dtype", "auto") != "auto" else ""))
    return _row("jaxserve", setting, elapsed, ids, since)


def paired_rounds(llms: list, hf, samples: list[Sample], options: list[dict], budget: int,
                  rounds: int) -> list[dict]:
    """Rounds of jaxserve's settings and transformers' continuous batching at `budget` one
    after the other, each round's ratio from its own runs: the machine's speed drifts between
    minutes, and a ratio of runs minutes apart carries that drift."""
    out = []
    for r in range(rounds):
        ours = [run_jaxserve(llm, samples, o) for llm, o in zip(llms, options, strict=True)]
        peer = run_hf_cb(hf, samples, budget)
        best = max(x["output_tokens_per_s"] for x in ours)
        out.append({"round": r + 1, "jaxserve_tokens_per_s": best,
                    "peer_tokens_per_s": peer["output_tokens_per_s"],
                    "ratio": best / peer["output_tokens_per_s"],
                    # each jaxserve setting's own, in `options`' order
                    "setting_ratios": [x["output_tokens_per_s"] / peer["output_tokens_per_s"]
                                       for x in ours],
                    # the host's steal in each run (jaxserve's settings, then the peer's)
                    "host_steal": [x.get("host_steal") for x in (*ours, peer)],
                    "identical": sum(a == b for a, b in zip(ours[0]["token_ids"],
                                                            peer["token_ids"], strict=True))})
        print(f"round {r + 1}: jaxserve / hf-cb {budget} tok/step = {out[-1]['ratio']:.2f}x",
              flush=True)
    return out


@contextlib.contextmanager
def iteration_times(engine):
    """Seconds per engine iteration, by kind: "prefill" (it carried prompt chunks) or "decode".
    An iteration's device time is waited for by the next step (steps overlap by one), so each
    step's wall time is charged to the iteration dispatched before it."""
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    step, previous = engine.step, [None]

    def timed():
        start = time.perf_counter()
        outputs = step()
        if previous[0] is not None:
            times[previous[0]].append(time.perf_counter() - start)
        flight = engine.core.inflight
        previous[0] = None if flight is None else (
            "prefill" if any(c.num_tokens > 1 for c in flight[0].chunks) else "decode")
        return outputs

    engine.step = timed
    try:
        yield times
    finally:
        del engine.step


def row_buckets_x15(max_num_seqs: int) -> tuple[int, ...]:
    """Decode row buckets 2, 4, then powers of two from 8 each with its 1.5x between them, up to
    max_num_seqs (64: 2 4 8 12 16 24 32 48 64). On the CPU a padded row costs as much as a real
    one, and rows between 33 and 63 pad to 64 with powers of two."""
    top, sizes, p = max(2, max_num_seqs), [2, 4], 8
    while p < top:
        sizes += [p, p * 3 // 2]
        p *= 2
    return (*(b for b in sizes if b < top), top)


def cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(steal, total) of the machine's CPU time so far, in Linux's ticks (the first line of
    /proc/stat: user nice system idle iowait irq softirq steal ...); None where it has no steal
    column (not Linux, or not a virtual machine's kernel)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


def host_steal(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of all CPU time between two `cpu_times` readings that the host took from this
    virtual machine (steal): a run with a large share met a contended host."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def _row(name: str, setting: str, elapsed: float, ids: list[list[int]],
         since: tuple[int, int] | None = None) -> dict:
    out = sum(len(x) for x in ids)
    steal = host_steal(since, cpu_times())
    print(f"{name:<9} {setting:<54} {elapsed:7.2f} s {out / elapsed:8.1f} out tok/s"
          + (f"  (host steal {100 * steal:.0f}%)" if steal is not None else ""), flush=True)
    return {"name": name, "setting": setting, "elapsed_s": elapsed,
            "output_tokens_per_s": out / elapsed, "host_steal": steal, "token_ids": ids}


def _hf_model(model: Path):
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model, attn_implementation="sdpa",
                                          dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore EOS, as jaxserve's runs do
    return hf


def _greedy_config(max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=0)


def run_hf_static(hf, samples: list[Sample], batch: int) -> dict:
    import torch

    def generate(group: list[Sample]) -> list[list[int]]:
        width = max(len(s.prompt) for s in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(group):  # left padding: every row's last prompt token aligned
            ids[i, width - len(s.prompt):] = torch.tensor(s.prompt)
            mask[i, width - len(s.prompt):] = 1
        longest = max(s.output_len for s in group)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask,
                              generation_config=_greedy_config(longest))
        return [out[i, width:width + s.output_len].tolist() for i, s in enumerate(group)]

    generate([Sample(s.prompt, s.prompt_len, 4) for s in samples[:batch]])  # warm-up
    since = cpu_times()
    start = time.perf_counter()
    ids = [x for i in range(0, len(samples), batch) for x in generate(samples[i:i + batch])]
    return _row("hf-static", f"batch {batch}", time.perf_counter() - start, ids, since)


def run_hf_cb(hf, samples: list[Sample], budget: int) -> dict:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(max_batch_tokens=budget, auto_switch_to_flash=False)
    with hf.continuous_batching_context_manager(generation_config=_greedy_config(256),
                                                continuous_batching_config=config,
                                                block=True, timeout=5) as manager:
        since = cpu_times()
        start = time.perf_counter()  # after the manager's warm-up
        for i, s in enumerate(samples):
            manager.add_request(s.prompt, request_id=str(i), max_new_tokens=s.output_len,
                                eos_token_id=-1)
        results = {}
        while len(results) < len(samples):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
        elapsed = time.perf_counter() - start
    ids = [list(results[str(i)].generated_tokens) for i in range(len(samples))]
    return _row("hf-cb", f"{budget} tok/step", elapsed, ids, since)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="an HF directory with safetensors (default: a random 27M Llama)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048],
                        help="hf-cb tokens per step (max_batch_tokens) to sweep")
    parser.add_argument("--static-batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--max-num-seqs", type=int, default=64, help="jaxserve")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024, help="jaxserve")
    parser.add_argument("--prefill-chunk-sizes", type=int, nargs="+",
                        default=[32, 48, 64, 96, 128, 192, 256],
                        help="jaxserve's prefill buckets (steps of 1.5x pad this workload's "
                             "prompts 14%% where powers of two pad them 32%%)")
    parser.add_argument("--row-buckets", type=int, nargs="+", default=None,
                        help="jaxserve's decode row buckets (default: steps of 1.5x from 8, "
                             "row_buckets_x15: 5-8%% faster here than powers of two)")
    parser.add_argument("--decode-steps", type=int, default=1, help="jaxserve")
    parser.add_argument("--attention-impl", nargs="+", default=["auto"],
                        help="jaxserve, one run each (auto reference: the CPU kernel beside the "
                             "plain-XLA attention); the ratios take the fastest")
    parser.add_argument("--matmul-impl", nargs="+", default=["auto"],
                        help="jaxserve, one run each with every --attention-impl (auto xla: the "
                             "CPU's batch-invariant kernel beside XLA's dot)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                        help="jaxserve, one run each with every other setting (auto bfloat16: "
                             "the float32 KV pool beside the bfloat16 one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="after the sweep, rounds-1 more rounds of every jaxserve run "
                             "and hf-cb at its best budget, back to back: each round's ratio "
                             "from its own runs, and their median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")

    import torch

    from jaxserve.benchmarks.roofline import measure_matmul_flops, workload_flops
    from jaxserve.config.model import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp) / "llama-27m", args.seed)
        cfg = ModelConfig.from_hf_dir(model)
        samples = workload(args.num_prompts, cfg.vocab_size, cfg.max_position_embeddings,
                           args.seed)
        print(f"model {model}: {cfg.num_params / 1e6:.1f}M parameters; {len(samples)} requests, "
              f"{sum(s.prompt_len for s in samples)} prompt + "
              f"{sum(s.output_len for s in samples)} output tokens; torch {torch.__version__} "
              f"with {torch.get_num_threads()} threads", flush=True)
        options = dict(max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       prefill_chunk_sizes=tuple(args.prefill_chunk_sizes),
                       row_buckets=tuple(args.row_buckets or row_buckets_x15(args.max_num_seqs)),
                       decode_steps=args.decode_steps, enable_prompt_logprobs=False)
        settings = [options | {"attention_impl": attention, "matmul_impl": matmul,
                               "kv_cache_dtype": kv}
                    for attention in args.attention_impl for matmul in args.matmul_impl
                    for kv in args.kv_cache_dtype]
        llms = [load_jaxserve(model, o) for o in settings]
        rows = [run_jaxserve(llm, samples, o) for llm, o in zip(llms, settings, strict=True)]
        hf = _hf_model(model)
        rows += [run_hf_static(hf, samples, b) for b in args.static_batch]
        rows += [run_hf_cb(hf, samples, b) for b in args.budgets]
        rounds = []
        if args.rounds > 1 and args.budgets:  # the peer at its best budget of the sweep
            budget = max((r for r in rows if r["name"] == "hf-cb"),
                         key=lambda r: r["output_tokens_per_s"])["setting"].split()[0]
            rounds = paired_rounds(llms, hf, samples, settings, int(budget), args.rounds - 1)
    rate = measure_matmul_flops()
    flops = workload_flops(cfg, [s.prompt_len for s in samples], [s.output_len for s in samples])
    floor_s = flops / rate
    ours = rows[0]
    summary = {"model_params": cfg.num_params, "num_requests": len(samples),
               "workload_flops": flops, "matmul_flops_per_s": rate, "floor_s": floor_s,
               "ratios": ratios(rows), "rounds": rounds,
               "agreement": {f"{r['name']} {r['setting']}": agreement(ours["token_ids"],
                                                                      r["token_ids"])
                             for r in rows[1:]},
               "rows": [{k: v for k, v in r.items() if k != "token_ids"} | {
                   "floor_fraction": floor_s / r["elapsed_s"]} for r in rows]}
    print(f"\ncompute floor: {flops / 1e12:.3f} TFLOP / {rate / 1e9:.0f} GFLOP/s (float32 "
          f"matmul, measured) = {floor_s:.2f} s")
    for r in summary["rows"]:
        print(f"  {r['name']:<9} {r['setting']:<54} {r['elapsed_s']:7.2f} s = "
              f"{100 * r['floor_fraction']:5.1f}% of the floor's speed")
    for name, r in summary["ratios"].items():
        print(f"jaxserve / {name} (best: {r['best_setting']}, {r['peer_tokens_per_s']:.1f} "
              f"tok/s): {r['ratio']:.2f}x")
    if rounds:
        paired = [summary["ratios"]["hf-cb"]["ratio"]] + [r["ratio"] for r in rounds]
        summary["paired_ratios"] = paired
        summary["median_paired_ratio"] = statistics.median(paired)
        print(f"jaxserve / hf-cb, round by round: "
              f"{', '.join(f'{x:.2f}x' for x in paired)}; median "
              f"{summary['median_paired_ratio']:.2f}x")
        # each setting on its own (the best of them may not give the peer's ids: bfloat16 KV)
        peer_ids = max((r for r in rows if r["name"] == "hf-cb"),
                       key=lambda r: r["output_tokens_per_s"])["token_ids"]
        summary["by_setting"] = []
        for i, r in enumerate(rows[:len(settings)]):
            own = [r["output_tokens_per_s"] / summary["ratios"]["hf-cb"]["peer_tokens_per_s"]]
            own += [x["setting_ratios"][i] for x in rounds]
            same = agreement(r["token_ids"], peer_ids)["identical"]
            summary["by_setting"].append({"setting": r["setting"], "paired_ratios": own,
                                          "median": statistics.median(own),
                                          "identical_to_peer": same})
            print(f"  {r['setting']:<63} median {statistics.median(own):.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in own)}); ids {same}/{len(peer_ids)} "
                  "identical to hf-cb's")
    for name, a in summary["agreement"].items():
        print(f"greedy ids, jaxserve vs {name}: {a['identical']}/{a['total']} identical, "
              f"{100 * a['mean_prefix_fraction']:.1f}% of tokens before a first difference")
    if args.output_json:
        args.output_json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
