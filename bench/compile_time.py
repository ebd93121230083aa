"""Compile time of the engine's steps, with the layers stacked under jax.lax.scan and as a list
unrolled (scan_layers=false).

    python bench/compile_time.py                  # llama3-8b's shape, llama-20m at 2 and 32 layers
    python bench/compile_time.py --quick          # the small model only
    python bench/compile_time.py --run-steps 20   # also each small model's decode step time

Each model's steps are lowered from abstract shapes (jax.eval_shape: no weight or page is
allocated, so Llama-3-8B's shape compiles on any machine) and compiled with no persistent
cache, on this platform's backend as the engine would choose it (the CPU backend here: the C++
kernels for float32). Per model and layer form it prints the seconds to lower and compile one
decode step (8 rows) and one prefill step (4 rows of 64 tokens): what warm-up pays per bucket.
With `--run-steps N` it also times the small models' decode step on real (random) weights,
scan against unrolled: the issue's rule is to keep whichever runs faster where they differ.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.backends import select_backend
from jaxserve.config.model import ModelConfig
from jaxserve.model.decode_rows import PAGES
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.llama import stack_layers
from jaxserve.model.loader import abstract_model, random_state
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import make_step_fns, pack_decode_rows

MODELS = Path(__file__).resolve().parent / "models"
PAGE, PAGES_PER_SEQ, ROWS, PREFILL_ROWS, CHUNK, NUM_PAGES = 16, 64, 8, 4, 64, 1024


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def prepared(cfg: ModelConfig, dtype, backend, scan: bool, state=None):
    """(graphdef, state) as the runner holds them: packed for the backend, layers stacked
    (scan) or a list (unrolled); abstract (ShapeDtypeStructs) unless a real state is given."""
    graphdef, abstract = abstract_model(cfg, dtype)
    out = {}

    def prepare(s):
        g, s = backend.ops.pack_weights(graphdef, s)
        if scan:
            g, s = stack_layers(g, s)
        out["graphdef"] = g
        return s

    result = prepare(state) if state is not None else jax.eval_shape(prepare, abstract)
    return out["graphdef"], result


def step_args(cfg: ModelConfig, dtype, backend, state, kv, rows: int, chunk: int):
    md = AttentionMetadata(positions=_spec((rows, chunk), jnp.int32),
                           query_lens=_spec((rows,), jnp.int32),
                           seq_lens=_spec((rows,), jnp.int32),
                           page_table=_spec((rows, PAGES_PER_SEQ), jnp.int32))
    sm = SamplingMetadata(_spec((rows,), jnp.float32), _spec((rows,), jnp.int32),
                          _spec((rows,), jnp.float32), _spec((rows,), jnp.uint32),
                          _spec((rows,), jnp.int32), _spec((rows,), jnp.bool_))
    rope = (_spec((cfg.max_position_embeddings, cfg.rotary_dim), dtype),) * 2
    weights = (jax.tree.leaves(state), rope)
    return weights, md, sm


def compile_seconds(cfg: ModelConfig, dtype, backend, scan: bool) -> dict:
    graphdef, state = prepared(cfg, dtype, backend, scan)
    kv = jax.eval_shape(lambda: backend.attention.zeros(cfg.num_layers, NUM_PAGES, PAGE,
                                                        cfg.num_kv_heads, cfg.head_dim,
                                                        jnp.dtype(dtype).name))
    fns = make_step_fns(graphdef, jax.tree.structure(state), backend, 0, ROWS)
    out = {}
    weights, md, sm = step_args(cfg, dtype, backend, state, kv, ROWS, 1)
    carry = _spec((ROWS,), jnp.int32)
    start = time.perf_counter()
    rows = _spec((ROWS, PAGES + PAGES_PER_SEQ), jnp.int32)  # model/decode_rows.py's columns
    fns.decode.lower(weights, kv, rows, carry, carry, steps=1).compile()
    out["decode_s"] = time.perf_counter() - start
    weights, md, sm = step_args(cfg, dtype, backend, state, kv, PREFILL_ROWS, CHUNK)
    start = time.perf_counter()
    fns.prefill.lower(weights, kv, _spec((PREFILL_ROWS, CHUNK), jnp.int32), md, sm, carry,
                      _spec((PREFILL_ROWS,), jnp.int32)).compile()
    out["prefill_s"] = time.perf_counter() - start
    return out


def decode_ms(cfg: ModelConfig, backend, steps: int) -> dict[bool, float]:
    """Median ms of one decode step of ROWS rows at 256-token contexts on real random
    weights, scanned (True) and unrolled (False), the two called alternately (timings on a
    shared CPU drift: alternating keeps the comparison fair)."""
    table = np.arange(1, ROWS * PAGES_PER_SEQ + 1, dtype=np.int32).reshape(ROWS, -1)
    table %= NUM_PAGES
    lens = np.full((ROWS,), 256, np.int32)
    md = AttentionMetadata(positions=(lens - 1)[:, None], query_lens=np.ones(ROWS, np.int32),
                           seq_lens=lens, page_table=table)
    sm = SamplingMetadata(np.zeros(ROWS, np.float32), np.full(ROWS, cfg.vocab_size, np.int32),
                          np.ones(ROWS, np.float32), np.zeros(ROWS, np.uint32), lens,
                          np.zeros(ROWS, bool))
    zeros = jnp.zeros((ROWS,), jnp.int32)
    rows = pack_decode_rows(np.arange(ROWS, dtype=np.int32), np.full((ROWS,), -1, np.int32),
                            md, sm)
    steps_of = {}
    for scan in (True, False):
        graphdef, state = random_state(cfg, jnp.float32, 0)
        graphdef, state = prepared(cfg, jnp.float32, backend, scan, state)
        kv = backend.attention.zeros(cfg.num_layers, NUM_PAGES, PAGE, cfg.num_kv_heads,
                                     cfg.head_dim, "float32")
        fns = make_step_fns(graphdef, jax.tree.structure(state), backend, 0, ROWS)
        steps_of[scan] = [fns, (jax.tree.leaves(state), None), kv]
    times = {True: [], False: []}
    for i in range(steps + 2):
        for scan, entry in steps_of.items():
            fns, weights, kv = entry
            start = time.perf_counter()
            packed, _, entry[2] = fns.decode(weights, kv, rows, zeros, zeros, steps=1)
            packed.block_until_ready()
            if i >= 2:
                times[scan].append(time.perf_counter() - start)
    return {scan: 1000 * float(np.median(t)) for scan, t in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small model only")
    ap.add_argument("--layers", default="2,32",
                    help="the small model's two depths, shallow then deep (default 2,32)")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--matmul-impl", default="auto")
    ap.add_argument("--run-steps", type=int, default=0,
                    help="also time N decode steps of the small models, scan against unrolled")
    args = ap.parse_args(argv)
    small = ModelConfig.from_hf_dir(MODELS / "llama-20m")
    shallow, deep = (int(n) for n in args.layers.split(","))
    models = {f"llama-20m x{n}": dataclasses.replace(small, num_layers=n)
              for n in (shallow, deep)}
    if not args.quick:
        models = {"llama3-8b": ModelConfig.from_hf_dir(MODELS / "llama3-8b")} | models
    print(f"platform {jax.default_backend()}, no compilation cache; decode {ROWS} rows, "
          f"prefill {PREFILL_ROWS} x {CHUNK} tokens")
    results = {}
    for name, cfg in models.items():
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.dtype(cfg.dtype)
        backend = select_backend(args.attention_impl, args.matmul_impl, jnp.dtype(dtype).name,
                                 cfg.head_dim, PAGE,
                                 num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
        step_ms = decode_ms(cfg, backend, args.run_steps) if (
            args.run_steps and name != "llama3-8b") else {}
        for scan in (True, False):
            form = "scan" if scan else "unrolled"
            row = compile_seconds(cfg, dtype, backend, scan)
            if scan in step_ms:
                row["decode_ms"] = step_ms[scan]
            results[f"{name} {form}"] = row
            run = f", decode step {row['decode_ms']:.2f} ms" if "decode_ms" in row else ""
            print(f"{name:15} {cfg.num_layers:2} layers {form:8} ({backend.name}): compile "
                  f"decode {row['decode_s']:6.1f} s, prefill {row['prefill_s']:6.1f} s{run}",
                  flush=True)
    for form in ("scan", "unrolled"):
        a, b = results[f"llama-20m x{shallow} {form}"], results[f"llama-20m x{deep} {form}"]
        ratio = (b["decode_s"] + b["prefill_s"]) / (a["decode_s"] + a["prefill_s"])
        print(f"{form}: {deep} layers compile {ratio:.2f}x the {shallow}-layer model's (goal "
              f"at 2 and 32: within 2x with layers compiled once)")
        results[f"ratio {form}"] = ratio
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
