"""Speculative decoding's host half: the proposers the scheduler asks (the verification is the
sampler's: model/sampler.py `verify`; a draft model's proposals are made on the device,
draft_runner.py). Host only: no jax here."""
