"""Scheduling policies under a bursty mix of short interactive and long batch requests, simulated.

    python bench/policies.py --model demo --plot-dir out/policies --output-json out/policies.json

The simulator drives the real scheduler with the step-cost fit of the model on this device
(calibrated on first use). Workload: Poisson arrivals with bursts of 3x the rate for 10 s in every
40 s, at --load times the capacity (the request throughput of fcfs when every request arrives at
once; 0.6 averages 0.9 of it, bursts 1.8x); 70 % interactive requests (priority 0, short prompts and outputs, a TTFT
target of --interactive-slo-ms) and 30 % batch (priority 1, long prompts and outputs, target
--batch-slo-ms). Each request's first token names its task, and the task sets its typical output
length: that is what the learned predictor can learn and the prompt-length proxy cannot.
Goodput: requests/s that met their class's TTFT target. Every policy sees the same requests.
"""

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.sim import Burst, RequestSpec, Simulator
from jaxserve.sim.metrics import format_table
from jaxserve.sim.workload import arrival_times
from jaxserve.tools.simulate import load_fit

# task -> (class, median prompt tokens, median output tokens). Prompt length says little about
# output length (a long document to classify, a short request for an essay); the task does.
TASKS = [("interactive", 160, 4), ("interactive", 48, 48), ("interactive", 96, 24),
         ("interactive", 224, 32), ("batch", 96, 160), ("batch", 32, 256),
         ("batch", 128, 128), ("batch", 64, 224)]
CLASSES = ("interactive", "batch")


def task_token(task: int) -> int:
    return 3 + 7 * task


def two_class_workload(n: int, rate: float, seed: int, max_model_len: int,
                       slo_ms: dict[str, float], bursts: bool = True,
                       shared_prefix_len: int = 0) -> list[RequestSpec]:
    """`shared_prefix_len`: each task's prompts open with the task's own prefix of that many
    tokens (a system prompt per application), the rest of the prompt random."""
    rng = np.random.default_rng(seed)
    prefixes = [np.random.default_rng(1000 + task).integers(3, 256, shared_prefix_len).tolist()
                for task in range(len(TASKS))]
    if bursts:
        horizon = 2 * n / rate
        burst = tuple(Burst(t, 10.0, 3.0) for t in np.arange(20.0, horizon, 40.0))
    else:
        burst = ()
    arrivals = arrival_times(n, rate, rng, bursts=burst)
    specs = []
    for arrival in arrivals:
        interactive = rng.random() < 0.7
        task = int(rng.integers(0, 4)) + (0 if interactive else 4)
        label, prompt_median, output_median = TASKS[task]
        prompt_len = shared_prefix_len + int(np.clip(
            rng.lognormal(np.log(prompt_median), 0.4), 2, max_model_len // 2 - shared_prefix_len))
        output_len = int(np.clip(rng.lognormal(np.log(output_median), 0.3), 1,
                                 max_model_len - prompt_len))
        prompt = (task_token(task), *prefixes[task],
                  *rng.integers(3, 256, size=prompt_len - shared_prefix_len - 1).tolist())
        specs.append(RequestSpec(float(arrival), prompt_len, output_len,
                                 priority=0 if interactive else 1, slo_ms=slo_ms[label],
                                 label=label, prompt_ids=prompt))
    return specs


def learned_predictor(max_model_len: int, slo_ms: dict[str, float], path: Path) -> Path:
    """Train the optax predictor on a separate sample of the workload; returns its file."""
    from jaxserve.tools.train_predictor import train_predictor

    sample = two_class_workload(2000, 10.0, seed=12345, max_model_len=max_model_len,
                                slo_ms=slo_ms, bursts=False)
    model = train_predictor([list(s.prompt_ids) for s in sample], [s.output_len for s in sample])
    model.save(path)
    return path


def capacity(config: EngineConfig, fit, num_pages: int, max_model_len: int,
             slo_ms: dict[str, float]) -> float:
    """Requests/s fcfs sustains on this mix: every request arrives at once."""
    specs = two_class_workload(500, float("inf"), 99, max_model_len, slo_ms, bursts=False)
    result = Simulator(config, fit, num_pages, max_model_len).run(specs)
    return result.metrics()["request_throughput"]


def per_class(result, label: str) -> dict:
    records = [r for r in result.records if r.label == label]
    ttft = np.array([r.ttft for r in records]) * 1000
    return {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99)),
            "mean": float(ttft.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--fit", type=Path, help="step-cost fit (default: the user cache)")
    parser.add_argument("--num-prompts", type=int, default=4000)
    parser.add_argument("--load", type=float, default=0.6,
                        help="the base arrival rate as a fraction of the capacity")
    parser.add_argument("--request-rate", type=float, help="requests/s (overrides --load)")
    parser.add_argument("--num-pages", type=int, default=200,
                        help="KV pages: few enough that the bursts preempt")
    parser.add_argument("--interactive-slo-ms", type=float, default=1000.0)
    parser.add_argument("--batch-slo-ms", type=float, default=15000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="each task's prompts open with a shared prefix this long; adds "
                             "fcfs without the prefix cache and the lpm policy to the variants")
    parser.add_argument("--plot-dir", type=Path)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()

    slo_ms = {"interactive": args.interactive_slo_ms, "batch": args.batch_slo_ms}
    base = EngineConfig()
    fit = load_fit(args.model, base, args.fit)
    max_model_len = fit.info["max_model_len"]
    rate = args.request_rate
    if rate is None:
        rate = args.load * capacity(base, fit, args.num_pages, max_model_len, slo_ms)
    specs = two_class_workload(args.num_prompts, rate, args.seed, max_model_len, slo_ms,
                               shared_prefix_len=args.shared_prefix_len)
    tmp = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    predictor = learned_predictor(max_model_len, slo_ms, tmp / "predictor.json")
    train_s = time.perf_counter() - start
    variants = {
        "fcfs": dict(policy="fcfs"),
        "fcfs+buckets": dict(policy="fcfs", length_bucketing=True),
        "priority": dict(policy="priority"),
        "sjf-oracle": dict(policy="sjf", sjf_predictor="oracle"),
        "sjf-prompt": dict(policy="sjf", sjf_predictor="prompt"),
        "sjf-learned": dict(policy="sjf", sjf_predictor=str(predictor)),
        "mlfq": dict(policy="mlfq"),
        "edf": dict(policy="edf"),
    }
    if args.shared_prefix_len:  # every variant caches prefixes (the default): the policy
        # that orders by the cache, and fcfs without it
        variants |= {"fcfs-nocache": dict(policy="fcfs", enable_prefix_caching=False),
                     "lpm": dict(policy="lpm")}
    rows, results, report = {}, {}, {}
    for name, overrides in variants.items():
        config = dataclasses.replace(base, **overrides)
        start = time.perf_counter()
        result = Simulator(config, fit, args.num_pages, max_model_len).run(specs)
        elapsed = time.perf_counter() - start
        metrics = result.metrics()
        classes = {label: per_class(result, label) for label in CLASSES}
        rows[name] = {
            "int p50": classes["interactive"]["p50"], "int p99": classes["interactive"]["p99"],
            "batch p50": classes["batch"]["p50"], "batch p99": classes["batch"]["p99"],
            "out tok/s": metrics["output_throughput"], "goodput": metrics["request_goodput"],
            "good %": 100 * metrics["request_goodput"] / metrics["request_throughput"],
            "preempt": metrics["num_preemptions"], "sim s": elapsed,
            "hit %": 100 * result.prefix_cache_hits / max(1, result.prefix_cache_queries),
        }
        results[name] = result
        report[name] = {"metrics": metrics, "ttft_ms_by_class": classes}
    print(f"{len(specs)} requests ({sum(s.label == 'interactive' for s in specs)} interactive), "
          f"{rate:.3g} req/s with 3x bursts, {args.num_pages} KV pages; "
          f"model fit: {fit.info.get('model')} on {fit.info.get('device')}; "
          f"learned predictor trained in {train_s:.1f} s")
    print("TTFT in ms by class; goodput: requests/s within their class's TTFT target")
    print(format_table(rows, list(next(iter(rows.values())))))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "results": report}, indent=1))
    if args.plot_dir:
        plot(args.plot_dir, results, rows)


def plot(folder: Path, results: dict, rows: dict) -> None:
    from jaxserve.sim.plots import plot_bars, plot_timeline, plot_ttft_cdf

    folder.mkdir(parents=True, exist_ok=True)
    for label in CLASSES:
        plot_ttft_cdf({name: [r for r in res.records if r.label == label]
                       for name, res in results.items()}, folder / f"ttft_cdf_{label}.png",
                      f"TTFT, {label} requests")
    plot_bars({name: {"interactive": row["int p99"], "batch": row["batch p99"]}
               for name, row in rows.items()}, folder / "ttft_p99.png", "p99 TTFT (ms)",
              "p99 time to first token by class", log=True)
    for name in ("fcfs", "mlfq"):
        plot_timeline(results[name], folder / f"timeline_{name}.png", name)
    print(f"plots in {folder}")


if __name__ == "__main__":
    main()
