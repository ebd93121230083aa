"""Speculative decoding's host half: the proposers (the verification is the sampler's:
model/sampler.py `verify`). Host only: no jax here."""
