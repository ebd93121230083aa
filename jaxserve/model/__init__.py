"""Device side: the Llama-family model, KV pages, sampling, the jitted steps, weight loading, and
the columns of a decode call's one host array (decode_rows.py, numpy only, the host's too).

Imports jaxserve.config only (and jax, flax, qwix). Must never import the host side (core,
runner, engine, server) nor name a platform: the backend object (jaxserve/backends) it is
handed does the kernels.
"""
