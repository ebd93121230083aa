"""The device step as pure functions of (weights, KV pages, step arrays).

`make_step_fns` closes over the static parts (graph, backend, top-logprob count, carry size) and returns jitted functions with the KV cache donated: callers rebind the
returned cache.

Every function also returns `next_tokens [M]`, the last token each row sampled (padded to the
largest row bucket M). The next decode step takes the previous iteration's two carries and
gathers its input tokens from them on the device, so the host never waits for a token before
dispatching the step that consumes it:

    carries = [decode carry | prefill carry]   [2M]
    tokens[b] = carries[src[b]] if src[b] >= 0 else host_tokens[b]

An iteration may run several prefill calls (rows of similar chunk length together): each writes
its rows' tokens into the prefill carry it is given, at `carry_index[b]` (M drops a padding row).

A ragged call (the cpu and tpu attention) is two: `ragged` runs the model over T packed tokens,
prompt chunks and decode rows alike, and gathers each row's last hidden state ([M, hidden]: its
metadata has M rows whatever the call holds); `ragged_head` samples the first B of them. Compiled shapes: one per
token bucket plus one per row bucket, where one function would need every pair.

A call holding a row with sampler controls (penalties, logit_bias, min_p, structured output,
...) is split the same way: `decode_hidden`, `prefill_hidden` (or `ragged`, or the prompt
logprobs call, which returns its rows' last hidden states too) run the model, and `head`
samples with the controls once the host has the rows' token masks (made from the previous
iteration's tokens, while the device runs the model). Plain calls never pay for them.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.model.decode_rows import (
    HOST_TOKEN,
    LOGPROBS,
    LORA,
    PAGES,
    QUERY_LEN,
    SEED,
    SRC,
    START,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)
from jaxserve.model.kv_cache import AttentionMetadata, KVCache, RaggedMetadata
from jaxserve.model.sampler import (
    Controls,
    SamplerState,
    SamplingMetadata,
    draft_sample,
    sample,
    sharded_greedy,
    token_logprobs,
    verify,
)


@dataclass(frozen=True)
class StepFns:
    # (weights, kv, tokens [B, C], md, sm, carry [M], carry_index [B]) -> (packed [B, W],
    #   carry [M], kv)
    prefill: Callable
    # (weights, kv, tokens [B, C], md, sm, carry, carry_index, targets [B, C])
    #   -> (packed, prompt [B, C, W-1], carry, last [M, hidden], kv)
    prefill_with_prompt_logprobs: Callable
    # (weights, kv, rows [B, PAGES + pages_per_seq]: decode_rows.py's columns, carry0 [M],
    #   carry1 [M], steps) -> (packed [steps, B, W], next_tokens [M], kv)
    decode: Callable
    # (weights, kv, host_tokens [1, T], src [T], carry0 [M], carry1 [M], md: RaggedMetadata of
    #   M rows) -> (last [M, hidden]: each row's last token's hidden state, kv)
    ragged: Callable
    # (weights, last [M, hidden], sm [B], carry [M], carry_index [B], rows=B)
    #   -> (packed [B, W], carry [M])
    ragged_head: Callable
    # the model without its head: (weights, kv, host_tokens, src, carry0, carry1, md)
    #   -> (last [M, hidden], kv); (weights, kv, tokens [B, C], md) -> (last [M, hidden], kv)
    decode_hidden: Callable
    prefill_hidden: Callable
    # (weights, last [M, hidden], sm [B], controls [B], state, carry [M], carry_index [B],
    #   rows=B) -> (packed [B, W], carry [M], state)
    head: Callable
    # (state, slot, counts [V], prompt [V], bias_ids [L], bias_values [L]) -> state
    write_slot: Callable
    # speculative decoding's verification: (weights, kv, first [B], drafts [B, K],
    #   num_drafts [B], md, sm, draft_probs [B, K, V] | None) -> (packed [B, K + 1, W]: each
    #   row's kept tokens, then -1; kv). A row feeds its newest token, then its drafts
    verify: Callable
    # a draft model's proposals: (weights, kv, tokens [B, 2], md: a chunk of the row's
    #   unfed tokens (1 or 2, the newest last), sm: positions the first proposal's, steps=K)
    #   -> (drafts [B, K], q [B, K, V], kv). Feeds every draft it makes
    draft: Callable


def unpack_decode_rows(rows: jax.Array):
    """A decode call's rows [B, PAGES + P] (decode_rows.py) as (host_tokens [B], src [B], md,
    sm): each row one token at position START, sampled at START + QUERY_LEN."""
    def bits(column, dtype):
        return jax.lax.bitcast_convert_type(rows[:, column], dtype)

    start, query_lens = rows[:, START], rows[:, QUERY_LEN]
    seq_lens = start + query_lens
    md = AttentionMetadata(positions=start[:, None], query_lens=query_lens, seq_lens=seq_lens,
                           page_table=rows[:, PAGES:], lora_slots=rows[:, LORA])
    sm = SamplingMetadata(temperature=bits(TEMPERATURE, jnp.float32), top_k=rows[:, TOP_K],
                          top_p=bits(TOP_P, jnp.float32), seeds=bits(SEED, jnp.uint32),
                          positions=seq_lens, logprobs=rows[:, LOGPROBS] != 0)
    return rows[:, HOST_TOKEN], rows[:, SRC], md, sm


def pack_decode_rows(host_tokens, src, md: AttentionMetadata,
                     sm: SamplingMetadata) -> np.ndarray:
    """The host's side of unpack_decode_rows, from a decode call's arrays (numpy; md of one
    token a row, its positions seq_lens - query_lens, sm sampling at seq_lens)."""
    page_table = np.asarray(md.page_table, np.int32)
    rows = np.zeros((page_table.shape[0], PAGES + page_table.shape[1]), np.int32)
    rows[:, HOST_TOKEN], rows[:, SRC] = host_tokens, src
    rows[:, START], rows[:, QUERY_LEN] = np.asarray(md.positions)[:, 0], md.query_lens
    rows[:, TEMPERATURE] = np.asarray(sm.temperature, np.float32).view(np.int32)
    rows[:, TOP_K] = sm.top_k
    rows[:, TOP_P] = np.asarray(sm.top_p, np.float32).view(np.int32)
    rows[:, SEED] = np.asarray(sm.seeds, np.uint32).view(np.int32)
    rows[:, LOGPROBS] = sm.logprobs
    if md.lora_slots is not None:
        rows[:, LORA] = md.lora_slots
    rows[:, PAGES:] = page_table
    return rows


def make_step_fns(graphdef: nnx.GraphDef, state_treedef, backend, num_top: int,
                  carry_size: int, shards=None) -> StepFns:
    """The functions take `weights` as (the state's flat list of arrays, rope_tables' cos and
    sin); `state_treedef` rebuilds the state from the list: flattening NNX variables on every
    call would cost the host a millisecond per step. `shards` (jaxserve/parallel/sharding.py): the
    model runs per shard of its mesh under shard_map, the weights and the KV pool split as
    its specs say, every other array whole on each shard."""
    def pad(tokens):  # [B] -> [M]
        return jnp.zeros((carry_size,), jnp.int32).at[:tokens.shape[0]].set(tokens)

    def pad_rows(h):  # [B, hidden] -> [M, hidden]: one head shape per row bucket
        return jnp.zeros((carry_size, h.shape[-1]), h.dtype).at[:h.shape[0]].set(h)

    def merge(weights):
        leaves, rope = weights
        return nnx.merge(graphdef, jax.tree.unflatten(state_treedef, leaves)), rope

    def sample_plain(model, h, sm):
        """A plain call's sampling. On a mesh, a call whose rows are all greedy and want no
        logprobs takes each row's token from the shards' maxima: no logits gathered."""
        if backend.model_axis is None:
            return sample(model.logits(h, backend), sm, num_top, backend.ops)
        local = model.local_logits(h, backend)
        return jax.lax.cond(
            jnp.all(sm.temperature == 0) & ~jnp.any(sm.logprobs),
            lambda: sharded_greedy(local, backend.model_axis, num_top),
            lambda: sample(backend.gather_vocab(local), sm, num_top, backend.ops))

    def chunk_hidden(weights, kv: KVCache, tokens, md: AttentionMetadata):
        model, rope = merge(weights)
        hidden, kv = model(tokens, kv, md, backend, rope)
        last = jnp.maximum(md.query_lens - 1, 0)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, hidden]
        return model, hidden, h, kv

    def prefill(weights, kv, tokens, md, sm, carry, carry_index):
        model, _, h, kv = chunk_hidden(weights, kv, tokens, md)
        packed = sample_plain(model, h, sm)
        return packed, carry.at[carry_index].set(packed[:, 0], mode="drop"), kv

    def prefill_hidden(weights, kv, tokens, md):
        _, _, h, kv = chunk_hidden(weights, kv, tokens, md)
        return pad_rows(h), kv

    def prefill_with_prompt_logprobs(weights, kv, tokens, md, sm, carry, carry_index, targets):
        model, hidden, h, kv = chunk_hidden(weights, kv, tokens, md)
        packed = sample(model.logits(h, backend), sm, num_top, backend.ops)
        b, c = tokens.shape
        logits = model.logits(hidden, backend)
        logprobs = backend.ops.log_softmax(logits).reshape(b * c, -1)
        prompt = token_logprobs(logprobs, targets.reshape(-1), num_top).reshape(b, c, -1)
        return (packed, prompt, carry.at[carry_index].set(packed[:, 0], mode="drop"), pad_rows(h),
                kv)

    def decode_tokens(host_tokens, src, carry0, carry1):
        carries = jnp.concatenate([carry0, carry1])
        return jnp.where(src >= 0, carries[jnp.maximum(src, 0)], host_tokens)

    def decode_hidden(weights, kv, host_tokens, src, carry0, carry1, md):
        model, rope = merge(weights)
        tokens = decode_tokens(host_tokens, src, carry0, carry1)
        hidden, kv = model(tokens[:, None], kv, md, backend, rope)
        return pad_rows(hidden[:, 0]), kv

    def head(weights, last, sm, controls: Controls, state, carry, carry_index, rows):
        model, _ = merge(weights)
        packed, state = sample(model.logits(last[:rows], backend), sm, num_top, backend.ops,
                               controls, state)
        return packed, carry.at[carry_index].set(packed[:, 0], mode="drop"), state

    def write_slot(state: SamplerState, slot, counts, prompt, bias_ids, bias_values):
        return SamplerState(counts=state.counts.at[slot].set(counts),
                            prompt=state.prompt.at[slot].set(prompt),
                            bias_ids=state.bias_ids.at[slot].set(bias_ids),
                            bias_values=state.bias_values.at[slot].set(bias_values))

    def decode(weights, kv, rows, carry0, carry1, steps):
        host_tokens, src, md, sm = unpack_decode_rows(rows)
        tokens = decode_tokens(host_tokens, src, carry0, carry1)
        model, rope = merge(weights)

        def one_step(carry, _):
            tokens, kv, md, sm = carry
            hidden, kv = model(tokens[:, None], kv, md, backend, rope)
            packed = sample_plain(model, hidden[:, 0], sm)
            md = replace(md, positions=md.positions + 1, seq_lens=md.seq_lens + md.query_lens)
            sm = replace(sm, positions=sm.positions + 1)
            return (packed[:, 0], kv, md, sm), packed

        (last, kv, _, _), packed = jax.lax.scan(one_step, (tokens, kv, md, sm), None,
                                                length=steps)
        return packed, pad(last), kv

    def ragged(weights, kv, host_tokens, src, carry0, carry1, md: RaggedMetadata):
        carries = jnp.concatenate([carry0, carry1])
        tokens = jnp.where(src >= 0, carries[jnp.maximum(src, 0)], host_tokens[0])[None]
        model, rope = merge(weights)
        hidden, kv = model(tokens, kv, md, backend, rope)  # [1, T, hidden]
        return hidden[0, jnp.maximum(md.query_starts[1:] - 1, 0)], kv

    def ragged_head(weights, last, sm, carry, carry_index, rows):
        model, _ = merge(weights)
        packed = sample_plain(model, last[:rows], sm)
        return packed, carry.at[carry_index].set(packed[:, 0], mode="drop")

    def verify_step(weights, kv, first, drafts, num_drafts, md, sm, draft_probs):
        tokens = jnp.concatenate([first[:, None], drafts], axis=1)
        model, hidden, _, kv = chunk_hidden(weights, kv, tokens, md)
        return verify(model.logits(hidden, backend), drafts, num_drafts, sm, num_top,
                      backend.ops, draft_probs), kv

    def draft(weights, kv, tokens, md, sm, steps):
        model, _, h, kv = chunk_hidden(weights, kv, tokens, md)
        _, rope = merge(weights)
        seq_lens = md.seq_lens
        # then one token a step, from the position past the chunk's last
        md = replace(md, positions=seq_lens[:, None], query_lens=jnp.ones_like(seq_lens),
                     seq_lens=seq_lens + 1)

        def one_step(carry, j):
            h, kv, md = carry
            token, q = draft_sample(model.logits(h, backend),
                                    replace(sm, positions=sm.positions + j), backend.ops)
            # every proposal is fed, the last too (its K/V is kept if the row keeps it all);
            # a lax.cond around the last would copy the draft's KV pool every step
            hidden, kv = model(token[:, None], kv, md, backend, rope)
            md = replace(md, positions=md.positions + 1, seq_lens=md.seq_lens + 1)
            return (hidden[:, 0], kv, md), (token, q)

        (_, kv, _), (drafts, q) = jax.lax.scan(one_step, (h, kv, md), jnp.arange(steps))
        return drafts.T, q.transpose(1, 0, 2), kv

    def on_mesh(fn, args: str, outs: str):
        """fn per shard: `args` and `outs` spell where each positional argument and output
        lives, w the weights, k the KV cache, r whole on every shard."""
        if shards is None:
            return fn
        where = {"w": (shards.weights, (P(), P())), "k": shards.kv, "r": P()}

        @functools.wraps(fn)
        def run(*arrays, **static):
            out_specs = tuple(where[c] for c in outs)
            return jax.shard_map(functools.partial(fn, **static), mesh=shards.mesh,
                                 in_specs=tuple(where[c] for c in args),
                                 out_specs=out_specs if len(outs) > 1 else out_specs[0],
                                 check_vma=False)(*arrays)
        return run

    return StepFns(
        prefill=jax.jit(on_mesh(prefill, "wkrrrrr", "rrk"), donate_argnums=(1,)),
        prefill_with_prompt_logprobs=jax.jit(
            on_mesh(prefill_with_prompt_logprobs, "wkrrrrrr", "rrrrk"), donate_argnums=(1,)),
        decode=jax.jit(on_mesh(decode, "wkrrr", "rrk"), donate_argnums=(1,),
                       static_argnames=("steps",)),
        ragged=jax.jit(on_mesh(ragged, "wkrrrrr", "rk"), donate_argnums=(1,)),
        ragged_head=jax.jit(on_mesh(ragged_head, "wrrrr", "rr"), static_argnames=("rows",)),
        decode_hidden=jax.jit(on_mesh(decode_hidden, "wkrrrrr", "rk"), donate_argnums=(1,)),
        prefill_hidden=jax.jit(on_mesh(prefill_hidden, "wkrr", "rk"), donate_argnums=(1,)),
        head=jax.jit(on_mesh(head, "wrrrrrr", "rrr"), donate_argnums=(4,),
                     static_argnames=("rows",)),
        write_slot=jax.jit(write_slot, donate_argnums=(0,)),
        verify=jax.jit(on_mesh(verify_step, "wkrrrrrr", "rk"), donate_argnums=(1,)),
        draft=jax.jit(on_mesh(draft, "wkrrr", "rrk"), donate_argnums=(1,),
                      static_argnames=("steps",)),
    )
