"""jaxserve's CPU backend kernels: C++ through XLA's FFI, built on first use.

    attention.py   paged attention, decode and prefill chunks (padded or ragged), on float32
                   pages or bfloat16 pages held as their bits
    matmul.py      the linear layers' matmul (float32 weights, or int8 / float8_e4m3fn ones
                   with a scale per column), the experts' grouped matmul and the row
                   reductions, batch invariant: a row's result does not depend on the other
                   rows of the step
    library.py     the build, cache and registration of the one shared library

This package imports jax (and `pallas_kernels`' input checks) only and knows nothing of the
engine; `jaxserve.backends.cpu` is its one user in the engine.
"""
