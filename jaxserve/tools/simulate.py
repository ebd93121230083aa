"""`jaxserve simulate` (also `python -m jaxserve.sim`): simulate, calibrate, validate.

    python -m jaxserve.sim --num-prompts 10000 --request-rate 20 --policy sjf
    python -m jaxserve.sim --calibrate                         # profile this device, save the fit
    python -m jaxserve.sim --validate --num-prompts 200 --output-json errors.json
    python -m jaxserve.sim --calibrate --validate ...             # a fresh fit, then validate

The model defaults to the demo model; a command that needs the fit and finds none saved
calibrates first. --calibrate and --validate run the real engine (they import jax); simulating
does not.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jaxserve.config.engine import EngineConfig, read_config_file
from jaxserve.sim.cost_model import StepCostModel, default_fit_path, fit_mismatches
from jaxserve.sim.metrics import format_table, parse_slos
from jaxserve.sim.simulator import Simulator
from jaxserve.sim.workload import (
    Burst,
    RequestSpec,
    arrival_times,
    read_trace,
    synthetic,
    write_trace,
)

# engine fields offered as flags (the rest through --set KEY=VALUE)
SIM_VOCAB = 32000  # the shared-prefix workloads' token ids (the simulator runs no model)
ENGINE_FLAGS = ("policy", "batching", "max_num_seqs", "max_num_batched_tokens", "decode_steps",
                "window_ms", "adaptive_window", "window_ms_min", "window_ms_max",
                "min_batch_size", "max_batch_size", "slo_ms", "sjf_predictor",
                "length_bucketing", "num_pages", "max_model_len", "page_size",
                "prefill_chunk_sizes")
SUMMARY = ("completed", "request_throughput", "output_throughput", "request_goodput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
           "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
           "median_e2el_ms", "p99_e2el_ms", "num_preemptions")


def _flag_type(field: dataclasses.Field):
    default = field.default
    if isinstance(default, bool):
        return None  # a store_true flag
    if field.name == "prefill_chunk_sizes":  # "16 64" as the other commands, or "16,64"
        return lambda v: [int(x) for x in v.split(",")]
    if isinstance(default, float):
        return float
    if isinstance(default, int) or field.name in ("num_pages", "max_model_len", "max_batch_size"):
        return int
    return str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="demo",
                        help="model directory or 'demo' (default)")
    parser.add_argument("--calibrate", action="store_true",
                        help="profile the real runner on this device and save the fit")
    parser.add_argument("--validate", action="store_true",
                        help="run the workload on the real engine and in the simulator; compare")
    parser.add_argument("--fit", type=Path, help="the fit file (default: the user cache)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="--validate: engine runs of the workload; the simulator is compared "
                             "with their mean, and their spread is reported as noise (with "
                             "--calibrate they alternate with the calibration's open loops; a "
                             "single run's mean TPOT drifts 5-18%% on a shared CPU)")
    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=1000)
    w.add_argument("--request-rate", type=float, default=10.0, help="requests/s (inf: all at 0)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, < 1 burstier")
    w.add_argument("--burst", action="append", default=[], metavar="START:DURATION[:FACTOR]",
                   help="multiply the rate (default 3x) over a period; repeatable")
    w.add_argument("--length-dist", choices=["lognormal", "uniform"], default="lognormal")
    w.add_argument("--input-len", type=float, default=128, help="median prompt tokens")
    w.add_argument("--output-len", type=float, default=64, help="median output tokens")
    w.add_argument("--input-spread", type=float, default=0.8,
                   help="lognormal sigma, or uniform relative half-width")
    w.add_argument("--output-spread", type=float, default=0.8)
    w.add_argument("--dataset", choices=["synthetic", "prefix_repetition", "multiturn"],
                   default="synthetic", help="synthetic: prompts of their own (lengths as "
                   "above); prefix_repetition: --num-prefixes shared prefixes of --prefix-len "
                   "tokens and suffixes of --input-len; multiturn: chats of --turns turns, each "
                   "resending the chat (messages --input-len, replies --output-len), turn by turn")
    w.add_argument("--prefix-len", type=int, default=256)
    w.add_argument("--num-prefixes", type=int, default=8)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--trace", type=Path, help="a JSONL trace instead of a generated workload")
    w.add_argument("--save-trace", type=Path, help="write the workload as a JSONL trace")
    w.add_argument("--seed", type=int, default=0)
    e = parser.add_argument_group("engine (the names of EngineConfig)")
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in ENGINE_FLAGS:
        flag, kind = "--" + name.replace("_", "-"), _flag_type(fields[name])
        if kind is None:
            e.add_argument(flag, action="store_true", default=None)
        elif name == "prefill_chunk_sizes":
            e.add_argument(flag, type=kind, nargs="+", default=None)
        else:
            e.add_argument(flag, type=kind, default=None)
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other engine option")
    e.add_argument("--config", type=Path, help="a YAML file of engine options (configs/*.yaml, "
                   "or what `jaxserve bench sweep --write-config` wrote); flags override it")
    o = parser.add_argument_group("output")
    o.add_argument("--goodput", nargs="*", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    o.add_argument("--output-json", type=Path)
    o.add_argument("--plot-dir", type=Path)


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Register `simulate` on a CLI's subparsers (jaxserve/cli.py)."""
    parser = subparsers.add_parser("simulate", help="the scheduling simulator",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def engine_config(args) -> EngineConfig:
    overrides = _config_file(args.config) if getattr(args, "config", None) else {}
    overrides |= {name: getattr(args, name) for name in ENGINE_FLAGS
                  if getattr(args, name, None) is not None}
    if "prefill_chunk_sizes" in overrides and args.prefill_chunk_sizes is not None:
        overrides["prefill_chunk_sizes"] = tuple(n for part in args.prefill_chunk_sizes
                                                 for n in part)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return EngineConfig.from_overrides(**overrides)


def _config_file(path: Path) -> dict:
    """A config file's engine options; its server keys (port, api_key, ...) do not apply."""
    from jaxserve.server.config import ServerConfig  # only here: the simulator loads without jax

    data = read_config_file(path)
    server = {f.name for f in dataclasses.fields(ServerConfig)}
    return {k: v for k, v in data.items() if k not in server}


def workload(args, max_model_len: int) -> list[RequestSpec]:
    if args.trace is not None:
        specs = read_trace(args.trace)
        if args.save_trace is not None:
            write_trace(args.save_trace, specs)
        return specs
    bursts = [Burst(*(float(x) for x in item.split(":"))) for item in args.burst]  # checked
    if args.dataset != "synthetic":
        return shared_prefixes(args, bursts)
    specs = synthetic(args.num_prompts, args.request_rate, seed=args.seed,
                      burstiness=args.burstiness, bursts=tuple(bursts), dist=args.length_dist,
                      input_len=args.input_len, output_len=args.output_len,
                      input_spread=args.input_spread, output_spread=args.output_spread,
                      max_model_len=max_model_len)
    capped = sum(s.prompt_len + s.output_len >= max_model_len for s in specs)
    if capped:
        print(f"note: {capped} of {len(specs)} requests were cut to fit max_model_len "
              f"{max_model_len} (median output {statistics.median(s.output_len for s in specs):g} "
              f"tokens)", file=sys.stderr)
    if args.save_trace is not None:
        write_trace(args.save_trace, specs)
    return specs


def shared_prefixes(args, bursts: list[Burst]) -> list[RequestSpec]:
    """The prefix-sharing workloads of `jaxserve bench` (their prompts' ids, so the prefix
    cache finds what they share), arriving as --request-rate and --burstiness say."""
    from jaxserve.benchmarks.datasets import multiturn_samples, prefix_repetition_samples

    n, message, reply = args.num_prompts, int(args.input_len), int(args.output_len)
    if args.dataset == "prefix_repetition":
        samples = prefix_repetition_samples(n, args.prefix_len, message, args.num_prefixes,
                                            reply, SIM_VOCAB, args.seed)
    else:
        samples = multiturn_samples(n, args.turns, message, reply, SIM_VOCAB, args.seed)
    arrivals = arrival_times(n, args.request_rate, np.random.default_rng(args.seed),
                             args.burstiness, tuple(bursts))
    specs = [RequestSpec(float(a), s.prompt_len, s.output_len, prompt_ids=tuple(s.prompt))
             for a, s in zip(arrivals, samples, strict=True)]
    if args.save_trace is not None:
        write_trace(args.save_trace, specs)
    return specs


def load_fit(model: str, config: EngineConfig, path: Path | None) -> StepCostModel:
    """The saved fit; calibrates (the real engine, on this device) when there is none."""
    path = path or default_fit_path(model, config)
    if path.is_file():
        return StepCostModel.load(path)
    print(f"no step-cost fit at {path}: calibrating {model} on this device", file=sys.stderr)
    from jaxserve.tools.calibrate import calibrate  # the real engine: imports jax

    return calibrate(model, config, path)


def check_args(args) -> None:
    """The workload flags, before any fit loads or engine compiles: a ValueError naming the
    flag (a negative length used to simulate 1-token requests, or fail deep in numpy)."""
    def number(flag: str, value, low: float, inclusive: bool = True, inf: bool = False) -> None:
        ok = isinstance(value, int | float) and not math.isnan(value) and (
            value >= low if inclusive else value > low) and (inf or math.isfinite(value))
        if not ok:
            raise ValueError(f"{flag} must be {'>=' if inclusive else '>'} {low:g}"
                             f"{'' if inf else ' and finite'}, got {value}")

    number("--num-prompts", args.num_prompts, 1)
    number("--repeats", args.repeats, 1)
    number("--request-rate", args.request_rate, 0, inclusive=False, inf=True)
    number("--burstiness", args.burstiness, 0, inclusive=False, inf=True)
    for flag in ("input_len", "output_len"):
        number("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    for flag in ("input_spread", "output_spread"):
        number("--" + flag.replace("_", "-"), getattr(args, flag), 0)
    for item in args.burst:
        try:
            parts = [float(x) for x in item.split(":")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or parts[0] < 0 or not all(p > 0 for p in parts[1:]):
            raise ValueError(f"--burst takes START:DURATION[:FACTOR] (start >= 0, duration "
                             f"and factor > 0), got {item!r}")


def run(args) -> int:
    check_args(args)
    config = engine_config(args)
    if args.validate:
        return _validate(args, config)
    if args.calibrate:
        from jaxserve.tools.calibrate import calibrate

        fit = calibrate(args.model, config, args.fit, freeze=True)
        print(json.dumps(fit.info, indent=1))
        return 0
    if config.speculative_config is not None:  # its steps' costs and acceptance are not fit
        raise ValueError("speculative_config: the simulator does not model speculative "
                         "decoding; leave it unset")
    for name in ("kv_cache_memory_fraction", "kv_cache_bytes_cpu"):
        if getattr(config, name) != getattr(EngineConfig(), name):
            raise ValueError(f"{name}: the simulator sizes the KV cache by num_pages (the fit's "
                             f"{name} decided its page count); pass --num-pages")
    fit = load_fit(args.model, config, args.fit)
    mismatches = fit_mismatches(fit, config)
    if mismatches:  # a fit given by --fit may come from another engine shape
        print(f"warning: the fit was measured with other engine settings ({'; '.join(mismatches)}"
              "): its step costs may not hold", file=sys.stderr)
    # the engine's limits as given, else the fit's: its pool's tokens, in this page size
    max_model_len = config.max_model_len or fit.info["max_model_len"]
    measured = fit.info.get("engine") if isinstance(fit.info.get("engine"), dict) else {}
    fit_tokens = fit.info["num_pages"] * measured.get("page_size", config.page_size)
    num_pages = config.num_pages or fit_tokens // config.page_size
    specs = workload(args, max_model_len)
    start = time.perf_counter()
    # --seed seeds the workload and the step-time draws alike
    result = Simulator(config, fit, num_pages, max_model_len, seed=args.seed).run(specs)
    elapsed = time.perf_counter() - start
    slos = parse_slos(args.goodput)
    metrics = result.metrics(slos)
    # a trace's labels (request classes) get a row each
    by_label = {label: result.metrics(slos, label)
                for label in sorted({s.label for s in specs} - {""})}
    print(f"simulated {len(specs)} requests, {result.num_steps} steps, "
          f"{result.duration:.1f} s of engine time in {elapsed:.1f} s")
    rows = {config.policy: metrics} | {f"  {label}": m for label, m in by_label.items()}
    print(format_table(rows, [k for k in SUMMARY if k in metrics]))
    if args.output_json:
        extra = {"sim_seconds": elapsed} | ({"by_label": by_label} if by_label else {})
        args.output_json.write_text(json.dumps(metrics | extra, indent=1))
    if args.plot_dir:
        from jaxserve.sim.plots import plot_timeline

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        load = (f"{Path(args.trace).name}, {len(specs) / max(result.duration, 1e-9):.3g} req/s"
                if args.trace is not None else f"{args.request_rate:g} req/s")
        path = plot_timeline(result, args.plot_dir / "timeline.png", f"{config.policy}, {load}")
        print(f"wrote {path}")
    return 0 if result.kv_pages_free_at_end == result.kv_pages_total else 1


def _validate(args, config: EngineConfig) -> int:
    from jaxserve.tools.calibrate import VALIDATED, validate

    report = validate(args.model, config, lambda max_model_len: workload(args, max_model_len),
                      args.fit, recalibrate=args.calibrate, repeats=args.repeats, freeze=True)
    rows = {"engine": report["real"], "simulator": report["sim"],
            "rel. error": report["errors"]}
    if "noise" in report:
        rows["engine noise"] = report["noise"]  # a single run's distance from the runs' mean
        rows["uncertainty"] = report["uncertainty"]  # twice the runs' mean's standard error
    rows["agreement"] = report["claims"]
    print(format_table(rows, list(VALIDATED)))
    worst = max(report["claims"], key=report["claims"].get)
    print(f"agreement: within {max(report['claims'].values()):.1%} on every metric (the "
          f"larger of each error and the engine's uncertainty; worst {worst})"
          + ("" if "noise" in report else "; one engine run: its noise unknown, --repeats 2 "
             "or more measures it"))
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=1))
    return 0 if max(report["claims"].values()) <= 0.10 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.sim",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as err:  # bad input, a missing file, a path in the way
        print(f"jaxserve simulate: error: {err}", file=sys.stderr)
        return 2
