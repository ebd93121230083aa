"""Device side: the Llama-family model, KV pages, sampling, the jitted steps, weight loading.

Never imports the host side (core, engine, server) nor names a platform: the backend object
(jaxserve/backends) it is handed does the kernels.
"""
