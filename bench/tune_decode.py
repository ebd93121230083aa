"""Sweeps the decode kernel's tuning arguments at one shape and prints achieved GB/s for each.

    python bench/tune_decode.py --batch 64 --context 4096      # on a GPU
"""

import argparse
import functools
import itertools
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import GPU_GRID, copy_bandwidth_gb_s, paged_pools, time_us

from pallas_kernels import decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    grid = GPU_GRID
    on_gpu = jax.default_backend() == "gpu"
    k, v, table, seq_lens = paged_pools(np.random.default_rng(0), args.batch, args.context, grid)
    q = jax.random.normal(jax.random.key(1), (args.batch, grid.heads, grid.head_dim), grid.dtype)
    kv_bytes = 2 * table.size * grid.page_size * grid.kv_heads * grid.head_dim * q.dtype.itemsize
    nbytes = kv_bytes + 2 * q.size * q.dtype.itemsize
    copy = copy_bandwidth_gb_s(grid.copy_bytes if on_gpu else 64 << 20, 10 if on_gpu else 1, args)
    print(f"decode {args.batch} x {args.context}, copy bandwidth {copy:.0f} GB/s")
    print(f"{'pages/blk':>9}{'splits':>7}{'warps':>6}{'stages':>7}{'us':>9}{'GB/s':>8}{'%copy':>7}")
    best = None
    for ppb, splits, warps, stages in itertools.product((4, 8, 16), (1, 2, 4), (4, 8),
                                                        (2, 3)):
        fn = functools.partial(decode_attention, scale=grid.head_dim**-0.5, pages_per_block=ppb,
                               num_splits=splits, num_warps=warps, num_stages=stages,
                               interpret=not on_gpu)
        try:
            us = time_us(fn, (q, k, v, table, seq_lens), warmup=args.warmup, iters=args.iters,
                         calls=10 if on_gpu else 1)
        except Exception as err:  # a configuration Triton rejects: report it, go on
            print(f"{ppb:>9}{splits!s:>7}{warps:>6}{stages:>7}  error: {str(err)[:60]}")
            continue
        gbs = nbytes / us / 1e3
        print(f"{ppb:>9}{splits!s:>7}{warps:>6}{stages:>7}{us:>9.1f}{gbs:>8.0f}"
              f"{100 * gbs / copy:>6.0f}%", flush=True)
        if best is None or us < best[0]:
            best = (us, ppb, splits, warps, stages, gbs)
    if best:
        print(f"best: pages_per_block={best[1]} num_splits={best[2]} num_warps={best[3]} "
              f"num_stages={best[4]}: {best[0]:.1f} us, {best[5]:.0f} GB/s "
              f"({100 * best[5] / copy:.0f}% of copy)")


if __name__ == "__main__":
    main()
