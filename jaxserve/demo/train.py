"""Train the built-in demo model: a small Llama on the Python standard library's source, bytes.

    python -m jaxserve.demo.train                      # the shipped run -> jaxserve/demo/checkpoint
    python -m jaxserve.demo.train --config draft       # its draft model -> jaxserve/demo/draft
    python -m jaxserve.demo.train --config demo_long --init jaxserve/demo/checkpoint
    python -m jaxserve.demo.train --config draft_long --init jaxserve/demo/draft
                                                       # both on to a 1,024-token context
    python -m jaxserve.demo.train --config tiny --steps 3 --out /tmp/tiny

The model is the serving model itself (`LlamaForCausalLM`, the same parameters); training runs
it through `causal_logits`, a plain causal forward over [B, T] with no KV cache. AdamW with
linear warmup and cosine decay, batches of random windows drawn by a seeded numpy generator, so a
run is determined by its seed (and the stdlib it finds). The output directory is an orbax model
directory like `jaxserve convert` writes, plus byte_tokenizer.json and training_report.json.
"""

import argparse
import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jaxserve.backends import REFERENCE
from jaxserve.config.model import ModelConfig
from jaxserve.demo import CHECKPOINT_DIR, DRAFT_DIR
from jaxserve.demo.data import (
    Corpus,
    evenly_spaced_windows,
    line_starts,
    load_corpus,
    training_windows,
)
from jaxserve.model.llama import LlamaForCausalLM, apply_rope, rope_tables
from jaxserve.model.loader import load_orbax_state, save_orbax
from jaxserve.text.tokenizer import ByteTokenizer

REPORT_FILE = "training_report.json"


def byte_llama(hidden: int, layers: int, heads: int, kv_heads: int, context: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=ByteTokenizer.VOCAB_SIZE,
        hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden // heads, max_position_embeddings=context,
        rms_norm_eps=1e-5, bos_token_id=ByteTokenizer.BOS_ID,
        eos_token_ids=(ByteTokenizer.EOS_ID,), dtype="float32",
    )


@dataclass(frozen=True)
class TrainConfig:
    """One training run. The model trains on windows of `max_position_embeddings` tokens."""

    model: ModelConfig
    batch_size: int
    steps: int
    peak_lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    prompt_fraction: float = 0.25  # of each batch: prompt-shaped windows (see data.py)
    val_windows: int = 128  # the fixed validation sample
    eval_every: int = 0  # 0: validate only at the end
    max_files: int | None = None  # None: the whole stdlib

    @property
    def context(self) -> int:
        return self.model.max_position_embeddings


CONFIGS = {
    # A few seconds: for the test that keeps this script working.
    "tiny": TrainConfig(byte_llama(hidden=32, layers=2, heads=2, kv_heads=1, context=64),
                        batch_size=4, steps=3, peak_lr=3e-3, warmup_steps=1, val_windows=4,
                        max_files=40),
    # The shipped model: 3.3M parameters, sized to train in about 25 minutes on a free 2-core
    # CPU (~2.5 s per step; attention at context 512 would cost a third more per token).
    "demo": TrainConfig(byte_llama(hidden=256, layers=4, heads=4, kv_heads=2, context=256),
                        batch_size=32, steps=600, peak_lr=3e-3, warmup_steps=30,
                        eval_every=150),
    # The demo's draft model for speculative decoding (jaxserve/demo/draft): the same text and
    # tokens, 131K parameters (512 KB), about 40x less work per token than the demo.
    "draft": TrainConfig(byte_llama(hidden=64, layers=2, heads=2, kv_heads=1, context=256),
                         batch_size=32, steps=600, peak_lr=3e-3, warmup_steps=30,
                         eval_every=150),
    # The shipped demo and draft go on from those runs (--init) to a 1,024-token context: the
    # same tokens a step in 8 windows, at a lower rate (a context 4x as long trained from the
    # start would cost about twice the time a token for all 600 steps)
    "demo_long": TrainConfig(byte_llama(hidden=256, layers=4, heads=4, kv_heads=2,
                                        context=1024),
                             batch_size=8, steps=150, peak_lr=1e-3, warmup_steps=10,
                             val_windows=32),
    "draft_long": TrainConfig(byte_llama(hidden=64, layers=2, heads=2, kv_heads=1, context=1024),
                              batch_size=8, steps=150, peak_lr=1e-3, warmup_steps=10,
                              val_windows=32),
}


def causal_logits(model: LlamaForCausalLM, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] at positions 0..T-1 -> logits [B, T, vocab] float32, causal attention."""
    cfg = model.config
    if cfg.sliding_window is not None or cfg.qk_norm:
        raise ValueError("causal_logits has no sliding window and no per-head q/k norm (Qwen3)")
    b, t = tokens.shape
    x = model.model.embed_tokens(tokens)  # [B, T, hidden]
    cos, sin = (table[None] for table in rope_tables(cfg, t, x.dtype))  # [1, T, rotary_dim]
    causal = jnp.tril(jnp.ones((t, t), bool))  # [T(query), S(key)]
    kv_heads, group, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x, REFERENCE)
        q = apply_rope(attn.q_proj(h).reshape(b, t, cfg.num_heads, d), cos, sin)
        k = apply_rope(attn.k_proj(h).reshape(b, t, kv_heads, d), cos, sin)
        v = attn.v_proj(h).reshape(b, t, kv_heads, d)
        q = q.reshape(b, t, kv_heads, group, d)  # query head kv*group+g reads kv head kv
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(causal, scores * d**-0.5, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, -1)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x, REFERENCE), REFERENCE)
    return model.logits(model.model.norm(x, REFERENCE), REFERENCE)


def window_nll(graphdef: nnx.GraphDef, params: nnx.State,
               windows: jax.Array) -> jax.Array:  # [B, T + 1] -> [B, T] nats
    logits = causal_logits(nnx.merge(graphdef, params), windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.peak_lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.peak_lr / 10)
    decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95,
                                   weight_decay=cfg.weight_decay, mask=decay_matrices))


def validation_bpb(graphdef, params, windows: np.ndarray, batch_size: int) -> float:
    """Bits per byte: the mean NLL in nats over every target of the windows, / ln 2."""
    nll = jax.jit(window_nll, static_argnums=0)
    total = sum(float(jnp.sum(nll(graphdef, params, jnp.asarray(windows[i:i + batch_size]))))
                for i in range(0, len(windows), batch_size))
    return total / (windows.shape[0] * (windows.shape[1] - 1)) / math.log(2)


def train(cfg: TrainConfig, out: Path, seed: int, corpus: Corpus | None = None,
          progress: bool = True, init: Path | None = None) -> dict:
    """Train, write the model directory `out`, and return the training report. `init`: start
    from that model directory's weights (same shapes; the context may differ)."""
    corpus = corpus or load_corpus(max_files=cfg.max_files)
    if init is None:
        graphdef, params = nnx.split(LlamaForCausalLM(cfg.model, jnp.float32, nnx.Rngs(seed)))
    else:
        graphdef, params = load_orbax_state(init, cfg.model, jnp.float32)
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, windows):
        loss_fn = lambda p: jnp.mean(window_nll(graphdef, p, windows))  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    starts = line_starts(corpus.train)
    num_prompts = round(cfg.prompt_fraction * cfg.batch_size)
    val = evenly_spaced_windows(corpus.val, cfg.val_windows, cfg.context)
    losses, curve = [], []
    start, start_cpu = time.perf_counter(), time.process_time()
    bar = tqdm(range(1, cfg.steps + 1), desc="train", disable=not progress)
    for i in bar:
        windows = jnp.asarray(training_windows(corpus.train, starts, rng, cfg.batch_size,
                                               num_prompts, cfg.context))
        params, opt_state, loss = step(params, opt_state, windows)
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if cfg.eval_every and i % cfg.eval_every == 0 and i < cfg.steps:
            bpb = validation_bpb(graphdef, params, val, cfg.batch_size)
            curve.append({"step": i, "val_bpb": round(bpb, 4)})
            bar.write(f"step {i}: val bits/byte {bpb:.3f}")
    train_seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - start_cpu
    bpb = validation_bpb(graphdef, params, val, cfg.batch_size)
    curve.append({"step": cfg.steps, "val_bpb": round(bpb, 4)})

    save_orbax(out, cfg.model, params)
    ByteTokenizer().save(out)
    tail = losses[-max(1, len(losses) // 20):]
    report = {
        "model": cfg.model.to_hf_dict(),
        "num_params": cfg.model.num_params,
        "train_config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"},
        "seed": seed,
        "init": None if init is None else json.loads((Path(init) / REPORT_FILE).read_text()),
        "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.context,
        "wall_seconds": round(train_seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),  # all threads: less than 2x wall when shared
        "seconds_per_step": round(train_seconds / cfg.steps, 3),
        "final_train_loss": round(losses[-1], 4),
        "final_train_loss_mean_last_5pct": round(float(np.mean(tail)), 4),
        "val_bits_per_byte": round(bpb, 4),
        "val_curve": curve,
        "val_sample": f"{cfg.val_windows} evenly spaced windows of {cfg.context} targets",
        "corpus": corpus.describe(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.demo.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="demo")
    parser.add_argument("--steps", type=int, help="default: the config's")
    parser.add_argument("--batch-size", type=int, help="default: the config's")
    parser.add_argument("--out", type=Path, help="default: the shipped directory (the demo's "
                        "checkpoint, or its draft for --config draft)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, help="start from this model directory's weights "
                        "(demo_long and draft_long go on from the shipped demo and draft)")
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps,
                                  warmup_steps=min(cfg.warmup_steps, max(1, args.steps // 10)))
    if args.batch_size is not None:
        cfg = dataclasses.replace(cfg, batch_size=args.batch_size)
    out = args.out or (DRAFT_DIR if args.config.startswith("draft") else CHECKPOINT_DIR)
    report = train(cfg, out, args.seed, init=args.init)
    print(f"wrote {out}: {report['num_params'] / 1e6:.2f}M parameters, "
          f"{report['steps']} steps in {report['wall_seconds']:.0f} s, "
          f"train loss {report['final_train_loss']:.3f}, "
          f"val bits/byte {report['val_bits_per_byte']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
