"""The runner: the only part that moves data between the host and the device. model_runner.py
(ModelRunner: a step's padded arrays from the persistent batch, the jitted calls, one
device-to-host copy per step), input_batch.py (its host arrays kept across steps, numpy only),
inflight.py (an iteration dispatched and not yet read, and the reading of its results),
sampler_controls.py (the controlled calls' head and host masks), draft_runner.py (the draft
model of speculative decoding).

Imports config, request, core, structured, model, backends and parallel. Must never import the
engine, the server or anything above them; the engine reaches it only through the Runner
interface (jaxserve/engine/loop.py) and builds it lazily, so host-only users load without jax.
"""
