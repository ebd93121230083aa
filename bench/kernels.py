"""Times paged decode and prefill attention over a batch x context grid.

Variants: the Pallas kernels, JAX's own Pallas GPU paged attention (decode, GPU only) and the
jnp reference. Decode is memory-bound, so each row reports achieved GB/s, (K/V bytes read + q
bytes + out bytes) / time, beside the device's copy bandwidth measured here, plus TFLOP/s and
the largest difference from the reference's output.

    python bench/kernels.py                    # full grid on a GPU, a small one on a CPU
    python bench/kernels.py --interpret        # on a CPU, also the kernels in interpret mode
    python bench/kernels.py --output-json rows.json

A failing variant prints an error row (and its traceback on stderr); the others still run.
Each timed run queues several calls before it blocks, but rows of a few tens of microseconds
still measure host dispatch more than the device.
"""

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pallas_kernels import (
    decode_attention,
    decode_attention_ref,
    prefill_attention,
    prefill_attention_ref,
)


@dataclasses.dataclass(frozen=True)
class Grid:
    decode_batches: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    contexts: tuple[int, ...]
    chunk: int  # prefill queries per sequence, the last `chunk` positions of the context
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    copy_bytes: int  # buffer for the copy-bandwidth measurement
    calls_per_run: int  # calls queued per timed run, so dispatch overhead is amortised


GPU_GRID = Grid(
    (1, 8, 32, 64), (1, 8), (512, 1024, 4096), 512, 32, 8, 128, 16, "bfloat16", 1 << 30, 10
)
CPU_GRID = Grid((1, 4), (1,), (128, 256), 64, 8, 2, 64, 16, "float32", 256 << 20, 1)


@dataclasses.dataclass
class Row:
    op: str
    impl: str
    batch: int
    context: int
    us: float = math.nan
    gb_s: float = math.nan
    pct_copy: float = math.nan
    tflop_s: float = math.nan
    max_err: float = math.nan
    pallas_speedup: float = math.nan  # this row's time / the Pallas row's time
    error: str = ""


def time_us(fn, args, *, warmup: int, iters: int, calls: int) -> float:
    """Median wall time of one call: warm-up, then `iters` runs of `calls` queued calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def copy_bandwidth_gb_s(nbytes: int, calls: int, args) -> float:
    """Read + write GB/s of an in-place elementwise pass over `nbytes` (the memory ceiling).

    The buffer is donated, so no call pays for a fresh output allocation; the extra warm-up
    also brings a GPU's clocks up.
    """
    step = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)
    x = jnp.ones(nbytes // 4, jnp.float32)
    for _ in range(args.warmup + 20):
        x = step(x)
    x.block_until_ready()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        for _ in range(calls):
            x = step(x)
        x.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return 2 * nbytes / statistics.median(times) / 1e9


def paged_pools(rng, batch, context, grid):
    """K/V pools with each sequence on random distinct pages; every sequence `context` long."""
    pages_per_seq = -(-context // grid.page_size)
    num_pages = 1 + batch * pages_per_seq  # page 0: the null page
    shape = (num_pages, grid.page_size, grid.kv_heads, grid.head_dim)
    key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    k = jax.random.normal(key_k, shape, grid.dtype)
    v = jax.random.normal(key_v, shape, grid.dtype)
    table = 1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    return k, v, jnp.asarray(table, jnp.int32), seq_lens


def jax_paged_attention_fn(q, k, v, table, seq_lens, scale):
    """JAX's GPU paged attention on our inputs: its pools are [kv_heads, pages, page_size, D]
    and it does not scale q. Layout changes happen here, outside the timed call."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    pages_per_seq = table.shape[1]
    k_splits = math.gcd(pages_per_seq, 16)  # it needs pages_per_seq % k_splits == 0
    fn = functools.partial(paged_attention, k_splits=k_splits)
    args = (q * scale, k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3), table, seq_lens)
    return fn, args


def decode_variants(grid, batch, context, args, on_gpu):
    rng = np.random.default_rng(batch * 100_003 + context)
    k, v, table, seq_lens = paged_pools(rng, batch, context, grid)
    q = jax.random.normal(jax.random.key(1), (batch, grid.heads, grid.head_dim), grid.dtype)
    scale = grid.head_dim**-0.5
    tuning = {"pages_per_block": args.pages_per_block, "num_splits": args.num_splits}
    inputs = (q, k, v, table, seq_lens)
    variants = {
        "reference": (jax.jit(decode_attention_ref, static_argnums=5), (*inputs, scale)),
    }
    if on_gpu or args.interpret:
        pallas = functools.partial(decode_attention, scale=scale, interpret=not on_gpu, **tuning)
        variants["pallas"] = (pallas, inputs)
    if on_gpu:
        variants["jax-paged"] = lambda: jax_paged_attention_fn(*inputs, scale)
    itemsize = jnp.dtype(grid.dtype).itemsize
    kv_bytes = 2 * table.size * grid.page_size * grid.kv_heads * grid.head_dim * itemsize
    nbytes = kv_bytes + 2 * q.size * itemsize
    flops = 4 * batch * grid.heads * context * grid.head_dim
    return variants, nbytes, flops


def prefill_variants(grid, batch, context, args, on_gpu):
    rng = np.random.default_rng(batch * 100_019 + context)
    k, v, table, seq_lens = paged_pools(rng, batch, context, grid)
    chunk = min(grid.chunk, context)
    q_shape = (batch, chunk, grid.heads, grid.head_dim)
    q = jax.random.normal(jax.random.key(2), q_shape, grid.dtype)
    positions = jnp.broadcast_to(
        jnp.arange(context - chunk, context, dtype=jnp.int32), (batch, chunk)
    )
    scale = grid.head_dim**-0.5
    inputs = (q, k, v, table, positions, seq_lens)
    variants = {
        "reference": (jax.jit(prefill_attention_ref, static_argnums=6), (*inputs, scale)),
    }
    if on_gpu or args.interpret:
        pallas = functools.partial(
            prefill_attention, scale=scale, block_q=args.block_q, interpret=not on_gpu
        )
        variants["pallas"] = (pallas, inputs)
    itemsize = jnp.dtype(grid.dtype).itemsize
    kv_bytes = 2 * table.size * grid.page_size * grid.kv_heads * grid.head_dim * itemsize
    nbytes = kv_bytes + 2 * q.size * itemsize
    keys_seen = chunk * (context - chunk) + chunk * (chunk + 1) // 2  # causal, per sequence
    flops = 4 * batch * grid.heads * keys_seen * grid.head_dim
    return variants, nbytes, flops


def run_cell(op, make_variants, grid, batch, context, args, on_gpu, copy_gb_s):
    """Times every variant of one (op, batch, context); a failing variant gives an error row."""
    rows, outputs = [], {}
    try:
        variants, nbytes, flops = make_variants(grid, batch, context, args, on_gpu)
    except Exception as e:
        return [Row(op, "setup", batch, context, error=_describe(e))]
    for impl, variant in variants.items():
        row = Row(op, impl, batch, context)
        try:
            fn, fn_args = variant() if callable(variant) else variant
            outputs[impl] = fn(*fn_args)
            calls = grid.calls_per_run
            row.us = time_us(fn, fn_args, warmup=args.warmup, iters=args.iters, calls=calls)
            row.gb_s = nbytes / row.us / 1e3
            row.pct_copy = 100 * row.gb_s / copy_gb_s
            row.tflop_s = flops / row.us / 1e6
        except Exception as e:
            row.error = _describe(e)
        rows.append(row)
    reference = outputs.get("reference")
    pallas_us = next((r.us for r in rows if r.impl == "pallas" and not r.error), math.nan)
    for row in rows:
        if row.impl in outputs and reference is not None:
            diff = outputs[row.impl].astype(jnp.float32) - reference.astype(jnp.float32)
            row.max_err = float(jnp.abs(diff).max())
        row.pallas_speedup = row.us / pallas_us
    return rows


def _describe(e: Exception) -> str:
    traceback.print_exc(limit=-8, file=sys.stderr)
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:160]}"


def print_table(rows, copy_gb_s, device):
    print(f"\ndevice: {device}   copy bandwidth (read + write): {copy_gb_s:,.0f} GB/s")
    header = f"{'op':8} {'impl':10} {'batch':>5} {'context':>7} {'us':>10} {'GB/s':>8} "
    header += f"{'%copy':>6} {'TFLOP/s':>8} {'max_err':>9} {'t/pallas':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r.op:8} {r.impl:10} {r.batch:>5} {r.context:>7} "
        if r.error:
            print(line + f"ERROR {r.error}")
            continue
        line += f"{r.us:>10.1f} {r.gb_s:>8.1f} {r.pct_copy:>6.1f} {r.tflop_s:>8.3f} "
        print(line + f"{r.max_err:>9.2e} {r.pallas_speedup:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small grid (default on CPU)")
    parser.add_argument("--interpret", action="store_true", help="on a CPU, time the kernels too")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pages-per-block", type=int, default=8, help="decode kernel tuning")
    parser.add_argument("--num-splits", type=int, default=None, help="decode; default auto")
    parser.add_argument("--block-q", type=int, default=None, help="prefill; default auto")
    parser.add_argument("--ops", default="decode,prefill", help="comma-separated subset")
    parser.add_argument("--output-json", type=Path, help="write the rows here")
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    grid = CPU_GRID if args.quick or not on_gpu else GPU_GRID
    device = str(jax.devices()[0].device_kind)
    copy_gb_s = copy_bandwidth_gb_s(grid.copy_bytes, grid.calls_per_run, args)
    ops = {
        "decode": (decode_variants, grid.decode_batches),
        "prefill": (prefill_variants, grid.prefill_batches),
    }
    rows = []
    for op in args.ops.split(","):
        make_variants, batches = ops[op]
        for batch in batches:
            for context in grid.contexts:
                rows += run_cell(op, make_variants, grid, batch, context, args, on_gpu, copy_gb_s)
                print(f"done {op} batch {batch} context {context}", file=sys.stderr, flush=True)
    print_table(rows, copy_gb_s, device)
    if args.output_json:
        payload = {
            "device": device,
            "copy_gb_s": copy_gb_s,
            "grid": dataclasses.asdict(grid),
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        args.output_json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
