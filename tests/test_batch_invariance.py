"""With the CPU kernels (matmul_impl and attention_impl "cpu"), a token's logits are bitwise the
same whatever the batch around it: other rows, padding, its row's index, how its prompt was cut
into chunks, and whether it was prefilled or decoded. (XLA's dot and reductions on the CPU sum
a row differently for different batch shapes; greedy ids on near-tied logits followed them.)"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.backends import Backend
from jaxserve.backends.cpu import CpuAttention, CpuOps
from jaxserve.config.model import ModelConfig
from jaxserve.model.kv_cache import AttentionMetadata, RaggedMetadata
from jaxserve.model.llama import LlamaForCausalLM, stack_layers

PAGE, PAGES_PER_ROW = 8, 8
CPU = Backend("cpu", CpuAttention(), CpuOps())


@pytest.fixture(scope="module", params=["llama", "tied", "qwen3"])
def model(request):
    """qwen3: the per-head q/k norms' row sums (its head_dim is not hidden / heads)."""
    cfg = ModelConfig.from_hf_dir(HF_FIXTURES / ("qwen3" if request.param == "qwen3" else "llama"))
    if request.param == "tied":  # the LM head is the embedding table: the transposed matmul
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    # the weights as the engine holds them for the CPU kernels: panels, layers stacked
    graphdef, state = stack_layers(*CPU.ops.pack_weights(
        *nnx.split(LlamaForCausalLM(cfg, jnp.float32, nnx.Rngs(3)))))
    return cfg, graphdef, state


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, kv, md):
    m = nnx.merge(graphdef, state)
    hidden, kv = m(tokens, kv, md, CPU)
    return m.logits(hidden, CPU), kv


@functools.partial(jax.jit, static_argnums=0)
def _forward_kv(graphdef, state, tokens, kv, md):  # the program where the sum had varied
    return nnx.merge(graphdef, state)(tokens, kv, md, CPU)[1]


def _run(model, rows, chunks, row=0, seed=0):
    """`rows` rows; row `row` feeds the sequence below in `chunks` (token counts per call),
    the others random tokens of random lengths. -> the logits of its last token."""
    cfg, graphdef, state = model
    rng = np.random.default_rng(seed)
    ids = np.random.default_rng(99).integers(3, cfg.vocab_size, 40)
    kv = CPU.attention.zeros(cfg.num_layers, rows * PAGES_PER_ROW + 1, PAGE, cfg.num_kv_heads,
                       cfg.head_dim, "float32")
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


@pytest.mark.parametrize(("lengths", "row", "tokens"), [
    ([20], 0, 20), ([20], 0, 32),  # alone, then with padding after it
    ([7, 20, 3], 1, 48), ([16, 5, 20], 2, 64),  # packed among others, at another offset
    ([20, 0, 9], 0, 40),  # an empty row after it
])
def test_a_ragged_calls_logits_are_the_padded_calls(model, lengths, row, tokens):
    """Rows packed one after another in one row of tokens (the engine's ragged prefill) give
    a token the bits the padded call gives it."""
    cfg, graphdef, state = model
    alone = _run(model, 1, [20])
    rng = np.random.default_rng(len(lengths) + tokens)
    ids = np.random.default_rng(99).integers(3, cfg.vocab_size, 40)
    rows = len(lengths)
    kv = CPU.attention.zeros(cfg.num_layers, rows * PAGES_PER_ROW + 1, PAGE, cfg.num_kv_heads,
                       cfg.head_dim, "float32")
    table = np.arange(1, rows * PAGES_PER_ROW + 1, dtype=np.int32).reshape(rows, -1)
    flat = rng.integers(3, cfg.vocab_size, (1, tokens)).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat[0, starts[row]:starts[row + 1]] = ids[:20]
    token_rows = np.full(tokens, rows, np.int32)
    positions = np.zeros((1, tokens), np.int32)
    for b in range(rows):
        token_rows[starts[b]:starts[b + 1]] = b
        positions[0, starts[b]:starts[b + 1]] = np.arange(lengths[b])
    md = RaggedMetadata(positions=positions, token_rows=token_rows, query_starts=starts,
                        seq_lens=np.asarray(lengths, np.int32), page_table=table)
    logits, _ = _forward(graphdef, state, flat, kv, md)
    got = np.asarray(logits)[0, starts[row + 1] - 1]
    assert (got == alone).all(), f"max difference {np.abs(got - alone).max()}"


def _small_model(path):
    """A tiny Llama directory for engine runs (dummy weights)."""
    config = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())
    config |= dict(hidden_size=96, intermediate_size=160, num_attention_heads=3,
                   num_key_value_heads=1, head_dim=32, vocab_size=300)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _outputs(outs):
    """Each request's ids, logprobs and prompt logprobs, for comparing runs."""
    return [(o.outputs[0].token_ids,
             [[(t, lp.logprob) for t, lp in s.items()] for s in o.outputs[0].logprobs],
             o.prompt_logprobs and [s and sorted(s.items()) for s in o.prompt_logprobs])
            for o in outs]


def test_the_engines_ragged_prefill_gives_the_padded_calls_outputs(tmp_path):
    # prompt chunks packed into ragged calls, or padded into calls grouped by length: the same
    # greedy ids and logprobs, some requests asking for prompt logprobs (those run alone)
    _small_model(tmp_path)
    rng = np.random.default_rng(8)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()}
               for n in rng.integers(2, 150, 12)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i % 4 == 0 else None) for i in range(12)]

    def run(ragged):
        llm = LLM(tmp_path, load_format="dummy", max_num_seqs=8, max_num_batched_tokens=128,
                  prefill_chunk_sizes=(16, 64, 128), page_size=16, num_pages=200,
                  ragged_prefill=ragged)
        assert llm.engine.runner.ragged is ragged
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_compilations_after_warmup"] == 0
        return _outputs(outs)

    assert run(True) == run(False)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_decode_rows_in_mixed_calls_give_the_separate_calls_outputs(tmp_path, batching):
    # an iteration that decodes and prefills runs its decode rows inside the ragged call (one
    # pass over the weights), or as a decode step of their own: the same ids and logprobs,
    # greedy and seeded sampling alike; a static batch's finished rows pad the mixed call
    _small_model(tmp_path)
    rng = np.random.default_rng(9)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()}
               for n in rng.integers(2, 120, 14)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0 if i % 3 else 0.8, seed=i,
                             ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i == 5 else None)
              for i, m in enumerate(rng.integers(2, 30, 14))]

    def run(mixed):
        llm = LLM(tmp_path, load_format="dummy", max_num_seqs=6, max_num_batched_tokens=64,
                  prefill_chunk_sizes=(16, 64), page_size=16, num_pages=200, batching=batching)
        runner = llm.engine.runner
        runner.mixed_calls = mixed
        calls = {"decode": 0, "ragged": 0}
        for kind in calls:
            fn = getattr(runner, f"_dispatch_{kind}")

            def counted(*args, kind=kind, fn=fn, **kwargs):
                calls[kind] += 1
                return fn(*args, **kwargs)
            setattr(runner, f"_dispatch_{kind}", counted)
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_compilations_after_warmup"] == 0
        return calls, _outputs(outs)

    mixed_calls, mixed = run(True)
    separate_calls, separate = run(False)
    assert mixed == separate
    # the mixed iterations ran no decode step of their own
    assert mixed_calls["ragged"] == separate_calls["ragged"]
    assert mixed_calls["decode"] < separate_calls["decode"]


def test_ragged_prefill_needs_the_cpu_attention(tmp_path):
    config = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ragged_prefill runs on the cpu or tpu attention"):
        LLM(tmp_path, load_format="dummy", attention_impl="reference", ragged_prefill=True)
    llm = LLM(tmp_path, load_format="dummy", attention_impl="reference", num_pages=64)
    assert not llm.engine.runner.ragged  # auto: only where it runs
    with pytest.raises(ValueError, match="ragged_prefill must be true, false or None"):
        LLM(tmp_path, load_format="dummy", ragged_prefill="yes")


def test_a_long_prompts_keys_do_not_depend_on_the_batch():
    # the shape where a sum of squares XLA fused into the program (a tree of adds, then) gave
    # RMSNorm another bit at a few positions of a 183-token prompt alone than in a batch
    cfg = dataclasses.replace(ModelConfig.from_hf_dir(HF_FIXTURES / "llama"), hidden_size=384,
                              num_heads=6, num_kv_heads=2, head_dim=64, intermediate_size=512,
                              vocab_size=300)
    graphdef, state = nnx.split(LlamaForCausalLM(cfg, jnp.float32, nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, 183)

    def first_layer_keys(rows, row):
        kv = CPU.attention.zeros(cfg.num_layers, 12 * rows + 1, 16, cfg.num_kv_heads, cfg.head_dim, "float32")
        table = np.arange(1, 12 * rows + 1, dtype=np.int32).reshape(rows, 12)
        tokens = rng.integers(3, cfg.vocab_size, (rows, 192)).astype(np.int32)
        tokens[row, :183] = ids
        lens = rng.integers(1, 193, rows).astype(np.int32)
        lens[row] = 183
        md = AttentionMetadata(positions=np.tile(np.arange(192, dtype=np.int32), (rows, 1)),
                               query_lens=lens, seq_lens=lens, page_table=table)
        kv = _forward_kv(graphdef, state, tokens, kv, md)
        keys = np.asarray(kv.pools[0])  # the first layer's pages come first
        return keys[table[row]].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:183]

    alone = first_layer_keys(1, 0)
    for rows, row in ((2, 1), (4, 2)):
        assert (first_layer_keys(rows, row) == alone).all()


def test_the_engines_logprobs_do_not_depend_on_the_batch(tmp_path):
    # prompts chunked by the budget, every row asking for sampled and prompt logprobs
    _small_model(tmp_path)
    llm = LLM(tmp_path, load_format="dummy", max_num_seqs=8, max_num_batched_tokens=256,
              prefill_chunk_sizes=(64, 256), page_size=16, num_pages=200)
    assert (llm.engine.runner.matmul_impl, llm.engine.runner.attention_impl) == ("cpu", "cpu")
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()}
               for n in rng.integers(3, 220, 10)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)

    def logprobs(out):
        steps = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
        return [[(t, lp.logprob) for t, lp in step.items()] for step in steps]

    together = [logprobs(o) for o in llm.generate(prompts, params)]
    for i, prompt in enumerate(prompts):
        assert logprobs(llm.generate(prompt, params)[0]) == together[i], f"request {i}"
