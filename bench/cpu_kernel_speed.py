"""The CPU kernels against what XLA does in their place, on this machine, in one process.

    python bench/cpu_kernel_speed.py            # the peer model's shapes (bench/peer_hf.py)
    python bench/cpu_kernel_speed.py --quick    # tiny shapes, seconds (the tests run this)
    python bench/cpu_kernel_speed.py --parts decode --baseline HEAD~1   # a change against before
    python bench/cpu_kernel_speed.py --parts prefill --baseline HEAD~1
    python bench/cpu_kernel_speed.py --parts matmul --baseline HEAD~1
    python bench/cpu_kernel_speed.py --parts quant   # int8 / fp8 weights against float32

    matmul   the peer model's 57 linear layers in a chain (8 layers + LM head), x of M rows
             (each layer reading x, which lets XLA run some side by side; with --dependent each
             reading the one before, as the engine's steps do):
             XLA's dot against cpu_kernels/cpu_matmul.cc, ms and GFLOP/s per M (with
             --baseline REV, the packed kernel as at REV too, alternating; on a CPU with
             AMX-BF16, the amx kernel too: matmul_impl="amx", and with --baseline, it as at REV)
    prefill  one layer's paged attention for prompt chunks: the plain-XLA block walk
             (attention_impl="reference") against cpu_prefill.cc (and, with --baseline REV, the
             kernel as at REV, alternating)
    quant    one weight of 4096 x 14336 (a Llama-3-8B MLP projection) as float32 panels and as
             int8 and float8_e4m3fn panels with a scale per column (matmul_cpu_quant_panels),
             x of 1, 8 and 32 rows: ms, GB/s of weight bytes read and the speed-up over
             float32. The int8 weight's 56 MiB is past most CPUs' last-level cache, so each
             call reads it from memory, as a decode step does
    decode   64 slots x 200 tokens over 8 layers: cpu_decode.cc's GB/s of K and V read (on
             float32 pages and on bfloat16 ones: kv_cache_dtype="bfloat16"), beside the
             machine's streaming read of a buffer larger than its caches; with
             --baseline REV, also the kernels as they were at git revision REV, alternating
             with today's in the same process (where a change's few percent show; from one
             process to the next the figure can move more than that)

Each figure is the best of several runs after a warm-up; alternate kinds within a run, so a
busy neighbour slows both sides of a comparison alike.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_kernels import library as cpu_library
from cpu_kernels.attention import bf16_bits, decode_attention_cpu, prefill_attention_cpu
from cpu_kernels.matmul import (
    AMX_BLOCK,
    PANEL,
    matmul_cpu,
    matmul_cpu_amx,
    matmul_cpu_panels,
    matmul_cpu_quant_panels,
    pack_amx,
    pack_panels,
)
from pallas_kernels.blocked import prefill_attention_blocked

ROOT = Path(__file__).resolve().parents[1]


def best_time(fn, *args, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def linear_shapes(hidden: int, kv: int, inter: int, layers: int, vocab: int):
    per_layer = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
                 (hidden, inter), (hidden, inter), (inter, hidden)]
    return per_layer * layers + [(hidden, vocab)]


def matmul_rows(shapes, ms, runs: int, rng, baseline: str | None = None,
                dependent: bool = False) -> list[dict]:
    ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.05) for s in shapes]

    def chain(mm):
        @jax.jit
        def run(x, ws):  # every layer reads x (or x twice over for an input as wide as 2x)
            total = jnp.float32(0)
            for (k, _), w in zip(shapes, ws, strict=True):  # w as `mm` takes it
                xin = jnp.tile(x, (1, k // x.shape[1]))
                total = total + mm(xin, w)[:, :1].sum()
            return total

        @jax.jit
        def run_dependent(x, ws):  # every layer reads the one before, normalised, as in a step
            y = x
            for (k, _), w in zip(shapes, ws, strict=True):
                xin = jnp.tile(y, (1, -(-k // y.shape[1])))[:, :k]
                y = mm(xin * jax.lax.rsqrt(jnp.mean(xin * xin, -1, keepdims=True) + 1e-5), w)
            return y[:, :1].sum()
        return run_dependent if dependent else run

    panels = [pack_panels(w) for w in ws]  # as the engine stores them
    kinds = {"xla": chain(lambda a, b: a @ b), "cpu": chain(matmul_cpu),
             "panels": chain(lambda a, p: matmul_cpu_panels(a, p, p.shape[0] * PANEL))}
    operands = {"xla": ws, "cpu": ws, "panels": panels}
    if cpu_library.amx_ready():  # a CPU with AMX-BF16: the bf16x3 kernel too
        kinds["amx"] = chain(lambda a, p: matmul_cpu_amx(a, p, p.shape[1] * AMX_BLOCK))
        operands["amx"] = [pack_amx(w) for w in ws]
        if baseline is not None:
            kinds["amx_baseline"] = chain(lambda a, p: matmul_cpu_amx(
                a, p, p.shape[1] * AMX_BLOCK, baseline))
            operands["amx_baseline"] = [jnp.array(p, copy=True) for p in operands["amx"]]
    if baseline is not None:
        kinds["baseline"] = chain(lambda a, p: matmul_cpu_panels(a, p, p.shape[0] * PANEL,
                                                                 baseline))
        # a copy: a kind run just after another on the same arrays finds them in cache
        operands["baseline"] = [jnp.array(p, copy=True) for p in panels]
    rows = []
    for m in ms:
        x = jnp.asarray(rng.standard_normal((m, shapes[0][0]), np.float32))
        flops = sum(2 * m * k * n for k, n in shapes)
        best = {k: float("inf") for k in kinds}
        for _ in range(runs):
            for kind, fn in kinds.items():
                best[kind] = min(best[kind], best_time(fn, x, operands[kind], runs=2))
        rows.append({"m": m, **{f"{k}_ms": 1e3 * t for k, t in best.items()},
                     **{f"{k}_gflops": flops / t / 1e9 for k, t in best.items()}})
    return rows


def quant_rows(k: int, n: int, ms, runs: int, rng) -> list[dict]:
    """One weight [K, N] as float32 panels and as int8 and fp8 ones (scaled per column to each
    type's range), alternating; per M: ms, GB/s of weight bytes, speed-up over float32."""
    w = rng.standard_normal((k, n), np.float32) * 0.05
    amax = np.abs(w).max(axis=0)
    int8 = (np.round(w / (amax / 127)).astype(np.int8), amax / 127)
    fp8 = (jnp.asarray(w / (amax / 448)).astype(jnp.float8_e4m3fn), amax / 448)
    operands = {"float32": (pack_panels(jnp.asarray(w)),)}
    for kind, (q, scale) in {"int8": int8, "fp8": fp8}.items():
        operands[kind] = (pack_panels(jnp.asarray(q)), jnp.asarray(scale, jnp.float32))
    del w, int8, fp8
    kinds = {"float32": jax.jit(lambda x, p: matmul_cpu_panels(x, p, n))}
    for kind in ("int8", "fp8"):
        kinds[kind] = jax.jit(lambda x, p, s: matmul_cpu_quant_panels(x, p, s, n))
    rows = []
    for m in ms:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(runs):  # alternating
            for kind, fn in kinds.items():
                best[kind] = min(best[kind], best_time(fn, x, *operands[kind], runs=2))
        row = {"m": m}
        for kind, seconds in best.items():
            row |= {f"{kind}_ms": 1e3 * seconds,
                    f"{kind}_gb_per_s": operands[kind][0].nbytes / seconds / 1e9,
                    f"{kind}_speedup": best["float32"] / seconds}
        rows.append(row)
    return rows


def prefill_rows(cases, heads, kv_heads, head_dim, runs: int, rng,
                 baseline: str | None = None) -> list[dict]:
    pages, page = 2049, 16
    k = jnp.asarray(rng.standard_normal((pages, page, kv_heads, head_dim), np.float32))
    v = jnp.asarray(rng.standard_normal((pages, page, kv_heads, head_dim), np.float32))
    kinds = {
        "xla": jax.jit(lambda q, k, v, t, p, s: prefill_attention_blocked(q, k, v, t, p, s,
                                                                          scale=0.125)),
        "cpu": jax.jit(lambda q, k, v, t, p, s: prefill_attention_cpu(q, k, v, t, p, s, 0.125)),
    }
    if baseline is not None:
        kinds["baseline"] = jax.jit(lambda q, k, v, t, p, s: prefill_attention_cpu(
            q, k, v, t, p, s, 0.125, baseline))
    rows = []
    for rows_, chunk, start in cases:
        per_row = -(-(start + chunk) // page)
        table = jnp.asarray(rng.permutation(np.arange(1, pages))[:rows_ * per_row]
                            .reshape(rows_, per_row), jnp.int32)
        positions = jnp.asarray(np.tile(start + np.arange(chunk), (rows_, 1)), jnp.int32)
        seq_lens = jnp.full((rows_,), start + chunk, jnp.int32)
        q = jnp.asarray(rng.standard_normal((rows_, chunk, heads, head_dim), np.float32))
        args = (q, k, v, table, positions, seq_lens)
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(2):  # alternating
            for kind, fn in kinds.items():
                best[kind] = min(best[kind], best_time(fn, *args, runs=runs))
        rows.append({"rows": rows_, "chunk": chunk, "start": start,
                     **{f"{kind}_ms": 1e3 * t for kind, t in best.items()}})
    return rows


def decode_row(slots, context, layers, heads, kv_heads, head_dim, runs: int, rng,
               baseline: str | None = None) -> dict:
    page = 16
    pages = slots * -(-context // page) * 2 + 1  # a pool twice what the slots use
    ks = [jnp.asarray(rng.standard_normal((pages, page, kv_heads, head_dim), np.float32))
          for _ in range(layers)]
    vs = [jnp.asarray(rng.standard_normal((pages, page, kv_heads, head_dim), np.float32))
          for _ in range(layers)]
    per_slot = -(-context // page)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:slots * per_slot]
                        .reshape(slots, per_slot), jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, heads, head_dim), np.float32))
    lens = jnp.full((slots,), context, jnp.int32)

    def chain(library):
        return jax.jit(lambda q, ks, vs, t, n: sum(
            decode_attention_cpu(q, k, v, t, n, 0.125, library).sum()
            for k, v in zip(ks, vs, strict=True)))

    # kind -> (the chain, its pools): today's kernel, the same on the pools rounded to bfloat16
    # (kv_cache_dtype="bfloat16", half the bytes), and the baseline's kernel
    pools16 = ([bf16_bits(k) for k in ks], [bf16_bits(v) for v in vs])
    kinds = {"": (chain(""), ks, vs), "bf16": (chain(""), *pools16)}
    if baseline is not None:
        kinds["baseline"] = (chain(baseline), ks, vs)
    best = {kind: float("inf") for kind in kinds}
    for _ in range(runs):  # alternating
        for kind, (fn, k, v) in kinds.items():
            best[kind] = min(best[kind], best_time(fn, q, k, v, table, lens, runs=2))
    out = {"slots": slots, "context": context, "layers": layers}
    for kind, seconds in best.items():
        prefix = f"{kind}_" if kind else ""
        kv_bytes = 2 * layers * slots * context * kv_heads * head_dim * (2 if kind == "bf16" else 4)
        out |= {f"{prefix}ms": 1e3 * seconds, f"{prefix}gb_per_s": kv_bytes / seconds / 1e9}
    return out


def register_baseline(revision: str) -> str:
    """Builds the CPU kernels from their sources at git revision `revision` and registers them
    under a suffix of their own, which it returns."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in cpu_library.SOURCE_FILES:
            # the kernels lived in pallas_kernels/ before cpu_kernels/ had them
            for folder in ("cpu_kernels", "pallas_kernels"):
                text = subprocess.run(["git", "show", f"{revision}:{folder}/{name}"],
                                      cwd=ROOT, capture_output=True, text=True)
                if text.returncode == 0:
                    break
            if text.returncode != 0:
                raise SystemExit(f"--baseline {revision}: {text.stderr.strip()}")
            (Path(tmp) / name).write_text(text.stdout)
        cpu_library.register(cpu_library.build(source_dir=Path(tmp)), "_baseline")
    return "_baseline"


def streaming_read_gbs(nbytes: int) -> float:
    """One thread's read of a float32 buffer (numpy's sum)."""
    a = np.ones(nbytes // 4, np.float32)
    a.sum()
    best = min(_timed(a.sum) for _ in range(3))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--parts", nargs="+", default=["matmul", "quant", "prefill", "decode"],
                        choices=["matmul", "quant", "prefill", "decode"])
    parser.add_argument("--baseline", metavar="REV",
                        help="the kernels also as built from git revision REV (the packed "
                             "matmul, prefill and decode attention), alternating")
    parser.add_argument("--dependent", action="store_true",
                        help="matmul: each layer reads the layer before (as in the engine's "
                             "steps), not x: XLA cannot run them side by side")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.quick:
        shapes, ms, runs = linear_shapes(64, 32, 128, 2, 256), [1, 8, 40], 2
        cases, attn = [(2, 32, 0), (1, 16, 16)], (4, 2, 16)
        decode = dict(slots=4, context=40, layers=2)
        quant = 256, 320
        read_bytes = 16 << 20
    else:  # bench/peer_hf.py's model: 8 layers of 512, 8 query / 4 KV heads of 64, vocab 8192
        shapes, ms, runs = linear_shapes(512, 256, 1024, 8, 8192), [1, 2, 4, 8, 16, 32, 48, 64,
                                                                      128, 256, 1024], 4
        cases, attn = [(4, 256, 0), (8, 128, 0), (1, 256, 256), (32, 32, 0), (4, 256, 256)], (
            8, 4, 64)
        decode = dict(slots=64, context=200, layers=8)
        quant = 4096, 14336
        read_bytes = 1 << 30
    out = {}
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    baseline = None
    if args.baseline:
        baseline = register_baseline(args.baseline)
    if "matmul" in args.parts:
        out["matmul"] = matmul_rows(shapes, ms, runs, rng, baseline, args.dependent)
        print(f"\nmatmul: {len(shapes)} linear layers in a chain"
              + (", each reading the one before" if args.dependent else "") + "; ms (GFLOP/s)")
        print(f"{'rows':>6} {'XLA dot':>18} {'cpu kernel':>18} {'cpu, packed w':>18}"
              + (f" {'packed, as at ' + args.baseline:>22}" if baseline else "")
              + (f" {'amx (bf16x3)':>18}" if "amx_ms" in out["matmul"][0] else "")
              + (f" {'amx, as at ' + args.baseline:>18}"
                 if "amx_baseline_ms" in out["matmul"][0] else ""))
        for r in out["matmul"]:
            print(f"{r['m']:>6} {r['xla_ms']:9.2f} ({r['xla_gflops']:5.0f}) "
                  f"{r['cpu_ms']:9.2f} ({r['cpu_gflops']:5.0f}) "
                  f"{r['panels_ms']:9.2f} ({r['panels_gflops']:5.0f})"
                  + (f" {r['baseline_ms']:13.2f} ({r['baseline_gflops']:5.0f})"
                     if baseline else "")
                  + (f" {r['amx_ms']:9.2f} ({r['amx_gflops']:5.0f})" if "amx_ms" in r else "")
                  + (f" {r['amx_baseline_ms']:11.2f} ({r['amx_baseline_gflops']:5.0f})"
                     if "amx_baseline_ms" in r else ""))
    if "quant" in args.parts:
        out["quant"] = quant_rows(*quant, [1, 8, 32], runs, rng)
        print(f"\nquantised weights: one [{quant[0]}, {quant[1]}] weight as panels "
              f"({quant[0] * quant[1] * 4 / 2**20:.3g} MiB in float32, "
              f"{quant[0] * quant[1] / 2**20:.3g} MiB in int8 or fp8); ms (GB/s of weight bytes) "
              "and the speed-up over float32")
        print(f"{'rows':>6} {'float32':>18} {'int8':>26} {'float8_e4m3fn':>26}")
        for r in out["quant"]:
            print(f"{r['m']:>6} {r['float32_ms']:9.2f} ({r['float32_gb_per_s']:5.1f})"
                  + "".join(f" {r[f'{kind}_ms']:9.2f} ({r[f'{kind}_gb_per_s']:5.1f}) "
                            f"{r[f'{kind}_speedup']:5.2f}x" for kind in ("int8", "fp8")))
    if "prefill" in args.parts:
        out["prefill"] = prefill_rows(cases, *attn, runs, rng, baseline)
        print(f"\nprefill attention, one layer ({attn[0]} heads, {attn[1]} KV heads of {attn[2]}); ms")
        print(f"{'rows x chunk after':>20} {'XLA walk':>10} {'cpu kernel':>11}"
              + (f" {'as at ' + args.baseline:>14}" if baseline else ""))
        for r in out["prefill"]:
            print(f"{r['rows']:>6} x {r['chunk']:>4} after {r['start']:>4} {r['xla_ms']:9.2f} "
                  f"{r['cpu_ms']:10.2f}" + (f" {r['baseline_ms']:14.2f}" if baseline else ""))
    if "decode" in args.parts:
        out["decode"] = decode_row(**decode, heads=attn[0], kv_heads=attn[1], head_dim=attn[2],
                                   runs=runs, rng=rng, baseline=baseline)
        out["read_gb_per_s"] = streaming_read_gbs(read_bytes)
        d = out["decode"]
        print(f"\ndecode attention, {d['slots']} slots x {d['context']} tokens x {d['layers']} "
              f"layers: {d['ms']:.2f} ms, {d['gb_per_s']:.1f} GB/s of K and V "
              f"(one thread's streaming read: {out['read_gb_per_s']:.1f} GB/s)")
        print(f"  on a bfloat16 pool (kv_cache_dtype=bfloat16): {d['bf16_ms']:.2f} ms, "
              f"{d['bf16_gb_per_s']:.1f} GB/s of its half-size K and V")
        if args.baseline:
            print(f"  as at {args.baseline}: {d['baseline_ms']:.2f} ms, "
                  f"{d['baseline_gb_per_s']:.1f} GB/s (alternating with the above)")
    return out


if __name__ == "__main__":
    main()
