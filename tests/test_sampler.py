"""On-device sampling: greedy, temperature, top-k, top-p, seeds, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends import Ops
from jaxserve.model.sampler import SamplingMetadata, first_argmax, sample

VOCAB, ROWS, TOP = 16, 512, 4
_sample = jax.jit(lambda logits, sm, num_top: sample(logits, sm, num_top, Ops()),
                  static_argnums=2)


def _meta(temperature=1.0, top_k=VOCAB, top_p=1.0, seeds=None, positions=None, logprobs=True):
    rows = ROWS
    return SamplingMetadata(
        temperature=jnp.full((rows,), temperature, jnp.float32),
        top_k=jnp.full((rows,), top_k, jnp.int32),
        top_p=jnp.full((rows,), top_p, jnp.float32),
        seeds=jnp.arange(rows, dtype=jnp.uint32) if seeds is None else seeds,
        positions=jnp.zeros((rows,), jnp.int32) if positions is None else positions,
        logprobs=jnp.full((rows,), logprobs),
    )


@pytest.fixture(scope="module")
def logits():
    row = jax.random.normal(jax.random.key(0), (VOCAB,)) * 2
    return jnp.tile(row, (ROWS, 1))


def _tokens(packed):
    return np.asarray(packed[:, 0])


def test_greedy_and_its_logprobs(logits):
    packed = np.asarray(_sample(logits, _meta(temperature=0.0), TOP))
    want = int(np.argmax(logits[0]))
    assert (packed[:, 0] == want).all()
    lp = packed[:, 1].view(np.float32)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits[0])[want], rtol=1e-6)
    assert (packed[:, 2] == 1).all()  # rank
    top_ids = packed[0, 3:3 + TOP]
    np.testing.assert_array_equal(top_ids, np.argsort(-np.asarray(logits[0]))[:TOP])


def test_first_argmax_is_numpys():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    x[0, [5, 700]] = 9.0  # a tie: the first id wins, as np.argmax's
    x[1, :] = -np.inf
    x[1, 3] = -1e30
    x[2, :] = 0.0
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[0] == 5 and got[1] == 3 and got[2] == 0


def test_logprobs_only_when_a_row_asks(logits):
    """A step where no row asked for logprobs skips them (zeros the host never reads) and
    samples the same tokens; one asking row brings back every row's logprobs."""
    with_lp = np.asarray(_sample(logits, _meta(seeds=jnp.full((ROWS,), 7, jnp.uint32)), TOP))
    without = np.asarray(_sample(logits, _meta(seeds=jnp.full((ROWS,), 7, jnp.uint32),
                                               logprobs=False), TOP))
    np.testing.assert_array_equal(without[:, 0], with_lp[:, 0])
    assert (without[:, 1:] == 0).all()
    meta = _meta(seeds=jnp.full((ROWS,), 7, jnp.uint32))
    one = SamplingMetadata(meta.temperature, meta.top_k, meta.top_p, meta.seeds, meta.positions,
                           jnp.arange(ROWS) == 3)
    np.testing.assert_array_equal(np.asarray(_sample(logits, one, TOP)), with_lp)


def test_temperature_sampling_follows_the_distribution(logits):
    tokens = _tokens(_sample(logits, _meta(), TOP))
    freq = np.bincount(tokens, minlength=VOCAB) / ROWS
    probs = np.asarray(jax.nn.softmax(logits[0]))
    assert np.abs(freq - probs).max() < 0.08
    assert len(set(tokens.tolist())) > 3


def test_top_k_and_top_p_restrict_the_support(logits):
    order = np.argsort(-np.asarray(logits[0]))
    assert set(_tokens(_sample(logits, _meta(top_k=2), TOP))) <= set(order[:2].tolist())
    assert set(_tokens(_sample(logits, _meta(top_k=1), TOP))) == {int(order[0])}
    probs = np.sort(np.asarray(jax.nn.softmax(logits[0])))[::-1]
    p = float(probs[0] + probs[1] / 2)  # needs exactly the top two tokens
    assert set(_tokens(_sample(logits, _meta(top_p=p), TOP))) == set(order[:2].tolist())
    assert set(_tokens(_sample(logits, _meta(top_p=1e-6), TOP))) == {int(order[0])}


def test_top_k_keeps_ties_at_its_cut_and_tiny_temperatures_are_greedy():
    """As vLLM's: top_k 2 over [3, 1, 1, 0] samples from the three tokens as likely as the
    second (it kept exactly two, dropping the tie by id), and a temperature under 1e-5 is
    greedy (ties to the lowest id), not a coin flip between tied logits."""
    tied = jnp.tile(jnp.array([3.0, 1.0, 1.0, 0.0] + [-30.0] * (VOCAB - 4)), (ROWS, 1))
    tokens = _tokens(_sample(tied, _meta(top_k=2), TOP))
    assert set(tokens.tolist()) == {0, 1, 2}
    from jaxserve.request import SamplingParams

    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


def test_64_bit_seeds_reach_the_device_distinct():
    from jaxserve.runner.input_batch import device_seed

    assert [device_seed(s) for s in (5, 2**32 - 1)] == [5, 2**32 - 1]  # 32-bit seeds as they are
    assert len({device_seed(s) for s in (5, 5 + 2**32, 5 + 2**33, 2**63)}) == 4


def test_seeds_make_sampling_reproducible_and_independent_of_the_row(logits):
    same_seed = jnp.full((ROWS,), 7, jnp.uint32)
    positions = jnp.arange(ROWS, dtype=jnp.int32) % 8
    a = _tokens(_sample(logits, _meta(seeds=same_seed, positions=positions), TOP))
    b = _tokens(_sample(logits, _meta(seeds=same_seed, positions=positions), TOP))
    np.testing.assert_array_equal(a, b)
    # the same (seed, position) gives the same token in any row
    for pos in range(8):
        assert len(set(a[np.asarray(positions) == pos].tolist())) == 1
    assert len(set(a[:8].tolist())) > 1  # different positions draw differently


def test_greedy_rows_mixed_with_sampled_rows(logits):
    temperature = jnp.where(jnp.arange(ROWS) % 2 == 0, 0.0, 1.0)
    meta = _meta()
    meta = SamplingMetadata(temperature, meta.top_k, meta.top_p, meta.seeds, meta.positions,
                            meta.logprobs)
    tokens = _tokens(_sample(logits, meta, TOP))
    assert (tokens[::2] == int(np.argmax(logits[0]))).all()
    assert len(set(tokens[1::2].tolist())) > 1
