"""The `jaxserve` command: serve, generate, bench (throughput | serve | sweep), plan, convert.

Engine options are flags generated from `EngineConfig`'s fields (`max_num_seqs` is
`--max-num-seqs`), and `serve`'s server options from `ServerConfig`'s; a `--config` YAML file
sets the same keys, and a flag wins over the file.

Logging: jaxserve's own loggers at `--log-level` (default `$JAXSERVE_LOG_LEVEL`, else info), every
other library's (absl and orbax, jax, uvicorn) at WARNING; at debug those say INFO too.
"""

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from jaxserve.config.engine import EngineConfig, read_config_file

LOG_LEVELS = ("debug", "info", "warning", "error")


def _configure_logging(level: str) -> None:
    """jaxserve's loggers at `level`, the rest at WARNING (INFO when `level` is debug): a start
    says what jaxserve loaded and compiled, not what orbax did to read it."""
    if level not in LOG_LEVELS:  # JAXSERVE_LOG_LEVEL (argparse checks only the flag)
        raise ValueError(f"JAXSERVE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, "
                         f"got {level!r}")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.INFO if level == "debug" else logging.WARNING)
    logging.getLogger("jaxserve").setLevel(level.upper())


def _convert(args) -> int:
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.config.model import ModelConfig
    from jaxserve.model.loader import load_hf_state, save_orbax

    if Path(args.out_dir).resolve() == Path(args.hf_dir).resolve():
        raise ValueError(f"OUT_DIR {args.out_dir} is HF_DIR itself: give another directory "
                         "(writing there would overwrite the model's config.json)")
    cfg = ModelConfig.from_hf_dir(args.hf_dir)
    name = cfg.dtype if args.dtype == "auto" else args.dtype
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
    _, state = load_hf_state(args.hf_dir, cfg, dtype)
    # the saved config.json names the dtype the weights were written in
    save_orbax(args.out_dir, dataclasses.replace(cfg, dtype=name), state,
               extra_files_from=args.hf_dir)
    print(f"wrote {args.out_dir} ({cfg.architecture}, {cfg.num_params / 1e6:.1f}M parameters)")
    return 0


def _generate(args) -> int:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.request import RequestOutputKind, SamplingParams, StructuredOutputsParams

    prompts = (args.prompt or []) + args.prompts
    if not prompts:
        named = "" if args.model is None else f" ({args.model!r}, the first argument, is the model)"
        raise ValueError(f"no prompt: pass --prompt TEXT{named}")
    structured = None
    if args.json_schema is not None:
        structured = StructuredOutputsParams(json=args.json_schema)
    elif args.regex is not None:
        structured = StructuredOutputsParams(regex=args.regex)
    elif args.choice:
        structured = StructuredOutputsParams(choice=args.choice)
    params = SamplingParams(  # checked before the model loads
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, stop=tuple(args.stop or ()),
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
        bad_words=tuple(args.bad_word or ()), structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA)
    engine_options, _ = _options(args)
    engine = LLMEngine(args.model, EngineConfig.from_overrides(**engine_options),
                       progress=sys.stderr.isatty())
    for prompt in prompts:
        engine.add_request(None, prompt, params)
        sys.stdout.write(prompt)
        while engine.has_unfinished_requests():
            for out in engine.step():  # each output carries the text this step added
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _serve(args) -> int:
    from jaxserve.engine.llm_engine import LLMEngine, freeze_gc
    from jaxserve.engine.model_files import DEMO, resolve_model
    from jaxserve.parallel import distributed
    from jaxserve.server import ServerConfig, bind, serve

    engine_options, server_options = _options(args)
    server_config = ServerConfig(**server_options)
    engine_config = EngineConfig.from_overrides(**engine_options)
    model = args.model or DEMO
    group = _join_processes(args, engine_config.data_parallel_size)
    if group is not None and not group.processes.is_leader:
        from jaxserve.engine.follower import run_follower

        return run_follower(model, engine_config, group)
    sock = bind(server_config)  # a port in use fails now, not after the compile
    try:
        if group is not None:
            group.agree(distributed.setup_of(resolve_model(model), engine_config))
        print(f"jaxserve: loading {model} (weights, then a compile for every step shape)",
              flush=True)
        engine = LLMEngine(model, engine_config, progress=True)
    except BaseException as error:
        sock.close()
        if group is not None:
            group.fail(error)
        raise
    freeze_gc()  # this process serves one engine until it exits
    code = serve(engine, server_config, model_name=str(model), sock=sock)
    if group is not None:  # the followers stop with it
        group.end(engine.runners, code)
    return code


def _join_processes(args, replicas: int = 1):
    """jax.distributed across processes when --num-processes (or its env var) is above 1;
    the heartbeats start at once, so a process lost while the others compile stops them."""
    from jaxserve.parallel import distributed

    if args.num_processes in (None, 1):
        return None
    if args.coordinator_address is None or args.process_id is None:
        raise ValueError("--num-processes above 1 needs --coordinator-address HOST:PORT and "
                         "--process-id (or JAXSERVE_COORDINATOR_ADDRESS, JAXSERVE_PROCESS_ID)")
    group = distributed.initialize(distributed.Processes(
        args.coordinator_address, args.num_processes, args.process_id), replicas=replicas)
    group.watch()
    return group


def _bench(args) -> int:
    from jaxserve.benchmarks import serve, sweep, throughput
    from jaxserve.benchmarks.datasets import check_args

    module = {"throughput": throughput, "serve": serve, "sweep": sweep}[args.bench]
    if args.seed is None:  # the config file's seed, when it has one (the flag would hide it)
        args.seed = _config_file(args).get("seed", 0)
    getattr(module, "check_args", check_args)(args)  # before a model loads or a request goes
    engine_options, _ = _options(args)
    module.run(args, engine_options)
    return 0


def _plan(args) -> int:
    import json

    from jaxserve.tools.plan import format_plan, plan

    engine_options, _ = _options(args)
    config = EngineConfig.from_overrides(**engine_options)
    if args.target is None:
        if args.compile:
            raise ValueError("--compile compiles for a --target (e.g. h100, v5e-8)")
        result = plan(args.model, config, args.context)
        print(json.dumps(result, indent=2) if args.json else format_plan(result))
        return 0
    from jaxserve.tools.compile_plan import format_target_plan, target_plan

    result = target_plan(args.model, config, args.target, compile=args.compile)
    print(json.dumps(result, indent=2) if args.json
          else format_plan(result) + "\n" + format_target_plan(result))
    return 0 if not args.compile or (result["fits"] and not result["failed"]) else 1


def _add_bench_parser(sub, logs: argparse.ArgumentParser) -> None:
    from jaxserve.benchmarks import serve, sweep, throughput

    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, sweep")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, module, help_text in (
            ("throughput", throughput, "offline throughput, as vllm bench throughput"),
            ("serve", serve, "load an OpenAI-compatible server, as vllm bench serve"),
            ("sweep", sweep, "concurrency / window / batching-mode sweeps, plots, a config")):
        parser = kinds.add_parser(name, help=help_text,
                                  description=module.__doc__.split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  parents=[logs] if name != "serve" else [])
        module.add_arguments(parser)
        if name != "serve":  # a server's engine is its own
            parser.add_argument("--config", type=Path, help="YAML file of engine options")
            # (sweep's own --tokenizer, for a server's vocabulary, is the engine's too)
            _add_option_flags(parser, EngineConfig, "engine options",
                              skip=("seed", "tokenizer") if name == "sweep" else ("seed",))
        parser.set_defaults(func=_bench)


def _config_file(args) -> dict[str, Any]:
    """The --config file's keys ({} without one)."""
    return {} if getattr(args, "config", None) is None else read_config_file(args.config)


def _options(args) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine options, server options): the --config file's keys, then the flags given."""
    from jaxserve.server import ServerConfig

    options = _config_file(args)
    server = {f.name for f in dataclasses.fields(ServerConfig)}
    names = server | {f.name for f in dataclasses.fields(EngineConfig)}
    options |= {name: getattr(args, name) for name in names if hasattr(args, name)}
    return ({k: v for k, v in options.items() if k not in server},
            {k: v for k, v in options.items() if k in server})


_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",)}  # vLLM's


def _add_option_flags(parser: argparse.ArgumentParser, cls: type, title: str,
                      skip: tuple[str, ...] = ()) -> None:
    """A --flag per dataclass field, typed from its annotation; unset flags leave no attribute.
    `skip`: fields the command already has a flag for (it then sets the option too)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        parts = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        base = next(p for p in parts if p is not type(None))
        nullable = type(None) in parts
        spec: dict[str, Any]
        if base is bool:
            spec = {"action": argparse.BooleanOptionalAction}
        elif typing.get_origin(base) is tuple:
            spec = {"type": typing.get_args(base)[0], "nargs": "+"}
        elif dataclasses.is_dataclass(base):  # its JSON text, which the config reads
            spec = {"type": _nullable(str), "metavar": "JSON"}
        else:
            spec = {"type": _nullable(base) if nullable else base}
        flags = ["--" + f.name.replace("_", "-"), *_SHORT_FLAGS.get(f.name, ())]
        group.add_argument(*flags, dest=f.name, default=argparse.SUPPRESS,
                           help=f"default: {f.default}", **spec)


def _nullable(base: type):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else base(text)

    parse.__name__ = base.__name__
    return parse


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"jaxserve: error: ${name} must be an integer, got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    from jaxserve.server import ServerConfig

    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    logs = argparse.ArgumentParser(add_help=False)  # the flag of every command that loads a model
    logs.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                      default=os.environ.get("JAXSERVE_LOG_LEVEL", "info").lower(),
                      help="jaxserve's logging (debug: other libraries' INFO too); default: "
                           "$JAXSERVE_LOG_LEVEL, else info")

    serve = sub.add_parser("serve", help="serve a model over the OpenAI API (HTTP)",
                           parents=[logs])
    serve.add_argument("model", nargs="?", help="a local model directory, or demo (default)")
    serve.add_argument("--config", type=Path, help="YAML file of engine and server options")
    processes = serve.add_argument_group(
        "several processes (jax.distributed): process 0 serves, the others follow; with -dp "
        "D, each replica on num_processes / D of them")
    processes.add_argument("--coordinator-address", default=os.environ.get(
        "JAXSERVE_COORDINATOR_ADDRESS"), help="HOST:PORT of process 0's coordination service "
        "(default $JAXSERVE_COORDINATOR_ADDRESS)")
    processes.add_argument("--num-processes", type=int, default=_env_int(
        "JAXSERVE_NUM_PROCESSES"), help="processes serving the model (default "
        "$JAXSERVE_NUM_PROCESSES, else 1)")
    processes.add_argument("--process-id", type=int, default=_env_int("JAXSERVE_PROCESS_ID"),
                           help="this process's rank, 0 the server (default "
                                "$JAXSERVE_PROCESS_ID)")
    _add_option_flags(serve, ServerConfig, "server options")
    _add_option_flags(serve, EngineConfig, "engine options")
    serve.set_defaults(func=_serve)

    generate = sub.add_parser("generate", help="stream a completion to stdout, offline",
                              parents=[logs])
    generate.add_argument("model", nargs="?", help="a local model directory, or demo (default)")
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="same as --prompt")
    generate.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--presence-penalty", type=float, default=0.0)
    generate.add_argument("--frequency-penalty", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0)
    generate.add_argument("--min-tokens", type=int, default=0)
    generate.add_argument("--bad-word", action="append", help="never generated (repeatable)")
    shape = generate.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", help="the output follows this JSON schema (its text)")
    shape.add_argument("--regex", help="the output fully matches this regex")
    shape.add_argument("--choice", action="append", help="the output is one of these "
                       "(repeatable)")
    generate.add_argument("--config", type=Path, help="YAML file of engine options")
    _add_option_flags(generate, EngineConfig, "engine options")
    generate.set_defaults(func=_generate)

    convert = sub.add_parser("convert", help="write an orbax checkpoint from a Hugging Face dir",
                             parents=[logs])
    convert.add_argument("hf_dir", type=Path)
    convert.add_argument("out_dir", type=Path)
    convert.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                            "float16"])
    convert.set_defaults(func=_convert)

    _add_bench_parser(sub, logs)

    plan = sub.add_parser("plan", help="memory arithmetic: weights, KV cache, pages, sequences")
    plan.add_argument("model", nargs="?", help="a local model directory, or demo (default)")
    plan.add_argument("--context", type=int, nargs="+", help="contexts to size sequences for "
                      "(default: up to max_model_len)")
    plan.add_argument("--json", action="store_true", help="print the numbers as JSON")
    plan.add_argument("--target", help="an accelerator to plan for without it: h100, h200, "
                      "a100, v5e-N, v6e-N, v5p-N (N chips)")
    plan.add_argument("--compile", action="store_true", help="compile every step for --target "
                      "(needs the aot-gpu or aot-tpu extra) and report what XLA says")
    plan.add_argument("--config", type=Path, help="YAML file of engine options")
    _add_option_flags(plan, EngineConfig, "engine options")
    plan.set_defaults(func=_plan)

    from jaxserve.tools.simulate import add_simulate_parser

    add_simulate_parser(sub)

    args = parser.parse_args(argv)
    try:
        if "log_level" in args:
            _configure_logging(args.log_level)
        return args.func(args)
    except (ValueError, OSError) as err:  # bad input, a missing file, a path in the way
        print(f"jaxserve: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a server that `bench` cannot reach (httpx's errors)
        if type(err).__module__.split(".")[0] != "httpx":
            raise
        where = getattr(args, "base_url", None) or "the server"
        print(f"jaxserve: error: cannot reach {where}: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before serving started (serve itself stops gracefully)
        return 130


if __name__ == "__main__":
    sys.exit(main())
