"""The KV pool's dtype on the CPU: a bf16 model's decode step, and the decode attention alone.

    python bench/kv_dtype_cpu.py                  # both parts
    python bench/kv_dtype_cpu.py --parts kernel   # the decode attention alone

engine: the step with the pool in each dtype, at two pool sizes. XLA on the CPU has no 16-bit
float gather or scatter: with a bfloat16 pool array it converted the whole pool every layer of
every step, so the step's time grew with the pool (the first row: what the engine once did,
under the reference attention). The engine keeps the pool in float32 there
(`jaxserve.config.engine.kv_cache_dtype`, "auto"), or, with kv_cache_dtype="bfloat16" or "fp8", holds
bfloat16 as uint16 bits or float8_e4m3fn as uint8 bits that the cpu attention's kernels read.
Model: Llama-3-8B's 32 layers and vocabulary with a tiny hidden size, dummy bf16 weights.

kernel: the cpu attention's decode kernel on each pool, on Llama-3-8B's attention (32 query
heads, 8 KV heads of 128, pages of 16) over `LAYERS` layers' pools, which together far exceed
the L3 cache: a step's ms, the K and V bytes it reads (each once) and their rate, beside one
thread's streaming read of memory. Decode reads little else, so a narrower pool is faster as
far as the widening keeps pace with memory.
"""

import argparse
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from cpu_kernel_speed import best_time, streaming_read_gbs

import jaxserve.runner.model_runner
from cpu_kernels.attention import bf16_bits, decode_attention_cpu, fp8_bits
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.tools.calibrate import profile_output, time_iteration

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=1024)
# the engine's pools: name -> EngineConfig options
ENGINE_POOLS = {
    "bfloat16 array (reference attention)": {"attention_impl": "reference"},
    "float32 (auto)": {},
    "bfloat16 as uint16 bits (kv_cache_dtype)": {"kv_cache_dtype": "bfloat16"},
    "float8_e4m3fn as uint8 bits (kv_cache_dtype)": {"kv_cache_dtype": "fp8"},
}
# the kernel's pools: name -> how a float32 pool is stored
KERNEL_POOLS = {"float32": lambda x: x, "bfloat16 (uint16 bits)": bf16_bits,
                "float8_e4m3fn (uint8 bits)": fp8_bits}
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16  # Llama-3-8B's attention
LAYERS = 4
CASES = ((2, 4096), (32, 512))  # (slots, tokens each)


def decode_ms(model: Path, num_pages: int, **options) -> float:
    engine = LLMEngine(model, EngineConfig(load_format="dummy", max_num_seqs=4,
                                           max_num_batched_tokens=256, prefill_chunk_sizes=(256,),
                                           num_pages=num_pages, **options), progress=False)
    return 1e3 * time_iteration(engine, profile_output(engine, (2, 200, 1, 0, 0)), budget_s=0.5)


def engine_rows(pools: dict[str, dict]) -> None:
    config = json.loads((Path(__file__).parent / "models/llama3-8b/config.json").read_text())
    config.update(SHAPE, dtype="bfloat16")
    config.pop("torch_dtype", None)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        rule = jaxserve.runner.model_runner.kv_cache_dtype
        print(f"{'KV pool':<46}{'pages':>8}{'2-row decode ms':>18}")
        for pool, options in pools.items():
            # the rule as it once was: the model's dtype, a bfloat16 array
            xla_bf16 = pool.startswith("bfloat16 array")
            jaxserve.runner.model_runner.kv_cache_dtype = (lambda dtype, *_: dtype) if xla_bf16 else rule
            for pages in (512, 4096):
                ms = decode_ms(Path(tmp), pages, **options)
                print(f"{pool:<46}{pages:>8}{ms:>18.1f}", flush=True)
        jaxserve.runner.model_runner.kv_cache_dtype = rule


def kernel_rows(slots: int, context: int, runs: int, rng) -> list[dict]:
    """The decode kernel over LAYERS layers' pools of each kind, best of alternating runs."""
    per_slot = -(-context // PAGE)
    pages = 2 * slots * per_slot + 1  # a pool twice what the slots use
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    ks = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(LAYERS)]
    vs = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(LAYERS)]
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:slots * per_slot]
                        .reshape(slots, per_slot), jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, HEADS, HEAD_DIM), np.float32))
    lens = jnp.full((slots,), context, jnp.int32)
    step = jax.jit(lambda q, ks, vs, t, n: sum(
        decode_attention_cpu(q, k, v, t, n, 0.125).sum() for k, v in zip(ks, vs, strict=True)))
    pools = {name: ([store(k) for k in ks], [store(v) for v in vs])
             for name, store in KERNEL_POOLS.items()}
    best = dict.fromkeys(pools, float("inf"))
    for _ in range(runs):
        for name, (k, v) in pools.items():
            best[name] = min(best[name], best_time(step, q, k, v, table, lens, runs=2))
    rows = []
    for name, seconds in best.items():
        kv_bytes = 2 * LAYERS * slots * context * KV_HEADS * HEAD_DIM * pools[name][0][0].itemsize
        rows.append({"pool": name, "slots": slots, "context": context, "ms": 1e3 * seconds,
                     "mib": kv_bytes / 2**20, "gb_per_s": kv_bytes / seconds / 1e9})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["engine", "kernel"],
                        choices=["engine", "kernel"])
    parser.add_argument("--runs", type=int, default=5, help="kernel: alternating runs")
    args = parser.parse_args(argv)
    if "engine" in args.parts:
        engine_rows(ENGINE_POOLS)
    if "kernel" in args.parts:
        rng = np.random.default_rng(0)
        print(f"\ndecode attention, {LAYERS} layers of {HEADS} heads / {KV_HEADS} KV heads of "
              f"{HEAD_DIM}; one thread's streaming read: "
              f"{streaming_read_gbs(1 << 30):.1f} GB/s")
        print(f"{'KV pool':<30}{'slots x tokens':>16}{'ms':>9}{'K+V MiB':>10}{'GB/s':>8}")
        for slots, context in CASES:
            for r in kernel_rows(slots, context, args.runs, rng):
                print(f"{r['pool']:<30}{f'{slots} x {context}':>16}{r['ms']:>9.2f}"
                      f"{r['mib']:>10.0f}{r['gb_per_s']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
