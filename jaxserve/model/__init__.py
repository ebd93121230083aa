"""Device side: the Llama-family model, KV pages, attention dispatch, sampling, weight loading.

Never imports the host side (core, engine, server).
"""
