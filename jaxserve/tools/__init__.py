"""Commands over the whole engine: `jaxserve plan` (plan.py: what fits, the KV arithmetic),
`jaxserve simulate` (simulate.py; also `python -m jaxserve.sim`), the simulator's calibration and
validation against the real engine (calibrate.py), and the output-length predictor's training
(train_predictor.py).

Imports any layer below it (the engine, the runner, the server's config, the simulator, the
benchmarks). Only the CLI imports it: a part below must never import it.
"""
