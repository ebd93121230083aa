"""The backend seam (jaxserve/backends): chosen once from the platform and the options, handed
to the model whole; the KV pool holds every layer's pages in one array per pool; layers
stacked under jax.lax.scan or a list unrolled give the same ids."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.backends import REFERENCE, Ops, resolve_attention_impl, select_backend
from jaxserve.backends.base import Attention, Backend
from jaxserve.backends.cpu import CpuAttention, CpuOps
from jaxserve.backends.gpu import PallasAttention
from jaxserve.config.model import ModelConfig
from jaxserve.model.decode_rows import PAGES
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.llama import LlamaForCausalLM, stack_layers
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import make_step_fns

MODEL = HF_FIXTURES / "llama"


def test_auto_attention_takes_the_kernels_only_where_they_can_run():
    assert resolve_attention_impl("auto", "gpu", 128, 16) == "pallas"
    assert resolve_attention_impl("auto", "cpu", 128, 16) == "cpu"  # where it builds
    # Triton blocks are powers of two: a head_dim of 80 falls back on the GPU rather than fail
    # while compiling the first step, and an explicit pallas says why at start-up
    assert resolve_attention_impl("auto", "gpu", 80, 16) == "reference"
    with pytest.raises(ValueError, match="attention_impl='pallas': head_dim 80 is not a power"):
        resolve_attention_impl("pallas", "cpu", 80, 16)
    with pytest.raises(ValueError, match="page_size 12 is not a power of two"):
        resolve_attention_impl("pallas", "gpu", 64, 12)


def test_the_backend_is_chosen_from_the_platform_and_options():
    cpu = select_backend("auto", "auto", "float32", 64, 16, "cpu")
    assert (cpu.name, cpu.attention, cpu.ops) == ("cpu", CpuAttention(), CpuOps())
    # a 16-bit model on the CPU: the C++ attention, XLA's dot (the matmul kernel is float32)
    assert select_backend("auto", "auto", "bfloat16", 64, 16, "cpu").ops == Ops()
    gpu = select_backend("auto", "auto", "bfloat16", 128, 16, "gpu")
    # XLA's dot on the GPU reads a scanned layer's weights through a copy: unrolled there
    assert (gpu.name, gpu.attention, gpu.ops) == ("gpu", PallasAttention(),
                                                  Ops(scan_layers=False))
    assert select_backend("auto", "auto", "bfloat16", 80, 16, "gpu") == Backend(
        "reference", Attention(), Ops(scan_layers=False))
    assert select_backend("auto", "auto", "bfloat16", 128, 16, "tpu").ops.scan_layers
    assert select_backend("reference", "xla", "float32", 64, 16, "cpu") == REFERENCE
    # the Pallas kernels off the GPU run in the interpreter (the tests' way to check them)
    assert select_backend("pallas", "xla", "float32", 64, 16, "cpu").attention.interpret
    with pytest.raises(ValueError, match="matmul_impl='cpu' runs on the CPU backend"):
        select_backend("auto", "cpu", "float32", 64, 16, "gpu")
    # frozen and hashable: the jitted steps take it as a static argument
    assert hash(cpu) == hash(select_backend("cpu", "cpu", "float32", 64, 16, "cpu"))


def _tiny(num_layers=3):
    cfg = dataclasses.replace(ModelConfig.from_hf_dir(MODEL), num_layers=num_layers)
    return cfg, nnx.split(LlamaForCausalLM(cfg, jnp.float32, nnx.Rngs(0)))


@pytest.mark.parametrize("attention", [Attention(), CpuAttention()], ids=lambda a: a.name)
def test_layer_ls_pages_sit_at_l_times_num_pages_of_the_one_pool(attention):
    """Each layer writes its keys only into its own rows of the pool (l * num_pages + page),
    and the null page of each layer stays untouched by real tokens."""
    cfg, (graphdef, state) = _tiny()
    graphdef, state = stack_layers(graphdef, state)
    backend = dataclasses.replace(REFERENCE, attention=attention)
    num_pages, page = 5, 4
    kv = attention.zeros(cfg.num_layers, num_pages, page, cfg.num_kv_heads, cfg.head_dim,
                         "float32")
    assert kv.pools[0].shape == (cfg.num_layers * num_pages, page, cfg.num_kv_heads,
                                 cfg.head_dim)
    md = AttentionMetadata(positions=jnp.arange(6, dtype=jnp.int32)[None],
                           query_lens=jnp.array([6], jnp.int32),
                           seq_lens=jnp.array([6], jnp.int32),
                           page_table=jnp.array([[3, 1, 0]], jnp.int32))

    @jax.jit
    def forward(state, kv):
        return nnx.merge(graphdef, state)(jnp.arange(2, 8, dtype=jnp.int32)[None], kv, md,
                                          backend)[1]

    keys = np.asarray(forward(state, kv).pools[0]).reshape(cfg.num_layers, num_pages, page, -1)
    for layer in range(cfg.num_layers):
        written = np.abs(keys[layer]).sum(axis=(1, 2)) > 0
        assert written.tolist() == [False, True, False, True, False]  # pages 3 and 1 only
        assert (np.abs(keys[layer, 1, 2:]).sum() == 0)  # tokens 4-5 fill page 1's first half
    assert not np.array_equal(keys[0], keys[1])  # each layer its own keys


def test_scanned_and_unrolled_layers_give_the_same_logits():
    cfg, (graphdef, state) = _tiny()
    stacked = stack_layers(graphdef, state)
    kv = REFERENCE.attention.zeros(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim,
                                   "float32")
    md = AttentionMetadata(positions=jnp.arange(8, dtype=jnp.int32)[None],
                           query_lens=jnp.array([8], jnp.int32),
                           seq_lens=jnp.array([8], jnp.int32),
                           page_table=jnp.array([[1, 2, 0]], jnp.int32))
    tokens = jnp.arange(3, 11, dtype=jnp.int32)[None]

    def logits(graphdef, state):
        model = nnx.merge(graphdef, state)
        return np.asarray(model.logits(model(tokens, kv, md, REFERENCE)[0], REFERENCE))

    np.testing.assert_allclose(logits(*stacked), logits(graphdef, state), atol=1e-5)


def test_the_engine_gives_the_same_greedy_ids_with_layers_scanned_or_unrolled():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_sizes=(16, 32),
                num_pages=64, page_size=8)
    ids = {}
    for scan in (True, False):
        llm = LLM(MODEL, scan_layers=scan, **base)
        ids[scan] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.num_compilations_after_warmup == 0
    assert ids[True] == ids[False]


@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_tpu_backend_in_interpret_mode_gives_the_references_greedy_ids(tmp_path,
                                                                           head_dim):
    """attention_impl="tpu" runs JAX's Pallas TPU kernel (the interpreter on the CPU) inside
    the engine's steps: padded decode, ragged prompt chunks cut by the budget, and mixed
    iterations; the ids are the reference attention's. A head_dim of 64 (SmolLM2's) is padded
    to the kernel's 128 lanes in the pool."""
    config = json.loads((MODEL / "config.json").read_text())
    config |= dict(hidden_size=256, intermediate_size=256, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=head_dim, vocab_size=300,
                   num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()} for n in (7, 40, 21)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = dict(load_format="dummy", max_num_seqs=4, max_num_batched_tokens=32,
                prefill_chunk_sizes=(16, 32), num_pages=48, page_size=8, row_buckets=(4,),
                enable_prompt_logprobs=False)
    tpu = LLM(tmp_path, attention_impl="tpu", matmul_impl="xla", **base)
    runner = tpu.engine.runner
    assert (runner.backend.name, runner.attention_impl, runner.ragged) == ("tpu", "tpu", True)
    assert runner.kv.pools[0].shape[2:] == (2, 128)  # K and V interleaved, whole lanes
    got = [o.outputs[0].token_ids for o in tpu.generate(prompts, params)]
    assert len({t for ids in got for t in ids}) > 3  # the ids say something
    del tpu
    ref = LLM(tmp_path, attention_impl="reference", matmul_impl="xla", **base)
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    with pytest.raises(ValueError, match="attention_impl='tpu': num_kv_heads 6"):
        select_backend("tpu", "xla", "float32", head_dim, 16, "cpu", 12, 6)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_no_step_copies_the_kv_pool(attention, scan):
    """The layers' scan carries the one pool (or the unrolled layers pass it on) and each
    layer writes its pages in place: the compiled decode and prefill steps hold no copy of
    the pool (XLA would add one where it could not alias the buffer)."""
    cfg = dataclasses.replace(ModelConfig.from_hf_dir(MODEL), num_layers=3)
    backend = select_backend(attention, "auto", "float32", cfg.head_dim, 8, "cpu",
                             cfg.num_heads, cfg.num_kv_heads)
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: LlamaForCausalLM(cfg, jnp.float32, nnx.Rngs(0))))
    out = {}

    def prepare(state):
        out["graphdef"], state = backend.ops.pack_weights(graphdef, state)
        if scan:
            out["graphdef"], state = stack_layers(out["graphdef"], state)
        return state

    state = jax.eval_shape(prepare, abstract)
    kv = jax.eval_shape(lambda: backend.attention.zeros(cfg.num_layers, 50, 8, cfg.num_kv_heads,
                                                        cfg.head_dim, "float32"))
    fns = make_step_fns(out["graphdef"], jax.tree.structure(state), backend, 0, 4)
    spec = jax.ShapeDtypeStruct
    weights = (jax.tree.leaves(state), None)
    pool = f"f32[{cfg.num_layers * 50},8,{cfg.num_kv_heads},{cfg.head_dim}]"
    for rows, chunk in ((4, 1), (2, 16)):
        md = AttentionMetadata(spec((rows, chunk), jnp.int32), spec((rows,), jnp.int32),
                               spec((rows,), jnp.int32), spec((rows, 6), jnp.int32))
        sm = SamplingMetadata(spec((rows,), jnp.float32), spec((rows,), jnp.int32),
                              spec((rows,), jnp.float32), spec((rows,), jnp.uint32),
                              spec((rows,), jnp.int32), spec((rows,), jnp.bool_))
        carry = spec((4,), jnp.int32)
        if chunk == 1:
            lowered = fns.decode.lower(weights, kv, spec((rows, PAGES + 6), jnp.int32), carry,
                                       carry, steps=1)
        else:
            lowered = fns.prefill.lower(weights, kv, spec((rows, chunk), jnp.int32), md, sm,
                                        carry, spec((rows,), jnp.int32))
        lines = lowered.compile().as_text().splitlines()
        assert any(pool in line for line in lines)  # the pool's shape as XLA writes it
        copies = [line for line in lines if pool in line and " copy(" in line]
        assert not copies, copies[:3]


def test_scan_layers_is_the_backends_choice_unless_set(tmp_path):
    """None: scanned, except with the CPU's matmul kernels (faster unrolled); an explicit
    value wins; anything else is a ValueError naming the option."""
    base = dict(max_num_seqs=2, num_pages=40, page_size=8, enable_prompt_logprobs=False,
                prefill_chunk_sizes=(16,), max_num_batched_tokens=16)
    assert not LLM(MODEL, **base).engine.runner.scan_layers  # the CPU kernels
    assert LLM(MODEL, matmul_impl="xla", **base).engine.runner.scan_layers
    assert LLM(MODEL, scan_layers=True, **base).engine.runner.scan_layers
    with pytest.raises(ValueError, match="scan_layers must be true, false or None"):
        LLM(MODEL, scan_layers="yes", **base)
