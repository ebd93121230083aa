"""The AMX matmul (cpu_kernels/cpu_amx.cc, matmul_impl="amx"): bf16x3 on AMX tiles. The
packing is checked everywhere; the kernel, where the CPU has AMX-BF16, against float64 numpy,
for batch invariance, and end to end on the real stories260K weights against the C reference."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_kernels import library as cpu_library
from cpu_kernels.matmul import AMX_BLOCK, amx_packable, matmul_cpu_amx, pack_amx
from jaxserve import LLM, SamplingParams
from jaxserve.backends import resolve_matmul_impl
from jaxserve.backends.cpu import CpuOps

# the kernel's own tests need AMX-BF16 hardware: elsewhere conftest.py deselects them (and says
# so at the end of the run); the packing and the refusal are checked everywhere
needs_amx = pytest.mark.needs_amx

# rows around the 16-row tile, the 32-row pair walk and the 128-row work item; columns around
# the 16-column block and the pair of blocks (an odd count leaves one block alone); k steps of 32
SHAPES = [(1, 32, 1), (5, 64, 15), (16, 32, 32), (17, 96, 33), (33, 128, 48), (130, 64, 200),
          (64, 512, 64), (300, 64, 40)]  # 300: three items of split rows, the last partial


def test_pack_amx_layout():
    k, n = 64, 20
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    packed = np.asarray(pack_amx(jnp.asarray(w)).astype(jnp.float32))
    assert packed.shape == (2, 2, k // 2, 2 * AMX_BLOCK)
    hi, lo = packed
    for b in range(2):
        for r in range(k // 2):
            for c in range(AMX_BLOCK):
                col = b * AMX_BLOCK + c
                want = w[2 * r:2 * r + 2, col] if col < n else np.zeros(2)
                got = hi[b, r, 2 * c:2 * c + 2] + lo[b, r, 2 * c:2 * c + 2]
                np.testing.assert_allclose(got, want, rtol=2 ** -16, atol=0)
    assert (hi[1, :, 2 * (n - AMX_BLOCK):] == 0).all()  # zero past N
    assert np.abs(hi + lo - hi).max() <= np.abs(hi).max() * 2 ** -8  # lo is the rounding rest


def test_amx_packable_and_bad_inputs():
    assert amx_packable(jnp.zeros((64, 3))) and not amx_packable(jnp.zeros((40, 3)))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        pack_amx(jnp.zeros((40, 3)))
    with pytest.raises(ValueError, match="K a multiple of 32, got bfloat16"):
        pack_amx(jnp.zeros((64, 3), jnp.bfloat16))
    packed = pack_amx(jnp.zeros((64, 20)))
    with pytest.raises(ValueError, match="expected \\[2, 3, K / 2, 32\\] for 40 columns"):
        matmul_cpu_amx(jnp.zeros((2, 64)), packed, 40)
    with pytest.raises(ValueError, match="takes 64 features"):
        matmul_cpu_amx(jnp.zeros((2, 32)), packed, 20)
    with pytest.raises(ValueError, match="takes float32 x"):
        matmul_cpu_amx(jnp.zeros((2, 64), jnp.bfloat16), packed, 20)


def test_amx_resolves_to_the_cpu_kernels_or_says_why_not(monkeypatch):
    monkeypatch.setattr(cpu_library, "amx_ready", lambda: True)
    assert resolve_matmul_impl("amx", "cpu", "float32") == "amx"
    with pytest.raises(ValueError, match="matmul_impl='amx' computes in float32"):
        resolve_matmul_impl("amx", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="matmul_impl='amx' runs on the CPU backend"):
        resolve_matmul_impl("amx", "gpu", "float32")
    monkeypatch.setattr(cpu_library, "amx_ready", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with AMX-BF16"):
        resolve_matmul_impl("amx", "cpu", "float32")


@needs_amx
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_amx_matmul_is_within_bf16x3_of_float64(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.jit(matmul_cpu_amx, static_argnums=2)(x, pack_amx(jnp.asarray(w)), n))
    # bf16x3 drops xl wl (2^-16 of each product) and rounds each part to 2^-17: the error is
    # bounded by sum |x||w| times a few 2^-16
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert (np.abs(got - want) <= 8 * 2.0 ** -16 * scale + 1e-30).all()


@needs_amx
def test_a_row_gives_the_same_bits_whatever_the_other_rows():
    rng = np.random.default_rng(7)
    k, n = 128, 80  # 5 blocks: two pairs and a lone block
    w = pack_amx(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
    rows = jnp.asarray(rng.standard_normal((161, k)), jnp.float32)
    call = jax.jit(matmul_cpu_amx, static_argnums=2)
    alone = np.stack([np.asarray(call(rows[i:i + 1], w, n))[0] for i in range(0, 161, 20)])
    for m in (33, 161):  # the 32-row walk and the 16-row one, across work items
        together = np.asarray(call(rows[:m], w, n))
        picked = [i for i in range(0, 161, 20) if i < m]
        assert (together[picked] == alone[:len(picked)]).all(), m
    shuffled = np.asarray(call(rows[::-1], w, n))[::-1]
    assert (shuffled == np.asarray(call(rows, w, n))).all()


@needs_amx
def test_pack_weights_for_amx_packs_what_it_can_and_linear_takes_both():
    wide = nnx.Linear(64, 40, use_bias=True, rngs=nnx.Rngs(0))  # k 64: AMX parts
    odd = nnx.Linear(40, 24, use_bias=False, rngs=nnx.Rngs(1))  # k 40: panels
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)), jnp.float32)
    want = (np.asarray(x) @ np.asarray(wide.kernel[...]) + np.asarray(wide.bias[...]))
    model = nnx.Sequential(wide, odd)
    ops = CpuOps(amx=True)
    graphdef, state = ops.pack_weights(*nnx.split(model))
    packed = nnx.merge(graphdef, state)
    assert packed.layers[0].kernel[...].ndim == 4 and packed.layers[1].kernel[...].ndim == 3
    y = ops.linear(packed.layers[0], x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    assert ops.linear(packed.layers[1], y[:, :40]).shape == (3, 24)


@needs_amx
def test_stories260k_greedy_ids_on_amx_match_the_c_reference(stories_dir):
    cases = json.loads((stories_dir / "reference_outputs.json").read_text())["cases"]
    llm = LLM(stories_dir, page_size=4, prefill_chunk_sizes=(8,), max_num_seqs=8,
              max_num_batched_tokens=32, num_pages=512, matmul_impl="amx")
    assert llm.engine.runner.matmul_impl == "amx"
    params = [SamplingParams(max_tokens=len(c["generated_ids"]), temperature=0.0, ignore_eos=True)
              for c in cases]
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params)
    for out, case in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == case["generated_ids"]
