"""On-device sampling, vectorised per row: greedy, temperature, top-k, top-p, per-request seeds.

The result is one packed int32 array per step, so the host reads it with a single copy:

    packed[b] = [token, logprob bits, rank, top ids (K), top logprob bits (K)]

Logprobs are of the model's raw distribution (before temperature/top-k/top-p), as vLLM reports.
A step where no row asked for logprobs skips them (the log-softmax, the rank and the top-k over
the vocabulary: about 2 ms of a 64-row CPU step) and packs zeros the host never reads.

The controls some requests ask for (vLLM's definitions and order) run only in a call holding
such a row (`sample(..., controls, state)`, the runner's controlled head); a plain call never
sees them. In order:

    allowed-token bitmask (structured output, allowed_token_ids, bad_words, min_tokens; made on
        the host) -> logit_bias -> repetition, frequency and presence penalties -> greedy argmax,
        or temperature -> min_p -> top-k -> top-p -> a draw

Each is exactly the identity for a row that does not ask (a bias of 0, a penalty of 0 or 1, a
bitmask of ones, min_p 0), so a plain row in a controlled call samples as in a plain one. The
penalties read per-slot token counts kept on the device (`SamplerState`), which the call
updates with the tokens it samples.
"""

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [B] float32   0: greedy
    top_k: jax.Array  # [B] int32   vocab_size when off
    top_p: jax.Array  # [B] float32   1.0 when off
    seeds: jax.Array  # [B] uint32   per request; the key is fold_in(key(seed), position)
    positions: jax.Array  # [B] int32   position of the token being sampled
    logprobs: jax.Array  # [B] bool   the row's request asked for logprobs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Controls:
    """A controlled call's per-row controls (padding rows: slot 0, every control off)."""

    slots: jax.Array  # [B] int32   the row's slot in SamplerState
    presence: jax.Array  # [B] float32   presence_penalty
    frequency: jax.Array  # [B] float32   frequency_penalty
    repetition: jax.Array  # [B] float32   repetition_penalty (1.0: off)
    min_p: jax.Array  # [B] float32
    counted: jax.Array  # [B] bool   the row samples a token its slot's counts keep
    # [B] bool   its request is controlled, so it wrote its slot's state (a plain request's
    # slot still holds the bias of the controlled one before it)
    owns_state: jax.Array
    bitmask: jax.Array  # [B, ceil(V / 32)] int32   bit t % 32 of word t // 32: token t allowed


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerState:
    """Per slot, on the device: what the penalties and logit_bias of its request need. A slot's
    rows are written when a controlled request takes it; the calls keep `counts` current."""

    counts: jax.Array  # [S, V] int32   each token's count in the request's output
    prompt: jax.Array  # [S, V] bool   the token is in the prompt
    bias_ids: jax.Array  # [S, L] int32   logit_bias's tokens (padding: token 0 ...)
    bias_values: jax.Array  # [S, L] float32   ... with a bias of 0


def allowed_mask(bitmask: jax.Array, vocab: int) -> jax.Array:  # [B, W] -> [B, V] bool
    ids = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(bitmask, ids // 32, axis=1)
    return (jax.lax.shift_right_logical(words, jnp.broadcast_to(ids % 32, words.shape))
            & 1).astype(bool)


def apply_controls(logits: jax.Array, c: Controls, state: SamplerState) -> jax.Array:
    """The logits a controlled call samples from (before temperature): masked, biased and
    penalised, each as vLLM defines it."""
    b, vocab = logits.shape
    logits = jax.lax.cond(
        jnp.all(c.bitmask == -1), lambda logits: logits,
        lambda logits: jnp.where(allowed_mask(c.bitmask, vocab), logits, -jnp.inf), logits)
    values = jnp.where(c.owns_state[:, None], state.bias_values[c.slots], 0.0)  # [B, L]
    logits = jax.lax.cond(
        jnp.any(values != 0), lambda logits: logits.at[
            jnp.arange(b)[:, None], state.bias_ids[c.slots]].add(values),
        lambda logits: logits, logits)

    def penalise(logits):
        counts = state.counts[c.slots]  # [B, V]
        seen = counts > 0
        repetition = jnp.where(state.prompt[c.slots] | seen, c.repetition[:, None], 1.0)
        logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
        return (logits - c.frequency[:, None] * counts.astype(jnp.float32)
                - c.presence[:, None] * seen.astype(jnp.float32))

    return jax.lax.cond(
        jnp.any((c.presence != 0) | (c.frequency != 0) | (c.repetition != 1)),
        penalise, lambda logits: logits, logits)


def packed_width(num_top: int) -> int:
    return 3 + 2 * num_top


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def token_logprobs(logprobs: jax.Array, tokens: jax.Array, num_top: int) -> jax.Array:
    """logprobs [N, V], tokens [N] -> [N, 2 + 2K] int32: logprob bits, rank, top ids, top bits."""
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)  # [N, 1]
    rank = 1 + jnp.sum(logprobs > chosen, axis=1, dtype=jnp.int32)
    parts = [_bits(chosen), rank[:, None]]
    if num_top:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_top)
        parts += [top_ids.astype(jnp.int32), _bits(top_lp)]
    return jnp.concatenate(parts, axis=1)


def _filtered(logits: jax.Array, sm: SamplingMetadata, ops,
              min_p: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The distribution a sampled row draws from, sorted: (order [B, V], the token ids most
    likely first; masked [B, V], their logits after temperature, top-k, min_p and top-p, -inf
    where cut)."""
    vocab = logits.shape[-1]
    temperature = jnp.where(sm.temperature > 0, sm.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] token ids, most likely first
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    # top-k keeps every token as likely as the k-th (a tie at the cut stays in, as vLLM's)
    kth = jnp.take_along_axis(ranked, jnp.clip(sm.top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    keep = ranked >= kth
    if min_p is not None:  # p >= min_p * p_max, as logits: l >= l_max + log(min_p)
        keep &= ranked >= ranked[:, :1] + jnp.log(min_p)[:, None]
    probs = ops.softmax(jnp.where(keep, ranked, -jnp.inf))
    # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < sm.top_p[:, None]
    return order, jnp.where(keep, ranked, -jnp.inf)


def _keys(sm: SamplingMetadata) -> jax.Array:  # [B] keys: fold_in(key(seed), position)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(sm.seeds, sm.positions)


def _draw(order: jax.Array, masked: jax.Array, keys: jax.Array) -> jax.Array:  # [B] int32
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sample_random(logits: jax.Array, sm: SamplingMetadata, ops,
                   min_p: jax.Array | None = None) -> jax.Array:  # [B]
    order, masked = _filtered(logits, sm, ops, min_p)
    return _draw(order, masked, _keys(sm))


def first_argmax(logits: jax.Array) -> jax.Array:  # [B, V] -> [B] int32
    """jnp.argmax over the last axis (the first of tied maxima) as two plain reductions: XLA on
    the CPU runs argmax's paired value-index reduction about 4x slower (64 x 8192: 1.1 ms
    against 0.3 ms a step). A row holding NaN gives the last id."""
    vocab = logits.shape[-1]
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    best = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(logits == best, ids, vocab), axis=-1), vocab - 1)


def sharded_greedy(local: jax.Array, axis: str, num_top: int) -> jax.Array:
    """Greedy rows' packed samples from logits split by vocabulary over the mesh axis `axis`
    (local [B, V / shards], this shard's part), with no logits gathered: each shard's maximum
    and its first id are ([shards, B]), and the first shard holding the largest maximum gives
    the token, as first_argmax over the whole vocabulary would (a row with NaN: the last id).
    The logprob fields are zeros, as `sample`'s for rows that did not ask for them."""
    width = local.shape[-1]
    ids = first_argmax(local) + jax.lax.axis_index(axis) * width
    maxima = jax.lax.all_gather(jnp.max(local, axis=-1), axis)  # [shards, B]
    ids = jax.lax.all_gather(ids, axis)  # [shards, B]
    shard = first_argmax(maxima.T)
    tokens = jnp.take_along_axis(ids.T, shard[:, None], axis=1)[:, 0]
    tokens = jnp.where(jnp.isnan(maxima).any(axis=0), width * maxima.shape[0] - 1, tokens)
    zeros = jnp.zeros((tokens.shape[0], packed_width(num_top) - 1), jnp.int32)
    return jnp.concatenate([tokens[:, None], zeros], axis=1)


def sample(logits: jax.Array, sm: SamplingMetadata, num_top: int, ops,
           controls: Controls | None = None, state: SamplerState | None = None):
    """logits [B, V] float32 -> packed [B, 3 + 2 * num_top] int32 (see module docstring); `ops`
    (the backend's) sums the softmaxes: batch invariantly on the CPU backend. With `controls`
    (a controlled call) -> (packed, the state with the sampled tokens counted)."""
    processed = logits if controls is None else apply_controls(logits, controls, state)
    min_p = None if controls is None else controls.min_p
    greedy = first_argmax(processed)
    tokens = jax.lax.cond(
        jnp.all(sm.temperature == 0),
        lambda: greedy,
        lambda: jnp.where(sm.temperature == 0, greedy,
                          _sample_random(processed, sm, ops, min_p)),
    )
    stats = jax.lax.cond(
        jnp.any(sm.logprobs),
        lambda: token_logprobs(ops.log_softmax(logits), tokens, num_top),
        lambda: jnp.zeros((tokens.shape[0], packed_width(num_top) - 1), jnp.int32),
    )
    packed = jnp.concatenate([tokens[:, None], stats], axis=1)
    if controls is None:
        return packed
    counts = state.counts.at[controls.slots, tokens].add(controls.counted.astype(jnp.int32))
    return packed, replace(state, counts=counts)


def _accepts(uniform: jax.Array, p_draft: jax.Array, q_draft: jax.Array) -> jax.Array:
    """Rejection sampling's test: keep a proposal d drawn from q with probability
    min(1, p(d) / q(d))."""
    return uniform * q_draft < p_draft


def draft_sample(logits: jax.Array, sm: SamplingMetadata, ops) -> tuple[jax.Array, jax.Array]:
    """A draft model's proposal: logits [B, V] -> (token [B], q [B, V], the distribution it was
    drawn from: the row's own filtering of the draft's logits; zeros for a greedy row, which
    proposes its argmax). Its draws fold 2 into the row's key: apart from the target's."""
    greedy = first_argmax(logits)

    def random_rows():
        order, masked = _filtered(logits, sm, ops)
        keys = jax.vmap(lambda key: jax.random.fold_in(key, 2))(_keys(sm))
        q = jnp.zeros(logits.shape, jnp.float32).at[
            jnp.arange(logits.shape[0])[:, None], order].set(ops.softmax(masked))
        return _draw(order, masked, keys), q

    drawn, q = jax.lax.cond(jnp.all(sm.temperature == 0),
                            lambda: (greedy, jnp.zeros(logits.shape, jnp.float32)), random_rows)
    return jnp.where(sm.temperature == 0, greedy, drawn), q


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, sm: SamplingMetadata,
           num_top: int, ops, draft_probs: jax.Array | None = None) -> jax.Array:
    """Speculative decoding's verification: a row's tokens and the logits after each.

    logits [B, K + 1, V]: after the row's newest token and each of its K proposed tokens
    drafts [B, K] int32: the proposals, the first num_drafts [B] of each row real
    sm: the rows' sampling arrays, `positions` the first sampled token's
    draft_probs [B, K, V] | None: the distribution q each proposal was drawn from (a draft
        model's); None: proposals of probability one (prompt lookup)
    -> packed [B, K + 1, W] (as `sample`'s), the row's tokens in order, then token -1

    A greedy row keeps each proposal that is its argmax and then its own argmax. A sampled row
    keeps proposal d with probability min(1, p(d) / q(d)), p its filtered distribution there
    (top-k, top-p, temperature); where it refuses one it draws from max(p - q, 0),
    renormalised (for q of probability one: p without d), and past the last proposal from p:
    each token comes out with exactly its probability under p (Leviathan et al. 2023, Chen et
    al. 2023). The uniforms and draws
    of position q use the request's seed folded with q, whatever the batch; the token past the
    last proposal is the very one a plain step would draw there.
    """
    b, width, vocab = logits.shape
    flat = logits.reshape(b * width, vocab)

    def per_position(x):  # [B] -> [B * (K + 1)]
        return jnp.repeat(x, width)

    offsets = jnp.tile(jnp.arange(width, dtype=jnp.int32), b)
    fsm = SamplingMetadata(temperature=per_position(sm.temperature), top_k=per_position(sm.top_k),
                           top_p=per_position(sm.top_p), seeds=per_position(sm.seeds),
                           positions=per_position(sm.positions) + offsets,
                           logprobs=per_position(sm.logprobs))
    draft = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1).reshape(-1)
    has_draft = offsets < per_position(num_drafts)
    greedy = first_argmax(flat)

    def random_rows():
        order, masked = _filtered(flat, fsm, ops)
        is_draft = order == draft[:, None]
        p = ops.softmax(masked)
        p_draft = jnp.sum(jnp.where(is_draft, p, 0.0), axis=-1)
        keys = _keys(fsm)
        uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys)
        if draft_probs is None:  # q(d) = 1: refused, the draw leaves d out (a row whose p(d)
            # is 1 never refuses it)
            residual = jnp.where(has_draft[:, None] & is_draft & (p_draft < 1)[:, None],
                                 -jnp.inf, masked)
            return _accepts(uniform, p_draft, 1.0), _draw(order, residual, keys)
        q = jnp.concatenate([draft_probs, jnp.zeros((b, 1, vocab), draft_probs.dtype)],
                            axis=1).reshape(b * width, vocab)
        q = jnp.take_along_axis(q, order, axis=-1)  # sorted as p
        q_draft = jnp.sum(jnp.where(is_draft, q, 0.0), axis=-1)
        # refused: a draw from max(p - q, 0); where p <= q everywhere the row never refuses
        excess = jnp.maximum(p - q, 0.0)
        residual = jnp.where(has_draft[:, None] & jnp.any(excess > 0, axis=-1, keepdims=True),
                             jnp.log(excess), masked)
        return _accepts(uniform, p_draft, q_draft), _draw(order, residual, keys)

    accept_random, drawn = jax.lax.cond(
        jnp.all(sm.temperature == 0),
        lambda: (jnp.zeros_like(has_draft), greedy),
        random_rows)
    is_greedy = fsm.temperature == 0
    accept = has_draft & jnp.where(is_greedy, greedy == draft, accept_random)
    own = jnp.where(is_greedy, greedy, drawn)  # [B * (K + 1)]: the token where it stops
    kept = jnp.sum(jnp.cumprod(accept.reshape(b, width).astype(jnp.int32), axis=1), axis=1)
    j = jnp.arange(width)[None]
    tokens = jnp.where(j < kept[:, None], draft.reshape(b, width),
                       jnp.where(j == kept[:, None], own.reshape(b, width), -1))  # [B, K + 1]
    flat_tokens = tokens.reshape(-1)
    stats = jax.lax.cond(
        jnp.any(sm.logprobs),
        lambda: token_logprobs(ops.log_softmax(flat), jnp.maximum(flat_tokens, 0), num_top),
        lambda: jnp.zeros((b * width, packed_width(num_top) - 1), jnp.int32))
    return jnp.concatenate([flat_tokens[:, None], stats], axis=1).reshape(b, width, -1)
