"""Parallelism: the device mesh and each weight's and the KV pool's split for tensor, expert and data
parallelism (sharding.py), and several processes serving one model through jax.distributed
(distributed.py: the leader publishes each call, followers replay it; heartbeats).

Imports config, request, core (the scheduler output a call carries) and model (the KV pool's
layout). Must never import the runner or the engine: they import it (the follower process,
which builds a runner, is jaxserve/engine/follower.py).
"""
