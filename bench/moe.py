"""Mixture-of-experts decode: the grouped matmul against a dense loop over experts, one run.

    python bench/moe.py                                   # a Qwen3-MoE-shaped model sized for a CPU
    python bench/moe.py --hidden 2048 --moe-intermediate 768 --experts 128 --layers 4 \\
        --heads 32 --kv-heads 4 --head-dim 128 --dtype bfloat16   # Qwen3-30B-A3B's layers (GPU)

A Qwen3-MoE model with random weights (top-k of --experts experts, renormalised; q/k norms),
its decode step (the model's forward over --rows one-token rows near --context tokens each,
their pages scattered over the pool, and the logits) jitted on this platform's backend, timed
with the experts run two ways:

    grouped  the step's (token, expert) pairs sorted by expert, each expert's rows one group
             of a grouped matmul (backend.ops.grouped_linear): a token's experts only
    dense    every expert run on every token, each token keeping its experts' outputs (the
             loop over experts a model without a grouped matmul runs): num_experts / top_k
             times the expert work

and prints the decode throughput (rows / step time) of each at each batch, the speed-up, and
the expert weights a step must read: at one row only top_k experts' (grouped), against all
(dense); at 32 rows most experts are hit by some token.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.backends.select import select_backend  # noqa: E402
from jaxserve.config.model import ModelConfig  # noqa: E402
from jaxserve.model.kv_cache import AttentionMetadata  # noqa: E402
from jaxserve.model.loader import random_state  # noqa: E402

PAGE_SIZE = 16


def model_config(args) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.moe_intermediate, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=4096,
        rope_theta=1e6, qk_norm=True, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True, dtype=args.dtype)


def decode_step(cfg: ModelConfig, state, graphdef, backend, rows: int, context: int):
    """A jitted decode step over `rows` rows and its inputs."""
    pages_per_row = -(-(context + 8) // PAGE_SIZE)
    num_pages = rows * pages_per_row + 1
    rng = np.random.default_rng(0)
    table = rng.permutation(np.arange(1, num_pages)).reshape(rows, pages_per_row)
    lens = rng.integers(context - context // 10, context + 1, rows).astype(np.int32)
    md = AttentionMetadata(positions=jnp.asarray(lens - 1)[:, None],
                           query_lens=jnp.ones(rows, jnp.int32), seq_lens=jnp.asarray(lens),
                           page_table=jnp.asarray(table, jnp.int32))
    kv = backend.attention.zeros(cfg.num_layers, num_pages, PAGE_SIZE, cfg.num_kv_heads,
                                 cfg.head_dim, cfg.dtype)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, 1)), jnp.int32)

    @jax.jit
    def step(state, kv, tokens, md):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(tokens, kv, md, backend)
        return model.logits(hidden[:, -1], backend), kv

    return lambda: jax.block_until_ready(step(state, kv, tokens, md)[0])


def seconds_per_call(call, iters: int) -> tuple[float, np.ndarray]:
    """The median seconds of a call, and its logits."""
    logits = np.asarray(call())  # compiles
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), logits


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)

    cfg = model_config(args)
    backend = select_backend("auto", "auto", cfg.dtype, cfg.head_dim, PAGE_SIZE,
                             num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    graphdef, state = random_state(cfg, jnp.dtype(cfg.dtype), seed=0)
    graphdef, state = backend.ops.pack_weights(graphdef, state)
    model = nnx.merge(graphdef, state)
    expert_bytes = sum(x.nbytes for layer in model.model.layers
                       for x in jax.tree.leaves(nnx.state(layer.mlp.experts)))
    print(f"Qwen3-MoE shape: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts}"
          f" experts of {cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok}; "
          f"{cfg.num_params / 1e6:.0f}M parameters ({expert_bytes / 2**20:.0f} MiB of experts), "
          f"{cfg.dtype}, {jax.default_backend()} backend {backend.name} "
          f"(ops {backend.ops.name}), context ~{args.context}")
    variants = {}
    for dense in (False, True):
        for layer in model.model.layers:
            layer.mlp.dense = dense
        variants["dense" if dense else "grouped"] = nnx.split(model)
    print(f"{'batch':>5} {'grouped tok/s':>14} {'dense tok/s':>12} {'speed-up':>9} "
          f"{'grouped ms':>11} {'dense ms':>9} {'experts hit/layer':>18} {'same logits':>11}")
    results = []
    for rows in (int(b) for b in args.batches.split(",")):
        seconds, logits = {}, {}
        for name, (g, s) in variants.items():
            seconds[name], logits[name] = seconds_per_call(
                decode_step(cfg, s, g, backend, rows, args.context), args.iters)
        # bit for bit on the CPU backend (one kernel, each row its own chain); XLA's dot
        # elsewhere may sum in another order
        same = np.array_equal(logits["grouped"], logits["dense"])
        # the experts some token of a random batch picks: what the grouped matmul reads
        hit = np.mean([len(set(np.argsort(np.random.default_rng(i).random(
            (rows, cfg.num_experts)), axis=1)[:, :cfg.num_experts_per_tok].ravel()))
            for i in range(64)])
        print(f"{rows:>5} {rows / seconds['grouped']:>14.1f} {rows / seconds['dense']:>12.1f} "
              f"{seconds['dense'] / seconds['grouped']:>8.2f}x {1e3 * seconds['grouped']:>11.2f} "
              f"{1e3 * seconds['dense']:>9.2f} {hit:>10.1f} of {cfg.num_experts:<4} "
              f"{'yes' if same else 'no':>11}")
        results.append({"batch": rows, "seconds": seconds, "same_logits": same,
                        "close": bool(np.allclose(logits["grouped"], logits["dense"],
                                                  atol=1e-3))})
    return results


if __name__ == "__main__":
    main()
