"""Train the learned output-length predictor for sjf (jax + optax; inference is numpy).

    python -m jaxserve.tools.train_predictor TRACE.jsonl OUT.json      # pairs from a trace's rows
    jaxserve serve --policy sjf --sjf-predictor OUT.json

The model is `core.predictors.MLPPredictor`: one hidden ReLU layer over standardised prompt
features (log length, leading tokens hashed to buckets), regressing log1p(output length) with
Adam on full batches. Observed pairs come from a trace (`prompt_ids` and `output_len` per row) or
from finished requests.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.core.predictors import MLPPredictor, prompt_features


def train_predictor(prompts: list[list[int]], output_lens: list[int], hidden: int = 32,
                    steps: int = 600, learning_rate: float = 1e-2,
                    seed: int = 0) -> MLPPredictor:
    """Fit an MLPPredictor to observed (prompt, output length) pairs."""
    if len(prompts) != len(output_lens) or len(prompts) < 2:
        raise ValueError(f"need matching prompts and output lengths, at least 2; got "
                         f"{len(prompts)} and {len(output_lens)}")
    x = np.stack([prompt_features(p) for p in prompts])  # [N, F]
    y = np.log1p(np.asarray(output_lens, np.float32))  # [N]
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
    xs = jnp.asarray((x - mean) / std)
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w1": jax.random.normal(k1, (x.shape[1], hidden)) * np.sqrt(2.0 / x.shape[1]),
              "b1": jnp.zeros(hidden), "w2": jax.random.normal(k2, (hidden,)) / np.sqrt(hidden),
              "b2": jnp.asarray(float(y.mean()))}
    opt = optax.adam(learning_rate)
    state = opt.init(params)

    def loss(p):
        h = jax.nn.relu(xs @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    @jax.jit
    def update(p, s):
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    for _ in range(steps):
        params, state, _ = update(params, state)
    p = jax.tree.map(np.asarray, params)
    return MLPPredictor(mean.astype(np.float32), std.astype(np.float32), p["w1"], p["b1"],
                        p["w2"], float(p["b2"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="JSONL rows with prompt_ids and output_len")
    parser.add_argument("out", help="where to save the predictor (JSON)")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    from jaxserve.sim.workload import read_trace

    specs = [s for s in read_trace(args.trace) if s.prompt_ids is not None]
    if not specs:
        print(f"{args.trace} has no rows with prompt_ids", file=sys.stderr)
        return 2
    model = train_predictor([list(s.prompt_ids) for s in specs],
                            [s.output_len for s in specs], steps=args.steps)
    model.save(args.out)
    print(f"trained on {len(specs)} pairs; saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
