"""LoRA adapters in the mix: throughput with 0, 1, 4 and 16 adapters at the same load, one run.

    python bench/lora.py                          # SmolLM2-135M-Instruct (its GGUF, fetched once)
    python bench/lora.py --model bench/models/llama-20m --load-format dummy

`--num-seqs` requests (32) of `--input-len` random prompt tokens and `--output-len` greedy
tokens each (ignore_eos), all submitted at once, on one engine with LoRA enabled (max_loras the
largest K; rank `--rank` adapters of the `--targets` projections: PEFT's default q and v, or
all of q, k, v, o, gate, up, down), the requests spread round-robin over K adapters (K = 0:
every request on the base model); and the same load on an engine without LoRA (its banks
absent: what serving costs without adapters).
The adapters are random, written in PEFT's format (adapter_config.json +
adapter_model.safetensors) to a temporary directory and loaded as any other. Prints output
tokens/s per K and each against the base-only run (goal: 16 adapters within 1.3x of it).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxserve.benchmarks.datasets import random_samples
from jaxserve.benchmarks.offline import run_load, warm_up
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.lora import ATTENTION_MODULES, MODULES, module_shapes
from jaxserve.request import LoRARequest


def write_adapter(path: Path, cfg, rank: int, targets: list[str], seed: int) -> None:
    """A random rank-`rank` adapter of the `targets` projections of every layer, in PEFT's
    format."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (n_in, n_out) in module_shapes(cfg).items():
            if module not in targets:
                continue
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in))
                                               / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((n_out, rank))
                                               ).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none", "task_type": "CAUSAL_LM"}))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj",
                        help="the adapted projections (PEFT's default for Llama: q_proj,v_proj;"
                             " all: every one)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; the best counts")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    targets = list(MODULES) if args.targets == "all" else args.targets.split(",")
    if not set(targets) <= set(MODULES):
        parser.error(f"--targets: among {', '.join(MODULES)} (or all)")
    model = args.model
    if model is None:
        from jaxserve.tools.fetch import fetch_smollm2

        model = str(fetch_smollm2())
    most = max(args.adapters)
    options = dict(max_num_seqs=args.num_seqs, max_num_batched_tokens=512,
                   max_model_len=args.input_len + args.output_len + 16,
                   load_format=args.load_format)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lora_on in (False, True):
            config = EngineConfig(**options, enable_lora=lora_on, max_loras=max(most, 1),
                                  max_lora_rank=args.rank)
            engine = LLMEngine(model, config)
            samples = random_samples(args.num_seqs, args.input_len, args.output_len, 0.0,
                                     engine.model_config.vocab_size)
            loras = []
            if lora_on:
                for i in range(most):
                    write_adapter(Path(tmp) / f"a{i}", engine.model_config, args.rank, targets,
                                  i)
                    loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
                    engine.add_lora(loras[-1])
            for k in args.adapters if lora_on else [0]:
                mix = [loras[i % k] if k else None for i in range(args.num_seqs)]
                warm_up(engine, samples)
                best = None
                for _ in range(args.repeats):
                    engine.reset_prefix_cache()
                    start = time.perf_counter()
                    run = run_load(engine, samples, lora_requests=mix)
                    seconds = time.perf_counter() - start
                    assert not any(run.errors), run.errors
                    best = seconds if best is None else min(best, seconds)
                tokens = args.num_seqs * args.output_len
                rows.append({"lora": lora_on, "max_loras": config.max_loras if lora_on else 0,
                             "adapters": k, "seconds": best,
                             "output_tokens_per_s": tokens / best,
                             "compiles_after_warmup": engine.stats()[
                                 "num_compilations_after_warmup"]})
                print(json.dumps(rows[-1]), flush=True)
            del engine
    base = rows[0]["output_tokens_per_s"]
    print(f"\n{args.num_seqs} sequences of {args.input_len} + {args.output_len} tokens, "
          f"rank {args.rank} adapters of {', '.join(targets)}, {model}")
    print("| engine | adapters in the mix | output tok/s | base-only / this |")
    print("|---|---|---|---|")
    for row in rows:
        name = f"LoRA on (max_loras {row['max_loras']})" if row["lora"] else "LoRA off"
        print(f"| {name} | {row['adapters']} | {row['output_tokens_per_s']:.0f} | "
              f"{base / row['output_tokens_per_s']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
