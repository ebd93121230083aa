"""The `jaxserve` command: convert, generate (serve, bench, simulate and plan arrive with them)."""

import argparse
import sys
from pathlib import Path


def _convert(args) -> int:
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.model.loader import load_hf_state, save_orbax

    cfg = ModelConfig.from_hf_dir(args.hf_dir)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[
        cfg.dtype if args.dtype == "auto" else args.dtype
    ]
    _, state = load_hf_state(args.hf_dir, cfg, dtype)
    save_orbax(args.out_dir, cfg, state, extra_files_from=args.hf_dir)
    print(f"wrote {args.out_dir} ({cfg.architecture}, {cfg.num_params / 1e6:.1f}M parameters)")
    return 0


def _generate(args) -> int:
    from jaxserve import LLM, SamplingParams

    llm = LLM(args.model, **dict(kv.split("=", 1) for kv in args.set or []))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    for out in llm.generate(args.prompt, params):
        print(out.prompt + out.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="write an orbax checkpoint from a Hugging Face dir")
    convert.add_argument("hf_dir", type=Path)
    convert.add_argument("out_dir", type=Path)
    convert.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                            "float16"])
    convert.set_defaults(func=_convert)
    generate = sub.add_parser("generate", help="generate text for prompts, offline")
    generate.add_argument("model")
    generate.add_argument("prompt", nargs="+")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--set", action="append", help="engine override KEY=VALUE")
    generate.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
