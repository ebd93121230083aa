"""With the CPU kernels (matmul_impl and attention_impl "cpu"), a token's logits are bitwise the
same whatever the batch around it: other rows, padding, its row's index, how its prompt was cut
into chunks, and whether it was prefilled or decoded. (XLA's dot and reductions on the CPU sum
a row differently for different batch shapes; greedy ids on near-tied logits followed them.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx

from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model_config import ModelConfig

PAGE, PAGES_PER_ROW = 8, 8


@pytest.fixture(scope="module", params=["llama", "tied"])
def model(request):
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / "llama")
    if request.param == "tied":  # the LM head is the embedding table: the transposed matmul
        cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    graphdef, state = nnx.split(LlamaForCausalLM(cfg, jnp.float32, nnx.Rngs(3)))
    return cfg, graphdef, state


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, kv, md):
    m = nnx.merge(graphdef, state)
    hidden, kv = m(tokens, kv, md, "cpu", "cpu")
    return m.logits(hidden, "cpu"), kv


def _run(model, rows, chunks, row=0, seed=0):
    """`rows` rows; row `row` feeds the sequence below in `chunks` (token counts per call),
    the others random tokens of random lengths. -> the logits of its last token."""
    cfg, graphdef, state = model
    rng = np.random.default_rng(seed)
    ids = np.random.default_rng(99).integers(3, cfg.vocab_size, 40)
    kv = KVCache.zeros(cfg.num_layers, rows * PAGES_PER_ROW + 1, PAGE, cfg.num_kv_heads,
                       cfg.head_dim, jnp.float32)
    table = np.arange(1, rows * PAGES_PER_ROW + 1, dtype=np.int32).reshape(rows, -1)
    start = 0
    for n in chunks:
        width = int(rng.choice([n, n + 3, 2 * n]))  # padding queries past the chunk
        tokens = rng.integers(3, cfg.vocab_size, (rows, width)).astype(np.int32)
        tokens[row, :n] = ids[start:start + n]
        query_lens = rng.integers(0, width + 1, rows).astype(np.int32)
        query_lens[row] = n
        starts = np.zeros(rows, np.int32)
        starts[row] = start
        md = AttentionMetadata(positions=starts[:, None] + np.arange(width, dtype=np.int32),
                               query_lens=query_lens, seq_lens=starts + query_lens,
                               page_table=table)
        logits, kv = _forward(graphdef, state, tokens, kv, md)
        start += n
    return np.asarray(logits)[row, chunks[-1] - 1]


@pytest.mark.parametrize(("rows", "chunks", "row"), [
    (3, [20], 0),  # other rows and padding around it
    (6, [20], 4),  # another row index
    (1, [12, 8], 0),  # its prompt in two chunks
    (4, [5, 7, 8], 2),
    (1, [12] + [1] * 8, 0),  # decoded after a 12-token prompt
    (7, [19, 1], 5),  # decoded among others
])
def test_a_tokens_logits_do_not_depend_on_the_batch(model, rows, chunks, row):
    alone = _run(model, 1, [20])
    got = _run(model, rows, chunks, row, seed=rows)
    assert (got == alone).all(), f"max difference {np.abs(got - alone).max()}"
