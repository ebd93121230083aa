"""The device step as pure functions of (weights state, KV pages, step arrays).

`make_step_fns` closes over the static parts (graph, attention impl, top-logprob count) and
returns jitted functions with the KV cache donated: callers rebind the returned cache.
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.sampler import SamplingMetadata, sample, token_logprobs


@dataclass(frozen=True)
class StepFns:
    # (state, kv, tokens [B, C], md, sm) -> (packed [B, W], kv)
    step: Callable
    # (state, kv, tokens [B, C], md, sm, targets [B, C]) -> (packed [B, W], prompt [B, C, W-1], kv)
    step_with_prompt_logprobs: Callable


def make_step_fns(graphdef: nnx.GraphDef, attention_impl: str, num_top: int) -> StepFns:
    def forward(state, kv: KVCache, tokens, md: AttentionMetadata):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(tokens, kv, md, attention_impl)
        return model, hidden, kv

    def last_token_sample(model, hidden, md: AttentionMetadata, sm: SamplingMetadata):
        last = jnp.maximum(md.query_lens - 1, 0)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, hidden]
        return sample(model.logits(h), sm, num_top)

    def step(state, kv, tokens, md, sm):
        model, hidden, kv = forward(state, kv, tokens, md)
        return last_token_sample(model, hidden, md, sm), kv

    def step_with_prompt_logprobs(state, kv, tokens, md, sm, targets):
        model, hidden, kv = forward(state, kv, tokens, md)
        b, c = tokens.shape
        logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1).reshape(b * c, -1)
        prompt = token_logprobs(logprobs, targets.reshape(-1), num_top).reshape(b, c, -1)
        return last_token_sample(model, hidden, md, sm), prompt, kv

    return StepFns(
        step=jax.jit(step, donate_argnums=(1,)),
        step_with_prompt_logprobs=jax.jit(step_with_prompt_logprobs, donate_argnums=(1,)),
    )
