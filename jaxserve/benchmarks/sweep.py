"""`jaxserve bench sweep`: the sweeps users would otherwise script, with plots and a
recommended config.

    concurrency  closed loop at 1, 2, 4 ... 256 requests in flight (the engine's max_num_seqs
                 follows): throughput, tail TTFT/TPOT, the knee of the throughput curve
    window       open loop at a request rate, window_ms 0..200, in dynamic batching and in
                 continuous batching behind the window (the two-layer strategy)
    modes        the table users ask for: static vs dynamic vs continuous at concurrency
                 1, 8, 32, 64, 128, 256 on one workload (`--preset modes`)

    jaxserve bench sweep --model bench/models/llama-20m --load-format dummy \\
        --slo ttft:2000 tpot:200 --output-dir bench/plots --write-config configs/recommended.yaml

The offline engine is built once (its max_num_seqs covers the largest concurrency) and given a
fresh scheduler per point. With --base-url the concurrency sweep runs against a server instead
(its engine is fixed, so only the client's concurrency moves).

Recommended config: the largest concurrency whose tail latency meets every SLO (and every smaller
one does too), backed off 20%, as max_num_seqs; then the window sweep at 70% of the request rate
reached there, with that max_num_seqs: the mode and window with the best throughput among those
that meet the SLO, the window backed off 20% as well.
"""

import asyncio
import csv
import json
import math
import sys
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
from jaxserve.benchmarks.datasets import check_args as check_workload_args
from jaxserve.benchmarks.metrics import serving_result
from jaxserve.sim.metrics import LATENCIES, format_table, parse_slos, percentile_key

KINDS = ("concurrency", "window", "modes")
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MODES_CONCURRENCY = (1, 8, 32, 64, 128, 256)
WINDOWS_MS = (0, 5, 10, 20, 50, 100, 200)
MODES = ("static", "dynamic", "continuous")
PERCENTILES = (50, 90, 99)
SUMMARY = ("completed", "failed", "duration", "request_throughput", "output_throughput",
           "total_token_throughput", "num_preemptions", "num_compilations")
# window sweep throughputs this close to the best are tied (an open loop's throughput is its
# arrival rate give or take noise)
TIED = 0.02
FLAT = 0.05  # a throughput curve whose spread is within this fraction of its top is flat
# engine keys a recommended config does not carry (they describe the run, not the setting)
NOT_RECOMMENDED = ("load_format", "seed", "compilation_cache_dir", "kv_cache_bytes_cpu")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="offline: a local model directory, or "
                        "demo (default)")
    parser.add_argument("--base-url", default=None, help="sweep a running server instead")
    parser.add_argument("--tokenizer", default=None, help="server: a local model directory")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--kind", nargs="+", choices=KINDS, default=None,
                        help="default: concurrency and window offline, concurrency for a "
                        "server (its window is fixed)")
    parser.add_argument("--preset", choices=["modes"], help="modes: static vs dynamic vs "
                        "continuous at concurrency 1, 8, 32, 64, 128, 256")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY),
                        help="concurrency sweep: requests in flight")
    parser.add_argument("--modes-concurrency", type=int, nargs="+",
                        default=list(MODES_CONCURRENCY), help="modes table: requests in flight")
    parser.add_argument("--windows", type=float, nargs="+", default=list(WINDOWS_MS),
                        metavar="MS", help="window sweep: the window_ms values")
    parser.add_argument("--window-modes", nargs="+", choices=["dynamic", "continuous"],
                        default=["dynamic", "continuous"])
    parser.add_argument("--request-rate", type=float, default=None,
                        help="window sweep arrivals (default: 70%% of the concurrency sweep's "
                        "throughput at the recommended setting)")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--modes-window-ms", type=float, default=20.0,
                        help="the dynamic mode's window in the modes table")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per point (default: max(16, --prompts-per-concurrency x "
                        "concurrency); window sweep 64)")
    parser.add_argument("--prompts-per-concurrency", type=float, default=2.0)
    add_dataset_arguments(parser, input_len=128, output_len=64)
    parser.add_argument("--slo", nargs="+", metavar="NAME:MS", default=["ttft:1000", "tpot:100"],
                        help="tail-latency targets (ttft, tpot, e2el) for the recommendation")
    parser.add_argument("--slo-percentile", type=float, default=99, choices=PERCENTILES)
    parser.add_argument("--backoff", type=float, default=0.2,
                        help="how far below the largest setting meeting the SLO to recommend, "
                        "in [0, 1)")
    parser.add_argument("--output-dir", type=Path, default=Path("sweep-results"))
    parser.add_argument("--write-config", type=Path, default=None,
                        help="write the recommended engine config (YAML) here")
    parser.add_argument("--disable-tqdm", action="store_true")


# -- targets: where a point runs ------------------------------------------------------------------

class OfflineTarget:
    """An in-process engine; each point gets a scheduler built from `options`."""

    def __init__(self, engine):
        self.engine = engine
        self.max_concurrency = engine.config.max_num_seqs
        self.label = engine.config.batching

    def run(self, samples: list[Sample], options: dict, concurrency: int | None,
            request_rate: float, burstiness: float, seed: int) -> dict:
        from jaxserve.benchmarks.offline import run_load, use_scheduler

        use_scheduler(self.engine, **options)
        compiles = self.engine.stats()["num_compilations_after_warmup"]
        run = run_load(self.engine, samples, request_rate=request_rate, burstiness=burstiness,
                       max_concurrency=concurrency, seed=seed)
        stats = self.engine.stats()
        return serving_result(run.records, run.errors, run.duration, None, list(LATENCIES),
                              list(PERCENTILES)) | {
            "num_preemptions": stats["num_preemptions"],  # the new scheduler's count
            "num_compilations": stats["num_compilations_after_warmup"] - compiles}


class ServerTarget:
    """A running OpenAI-compatible server; only the client's load can change."""

    def __init__(self, base_url: str, model: str, api_key: str | None):
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.max_concurrency = None
        self.label = "server"

    def run(self, samples: list[Sample], options: dict, concurrency: int | None,
            request_rate: float, burstiness: float, seed: int) -> dict:
        from jaxserve.benchmarks.serve import benchmark

        if options:
            raise ValueError(f"a server's engine options are fixed; cannot sweep {sorted(options)}")
        records, errors, _, duration = asyncio.run(benchmark(
            self.base_url, "/v1/completions", self.model, samples, request_rate=request_rate,
            burstiness=burstiness, max_concurrency=concurrency, ignore_eos=True,
            api_key=self.api_key, seed=seed))
        return serving_result(records, errors, duration, None, list(LATENCIES), list(PERCENTILES))


def _row(result: dict, **setting) -> dict:
    keep = [k for k in result if k.endswith("_ms")]
    return setting | {k: result[k] for k in (*SUMMARY, *keep) if k in result}


# -- the sweeps -----------------------------------------------------------------------------------

def _points(samples: list[Sample], n: int) -> list[Sample]:
    return samples[:n] if n <= len(samples) else [samples[i % len(samples)] for i in range(n)]


def num_points(num_prompts: int | None, per_concurrency: float, concurrency: int) -> int:
    return num_prompts or max(16, math.ceil(per_concurrency * concurrency))


def sweep_concurrency(target, samples: list[Sample], concurrencies, num_prompts: int | None,
                      per_concurrency: float = 2.0, batching: str | None = None, seed: int = 0,
                      window_ms: float = 0.0, log=print) -> list[dict]:
    rows = []
    for c in concurrencies:
        n = num_points(num_prompts, per_concurrency, c)
        options = {} if isinstance(target, ServerTarget) else {"max_num_seqs": c}
        if batching is not None:
            options |= {"batching": batching, "window_ms": window_ms}
        result = target.run(_points(samples, n), options, c, float("inf"), 1.0, seed)
        row = _row(result, batching=batching or target.label, concurrency=c, num_prompts=n)
        rows.append(row)
        log(f"  {row['batching']:<11} concurrency {c:>4}: {row['output_throughput']:8.1f} "
            f"out tok/s, p99 TTFT {row['p99_ttft_ms']:8.1f} ms, p99 TPOT "
            f"{row['p99_tpot_ms']:7.1f} ms")
    return rows


def sweep_window(target, samples: list[Sample], windows, modes, request_rate: float,
                 burstiness: float, max_num_seqs: int, num_prompts: int, seed: int = 0,
                 log=print) -> list[dict]:
    rows = []
    for mode in modes:
        for w in windows:
            options = {"batching": mode, "window_ms": float(w), "max_num_seqs": max_num_seqs}
            result = target.run(_points(samples, num_prompts), options, None, request_rate,
                                burstiness, seed)
            row = _row(result, batching=mode, window_ms=float(w), request_rate=request_rate,
                       max_num_seqs=max_num_seqs, num_prompts=num_prompts)
            rows.append(row)
            log(f"  {mode:<11} window {w:>6g} ms: {row['output_throughput']:8.1f} out tok/s, "
                f"p99 E2EL {row['p99_e2el_ms']:9.1f} ms, p99 TTFT {row['p99_ttft_ms']:8.1f} ms")
    return rows


def sweep_modes(target, samples: list[Sample], concurrencies, num_prompts: int | None,
                per_concurrency: float, window_ms: float, seed: int = 0,
                log=print) -> list[dict]:
    rows = []
    for c in concurrencies:  # the modes side by side at each point, so drift hits all alike
        for mode in MODES:
            rows += sweep_concurrency(target, samples, [c], num_prompts, per_concurrency, mode,
                                      seed, window_ms if mode == "dynamic" else 0.0, log)
    return sorted(rows, key=lambda r: MODES.index(r["batching"]))


# -- reading the results --------------------------------------------------------------------------

def knee(xs: list, ys: list[float]):
    """Kneedle on (log2 x, y): the point farthest above the chord of a rising, flattening curve.
    A curve flat within FLAT (run-to-run noise) from its first point has its knee there: more
    concurrency bought nothing."""
    if len(xs) < 3:
        return None
    x = np.log2(np.asarray(xs, float))
    y = np.asarray(ys, float)
    if np.ptp(x) == 0:
        return None
    if np.ptp(y) <= FLAT * y.max():
        return xs[int(np.argmin(x))]
    gain = (y - y.min()) / np.ptp(y) - (x - x.min()) / np.ptp(x)
    if gain.max() <= 0:  # never above the chord: still scaling, no knee yet
        return None
    return xs[int(np.argmax(gain))]


def meets(row: dict, slo: dict[str, float], pct: str) -> bool:
    return row["failed"] == 0 and all(row[f"{pct}_{name}_ms"] <= ms for name, ms in slo.items())


def largest_meeting(rows: list[dict], key: str, slo: dict[str, float], pct: str) -> dict | None:
    """The row with the largest `key` such that it and every smaller setting meet the SLO."""
    best = None
    for row in sorted(rows, key=lambda r: r[key]):
        if not meets(row, slo, pct):
            break
        best = row
    return best


def recommend(concurrency_rows: list[dict], window_rows: list[dict], slo: dict[str, float],
              pct: str, backoff: float) -> dict:
    """The recommended engine settings and why; empty when nothing meets the SLO."""
    out: dict = {}
    limit = largest_meeting(concurrency_rows, "concurrency", slo, pct)
    if limit is not None and limit["concurrency"] == max(r["concurrency"]
                                                         for r in concurrency_rows):
        out["max_num_seqs"] = limit["concurrency"]  # measured to meet it; the limit is beyond
        out["_why_max_num_seqs"] = (f"every concurrency swept met the SLO, up to "
                                    f"{limit['concurrency']}: the limit lies beyond (sweep "
                                    "higher to find it)")
    elif limit is not None:
        out["max_num_seqs"] = max(1, math.floor(limit["concurrency"] * (1 - backoff)))
        out["_why_max_num_seqs"] = (f"concurrency {limit['concurrency']} is the largest meeting "
                                    f"the SLO ({limit['batching']} batching); backed off "
                                    f"{backoff:.0%}")
    ok = [r for r in window_rows if meets(r, slo, pct)]
    if ok:
        # the best throughput meeting the SLO; an open loop's throughput follows its arrival
        # rate, so within TIED of the best counts as a tie, which the smaller window (then the
        # lower tail TTFT) wins: a window only adds latency unless it buys throughput
        top = max(r["output_throughput"] for r in ok)
        best = min((r for r in ok if r["output_throughput"] >= (1 - TIED) * top),
                   key=lambda r: (r["window_ms"], r[f"{pct}_ttft_ms"]))
        # the window as measured, not backed off: the smaller windows measured either missed
        # the SLO or lost throughput, and one never measured is no safer
        out["batching"] = best["batching"]
        out["window_ms"] = best["window_ms"]
        out["_why_window"] = (f"{best['batching']} at window {best['window_ms']:g} ms has the "
                              f"best throughput meeting the SLO ({best['output_throughput']:.1f} "
                              f"out tok/s, ties within {TIED:.0%} to the smaller window)")
    return out


def write_config(path: Path, base: dict, recommendation: dict, header: list[str]) -> dict:
    import yaml

    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in base.items()
              if k not in NOT_RECOMMENDED}
    config |= {k: v for k, v in recommendation.items() if not k.startswith("_")}
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(config, sort_keys=False)
    path.write_text(text)
    return config


def _write_rows(out_dir: Path, name: str, rows: list[dict]) -> None:
    (out_dir / f"{name}.json").write_text(json.dumps(rows, indent=2))
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# -- the command ----------------------------------------------------------------------------------

def sweep_kinds(args) -> list[str]:
    if args.preset == "modes":
        return ["modes"]
    if args.kind is None:
        return ["concurrency"] if args.base_url is not None else ["concurrency", "window"]
    return list(dict.fromkeys(args.kind))


def check_args(args) -> None:
    """The sweep's flags, checked before a model loads or a request goes out."""
    check_workload_args(args)
    kinds = sweep_kinds(args)
    for flag, values in (("--concurrency", args.concurrency),
                         ("--modes-concurrency", args.modes_concurrency)):
        if any(v < 1 for v in values):
            raise ValueError(f"{flag} values must be at least 1, got {values}")
    if any(not 0 <= w < float("inf") for w in (*args.windows, args.modes_window_ms)):
        raise ValueError(f"--windows and --modes-window-ms must be finite and >= 0, got "
                         f"{args.windows} and {args.modes_window_ms}")
    if not 0 <= args.backoff < 1:
        raise ValueError(f"--backoff must be in [0, 1), got {args.backoff}")
    if not 0 < args.prompts_per_concurrency < float("inf"):
        raise ValueError(f"--prompts-per-concurrency must be above 0, got "
                         f"{args.prompts_per_concurrency}")
    if args.base_url is not None:
        offline = [k for k in kinds if k != "concurrency"]
        if offline:
            raise ValueError(f"the {' and '.join(offline)} sweep needs the offline engine (a "
                             "server's batching and window are fixed): drop --base-url, or "
                             "--kind concurrency")
        if args.write_config is not None:
            raise ValueError("--write-config needs the offline engine (a server's settings "
                             "are not known here): drop --base-url")


def run(args, engine_options: dict) -> dict:
    from jaxserve.benchmarks import plots

    kinds = sweep_kinds(args)
    slo = parse_slos(args.slo)
    pct = percentile_key(args.slo_percentile)
    concurrency = args.concurrency if "concurrency" in kinds else []
    modes_concurrency = args.modes_concurrency if "modes" in kinds else []
    # None: a window sweep alone runs at the engine's own max_num_seqs
    largest = max([*concurrency, *modes_concurrency], default=None)
    target, vocab, tokenizer, max_len = _target(args, engine_options, largest, kinds)
    n_max = max(num_points(args.num_prompts, args.prompts_per_concurrency, largest or 1),
                args.num_prompts or 64)
    samples = get_samples(dataset_of(args), n_max, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.random_range_ratio,
                          vocab_size=vocab, seed=args.seed, tokenizer=tokenizer,
                          max_model_len=max_len, **workload_options(args))
    if isinstance(target, OfflineTarget):
        from jaxserve.benchmarks.offline import warm_up

        warm_up(target.engine, samples)
    out_dir = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"date": datetime.now().isoformat(timespec="seconds"), "slo": slo,
                     "slo_percentile": pct}
    conc_rows, window_rows = [], []
    if "concurrency" in kinds:
        print("concurrency sweep")
        conc_rows = sweep_concurrency(target, samples, concurrency, args.num_prompts,
                                      args.prompts_per_concurrency, seed=args.seed)
        _write_rows(out_dir, "concurrency", conc_rows)
        summary["knee"] = knee([r["concurrency"] for r in conc_rows],
                               [r["output_throughput"] for r in conc_rows])
        summary["plots"] = [str(p) for p in plots.concurrency_plots(
            conc_rows, out_dir, summary["knee"], slo, pct)]
        print(_table(conc_rows, ["concurrency"]))
        print(f"knee of the throughput curve: concurrency {summary['knee']}")
    if "window" in kinds:
        rec = recommend(conc_rows, [], slo, pct, args.backoff)
        seqs = rec.get("max_num_seqs", target.max_concurrency)
        rate = args.request_rate or _default_rate(conc_rows, seqs)
        print(f"window sweep at {rate:.2f} requests/s, max_num_seqs {seqs}")
        window_rows = sweep_window(target, samples, args.windows, args.window_modes, rate,
                                   args.burstiness, seqs, args.num_prompts or 64, args.seed)
        _write_rows(out_dir, "window", window_rows)
        summary.setdefault("plots", []).append(str(plots.window_plot(window_rows, out_dir, slo,
                                                                     pct)))
        print(_table(window_rows, ["batching", "window_ms"]))
    if "modes" in kinds:
        print("batching modes")
        rows = sweep_modes(target, samples, modes_concurrency, args.num_prompts,
                           args.prompts_per_concurrency, args.modes_window_ms, args.seed)
        _write_rows(out_dir, "modes", rows)
        summary["modes"] = rows
        summary.setdefault("plots", []).append(str(plots.modes_plot(rows, out_dir, pct)))
        print(_table(rows, ["batching", "concurrency"]))
    rec = recommend(conc_rows, window_rows, slo, pct, args.backoff)
    summary["recommended"] = rec
    summary["engine"] = {k: list(v) if isinstance(v, tuple) else v
                         for k, v in engine_options.items()}
    _print_recommendation(rec, slo, pct)
    if args.write_config is not None and not any(not k.startswith("_") for k in rec):
        print(f"not writing {args.write_config}: nothing to recommend")
    elif args.write_config is not None:
        header = [f"recommended by `jaxserve bench sweep` on {summary['date']}",
                  f"model {target.engine.model_path}; SLO: {describe_slo(slo, pct)}"]
        header += [v for k, v in rec.items() if k.startswith("_")]
        summary["config"] = write_config(args.write_config, engine_options, rec, header)
        print(f"wrote {args.write_config}")
    (out_dir / "sweep.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _target(args, engine_options: dict, max_concurrency: int | None, kinds: list[str]):
    """(target, vocab size, tokenizer, max_model_len)."""
    if args.base_url is not None:
        from jaxserve.benchmarks.serve import first_model, model_info

        model = args.model or first_model(args.base_url, args.api_key)
        vocab, tokenizer, max_len = model_info(args.tokenizer, model)
        return ServerTarget(args.base_url, model, args.api_key), vocab, tokenizer, max_len
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    # no prompt-logprob steps to compile: the sweep asks for none (not a recommendation, so
    # not written to the config)
    options = {"enable_prompt_logprobs": False} | engine_options
    if max_concurrency is not None:
        options.setdefault("max_num_seqs", max_concurrency)
        if options["max_num_seqs"] < max_concurrency:
            raise ValueError(f"max_num_seqs {options['max_num_seqs']} is below the largest "
                             f"concurrency {max_concurrency}")
    seqs = options.get("max_num_seqs", EngineConfig.max_num_seqs)
    options.setdefault("max_num_batched_tokens", max(EngineConfig.max_num_batched_tokens, seqs))
    start = time.perf_counter()
    engine = LLMEngine(args.model, EngineConfig.from_overrides(**options),
                       progress=sys.stderr.isatty())
    print(f"loaded {engine.model_path} and compiled in {time.perf_counter() - start:.1f} s")
    engine_options.update({k: v for k, v in options.items()
                           if k != "enable_prompt_logprobs" or k in engine_options})
    return (OfflineTarget(engine), engine.model_config.vocab_size, engine.tokenizer,
            engine.max_model_len)


def _default_rate(rows: list[dict], max_num_seqs: int) -> float:
    if not rows:
        raise ValueError("the window sweep needs --request-rate (or a concurrency sweep first)")
    below = [r for r in rows if r["concurrency"] <= max_num_seqs] or rows
    return 0.7 * max(r["request_throughput"] for r in below)


def _table(rows: list[dict], keys: list[str]) -> str:
    named = {" ".join(str(r[k]) if k == "batching" else f"{k}={r[k]:g}" for k in keys): r
             for r in rows}
    return format_table(named, ["output_throughput", "request_throughput", "p99_ttft_ms",
                                "p99_tpot_ms", "p99_e2el_ms"])


def describe_slo(slo: dict[str, float], pct: str) -> str:
    return ", ".join(f"{pct} {name.upper()} <= {ms:g} ms" for name, ms in slo.items())


def _print_recommendation(rec: dict, slo: dict, pct: str) -> None:
    if not rec:
        print(f"recommended config: none (no setting met the SLO: {describe_slo(slo, pct)})")
        return
    settings = ", ".join(f"{k}={v}" for k, v in rec.items() if not k.startswith("_"))
    print(f"recommended config (SLO: {describe_slo(slo, pct)}): {settings}")
    for k, v in rec.items():
        if k.startswith("_"):
            print(f"  {v}")
