"""One fp8 linear layer two ways: fp8 activations times fp8 weights in one fp8 dot (what a GPU
of compute capability 8.9 on runs: QuantizedLinear.fp8_product, the kernel held [out, in])
against the weight-only product (the weights widened inside it), at a decode step's rows.

    python bench/fp8_matmul.py                    # Llama-3-8B's gate_proj: 4096 x 14336
    python bench/fp8_matmul.py --in 1024 --out 4096 --rows 1,8

Prints each form's median µs a call, the weights' GB/s, and the native result's largest
difference from the weight-only one relative to that row's largest output.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.backends.base import Ops
from jaxserve.model.quant import QuantizedLinear, quantize_weight


def median_us(fn, *args, iters: int = 50) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in", dest="in_features", type=int, default=4096)
    parser.add_argument("--out", dest="out_features", type=int, default=14336)
    parser.add_argument("--rows", default="2,64")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    w = jax.random.normal(jax.random.key(0), (args.in_features, args.out_features)) * 0.02
    q, scale = quantize_weight(w, "fp8")

    def fp8_layer():
        layer = QuantizedLinear(args.in_features, args.out_features, False, dtype, "fp8")
        layer.kernel.set_value(q)
        layer.scale.set_value(scale)
        return nnx.split(layer)

    native = Ops(native_fp8=True)
    graphdef, state = native.pack_weights(*fp8_layer())  # held [out, in]
    graphdef_plain, state_plain = fp8_layer()
    weight_only = jax.jit(lambda s, x: Ops().linear(nnx.merge(graphdef_plain, s), x))
    fp8 = jax.jit(lambda s, x: native.linear(nnx.merge(graphdef, s), x))
    gb = args.in_features * args.out_features / 1e9  # one byte a weight
    print(f"{jax.devices()[0].device_kind}: fp8 layer {args.in_features} x {args.out_features}, "
          f"{args.dtype} activations")
    for rows in (int(r) for r in args.rows.split(",")):
        x = (jax.random.normal(jax.random.key(rows), (rows, args.in_features))).astype(dtype)
        a, b = weight_only(state_plain, x), fp8(state, x)
        diff = np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max(axis=-1)
        rel = float((diff / np.abs(np.asarray(a, np.float32)).max(axis=-1)).max())
        t_weight_only, t_fp8 = median_us(weight_only, state_plain, x), median_us(fp8, state, x)
        print(f"{rows:4d} rows: weight-only {t_weight_only:8.1f} us ({gb / t_weight_only * 1e6:6.0f}"
              f" GB/s), fp8 x fp8 {t_fp8:8.1f} us ({gb / t_fp8 * 1e6:6.0f} GB/s), "
              f"{t_weight_only / t_fp8:.2f}x; largest difference {rel:.2e} of the row's largest")


if __name__ == "__main__":
    main()
