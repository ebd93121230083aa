"""A bf16 model's decode step on the CPU with the KV pool in bf16 vs float32, at two pool sizes.

    python bench/kv_dtype_cpu.py

XLA on the CPU has no 16-bit float gather or scatter: with a bfloat16 pool array it converts
the whole pool every layer of every step, so the step's time grows with the pool (the first
row: what the engine once did, under the reference attention). The engine keeps the pool in
float32 there (`jaxserve.config.kv_cache_dtype`, "auto"), or, with kv_cache_dtype="bfloat16",
holds bfloat16 as uint16 bits that the cpu attention's kernels read; this prints all three.
Model: Llama-3-8B's 32 layers and vocabulary with a tiny hidden size, dummy bf16 weights.
"""

import json
import tempfile
from pathlib import Path

import jax.numpy as jnp

import jaxserve.runner
from jaxserve.calibrate import profile_output, time_iteration
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=1024)


def decode_ms(model: Path, num_pages: int, **options) -> float:
    engine = LLMEngine(model, EngineConfig(load_format="dummy", max_num_seqs=4,
                                           max_num_batched_tokens=256, prefill_chunk_sizes=(256,),
                                           num_pages=num_pages, **options), progress=False)
    return 1e3 * time_iteration(engine, profile_output(engine, (2, 200, 1, 0, 0)), budget_s=0.5)


def main() -> None:
    config = json.loads((Path(__file__).parent / "models/llama3-8b/config.json").read_text())
    config.update(SHAPE, dtype="bfloat16")
    config.pop("torch_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        rule, bits = jaxserve.runner.kv_cache_dtype, jaxserve.runner.BF16_BITS
        print(f"{'KV pool':<40}{'pages':>8}{'2-row decode ms':>18}")
        pools = {"bfloat16 array (reference attention)": {"attention_impl": "reference"},
                 "float32 (auto)": {},
                 "bfloat16 as uint16 bits (kv_cache_dtype)": {"kv_cache_dtype": "bfloat16"}}
        for pool, options in pools.items():
            xla_bf16 = pool.startswith("bfloat16 array")  # the rule as it once was
            jaxserve.runner.kv_cache_dtype = (lambda dtype, *_: dtype) if xla_bf16 else rule
            jaxserve.runner.BF16_BITS = jnp.bfloat16 if xla_bf16 else bits
            for pages in (512, 4096):
                ms = decode_ms(Path(tmp), pages, **options)
                print(f"{pool:<40}{pages:>8}{ms:>18.1f}", flush=True)
        jaxserve.runner.kv_cache_dtype, jaxserve.runner.BF16_BITS = rule, bits


if __name__ == "__main__":
    main()
