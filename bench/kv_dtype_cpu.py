"""A bf16 model's decode step on the CPU with the KV pool in bf16 vs float32, at two pool sizes.

    python bench/kv_dtype_cpu.py

XLA on the CPU has no 16-bit float gather or scatter: with a bf16 pool it converts the whole
pool every layer of every step, so the step's time grows with the pool. The engine keeps the
pool in float32 there (`jaxserve.config.kv_cache_dtype`); this prints both. Model: Llama-3-8B's
32 layers and vocabulary with a tiny hidden size, dummy bf16 weights.
"""

import json
import tempfile
from pathlib import Path

import jaxserve.runner
from jaxserve.calibrate import profile_output, time_iteration
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=1024)


def decode_ms(model: Path, num_pages: int) -> float:
    engine = LLMEngine(model, EngineConfig(load_format="dummy", max_num_seqs=4,
                                           max_num_batched_tokens=256, prefill_chunk_sizes=(256,),
                                           num_pages=num_pages), progress=False)
    return 1e3 * time_iteration(engine, profile_output(engine, (2, 200, 1, 0, 0)), budget_s=0.5)


def main() -> None:
    config = json.loads((Path(__file__).parent / "models/llama3-8b/config.json").read_text())
    config.update(SHAPE, dtype="bfloat16")
    config.pop("torch_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        rule = jaxserve.runner.kv_cache_dtype
        print(f"{'KV pool':<10}{'pages':>8}{'2-row decode ms':>18}")
        for pool in ("bfloat16", "float32"):
            jaxserve.runner.kv_cache_dtype = (lambda dtype, *_: dtype) if pool == "bfloat16" \
                else rule
            for pages in (512, 4096):
                print(f"{pool:<10}{pages:>8}{decode_ms(Path(tmp), pages):>18.1f}", flush=True)
        jaxserve.runner.kv_cache_dtype = rule


if __name__ == "__main__":
    main()
