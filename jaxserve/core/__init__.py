"""Host-side scheduling (Python and numpy only, never jax): the scheduler (scheduler.py: what runs
each iteration under the token budget, chunked prefill, preemption), the KV pages (page_pool.py,
prefix_cache.py, kv_manager.py), the queue's policies and order (policies.py, waiting.py,
predictors.py), the batching window (window.py) and the step shapes (buckets.py).

Imports config, request and spec (the proposers it asks). Must never import the model, the
runner, the backends, the engine or the server: the engine, the simulator and the runner stand on
it, and the simulator runs it without jax.
"""
