"""The Llama-family decoder (Llama 2/3, Qwen2/3, Mistral, Phi-3, and with mixture-of-experts
MLPs Mixtral, Qwen2-MoE and Qwen3-MoE: model/moe.py) in Flax NNX over the paged KV cache.

Attribute names mirror Hugging Face's parameter names (model.layers.0.self_attn.q_proj ...), so
the loader maps a checkpoint mechanically (and splits Phi-3's fused qkv_proj and gate_up_proj).
Callers split graph and state once and jit pure functions of the state (see model/step.py).
`backend` (jaxserve/backends) does every matmul, row sum and attention call: the model names
no platform.

A loaded model holds its layers as a list, which the forward runs unrolled; `stack_layers`
turns them into one layer whose weights carry a leading layer axis, which it runs under
`jax.lax.scan`: one layer compiled, whatever the depth.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config.model import ModelConfig
from jaxserve.model.kv_cache import AttentionMetadata, KVCache, RaggedMetadata
from jaxserve.model.lora import LoraRows, adapted
from jaxserve.model.moe import SparseMoeBlock
from jaxserve.model.quant import (
    QuantizedEmbed,
    QuantizedLinear,
    embedding_rows,
    embedding_table,
)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:  # [rotary_dim // 2] float32
    """RoPE inverse frequencies, with linear, llama3, LongRoPE (short factors) or a GGUF's
    frequency factors, computed in float32 as HF does."""
    exponents = np.arange(0, cfg.rotary_dim, 2, dtype=np.float32) / np.float32(cfg.rotary_dim)
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "frequency_factors":  # a GGUF's rope_freqs, as llama.cpp divides
        factors = np.asarray(scaling.frequency_factors, np.float32)
        return (inv_freq / factors).astype(np.float32)
    if scaling.rope_type == "longrope":
        short = np.asarray(scaling.short_factor, np.float32)
        return (1.0 / (short * np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position's angles, [..., rotary_dim] each: the half-dimension
    frequencies repeated (HF's layout), times LongRoPE's attention factor, in float32 and then
    cast, as HF does."""
    freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scale = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_factor
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def rope_tables(cfg: ModelConfig, num_positions: int, dtype) -> tuple[jax.Array, jax.Array]:
    """rope_cos_sin of every position, [num_positions, rotary_dim] each: a step that reads
    them from these tables computes no cosine. Left to compute them, XLA on the CPU fuses cos
    and sin into every layer's rotation of q and k and recomputes them per head and layer:
    about a tenth of a prefill call's time."""
    return rope_cos_sin(cfg, jnp.arange(num_positions, dtype=jnp.int32), dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, C, heads, head_dim]; cos/sin: [B, C, rotary_dim]. HF's rotate-half convention
    over each head's first rotary_dim dims; the rest (Phi-3's partial_rotary_factor) pass."""
    rotary_dim = cos.shape[-1]
    half, turned = rotary_dim // 2, x[..., :rotary_dim]
    rotated = jnp.concatenate([-turned[..., half:], turned[..., :half]], axis=-1)
    out = turned * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out if rotary_dim == x.shape[-1] else jnp.concatenate([out, x[..., rotary_dim:]], -1)


class RMSNorm(nnx.Module):
    """`plus_one` (Gemma): the weight is stored as w - 1 (zeros at init) and the normalised
    row multiplied by 1 + w in float32 before the cast back, as transformers' Gemma norms."""

    def __init__(self, dim: int, eps: float, dtype, plus_one: bool = False):
        self.weight = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), dtype))
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x: jax.Array, backend) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(backend.ops.row_sum_squares(xf) / x.shape[-1] + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


def _linear(cfg_in: int, cfg_out: int, bias: bool, dtype, rngs: nnx.Rngs,
            cfg: ModelConfig | None = None) -> nnx.Linear | QuantizedLinear:
    if cfg is not None and cfg.quantization is not None:  # weights from the loader (quant.py)
        return QuantizedLinear(cfg_in, cfg_out, bias, dtype, cfg.quantization,
                               cfg.quantization_group_size, cfg.quantization_act_order,
                               cfg.quantization == "int4" and cfg.quantization_zero_points,
                               cfg.quantization_offsets,
                               # GGUF's blocks' scales are float16: held as stored
                               jnp.float16 if cfg.quantization_format == "gguf" else jnp.float32)
    return nnx.Linear(cfg_in, cfg_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


def _project(module, lora: LoraRows | None, backend, name: str, x: jax.Array) -> jax.Array:
    """The module's linear layer `name` applied to x, with its LoRA bank where it has one."""
    bank = None if module.lora is None else module.lora[name]
    return adapted(getattr(module, name), bank, x, lora, backend)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int = 0):
        e, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(e, cfg.num_heads * d, cfg.qkv_bias, dtype, rngs, cfg)
        self.k_proj = _linear(e, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs, cfg)
        self.v_proj = _linear(e, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs, cfg)
        self.o_proj = _linear(cfg.num_heads * d, e, cfg.o_bias, dtype, rngs, cfg)
        # Qwen3: each head's q and k RMS-normed over head_dim (one weight for all heads)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, cfg.gemma_norms) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, cfg.gemma_norms) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        # the layer's window (None: full attention), score soft cap and query scale
        self.sliding_window = cfg.window(layer)
        self.soft_cap = cfg.attn_logit_softcapping
        self.scale = (d if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar)**-0.5
        # a checkpoint's scales of an fp8 KV cache (vLLM's k_scale, v_scale): used with one
        self.k_scale = nnx.Param(jnp.ones((), jnp.float32)) if cfg.kv_cache_scales else None
        self.v_scale = nnx.Param(jnp.ones((), jnp.float32)) if cfg.kv_cache_scales else None
        self.lora = None  # LoRA's banks by module name, where enabled (model/lora.py)

    def __call__(self, x, cos, sin, kv: KVCache, md: AttentionMetadata | RaggedMetadata,
                 write_index, backend, lora: LoraRows | None = None):
        """md and write_index address this layer's pages of kv; `lora`: the step's tokens by
        adapter, where the model has LoRA banks."""
        b, c, _ = x.shape
        d = self.head_dim

        linear = functools.partial(_project, self, lora, backend)
        # -1 heads: under tensor parallelism a shard holds its own part of them
        q = linear("q_proj", x).reshape(b, c, -1, d)
        k = linear("k_proj", x).reshape(b, c, -1, d)
        if self.q_norm is not None:  # before RoPE, as transformers' Qwen3
            q, k = self.q_norm(q, backend), self.k_norm(k, backend)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = linear("v_proj", x)
        # an 8-bit pool with the checkpoint's scales: K and V stored divided by them, and read
        # back times them, which the kernels need not know: q times k_scale meets the stored
        # keys as q meets the keys, and the output is times v_scale (each row's weights over
        # the values sum to one)
        scaled = self.k_scale is not None and jnp.dtype(kv.pools[0].dtype).itemsize == 1
        if scaled:
            k_scale, v_scale = self.k_scale[...], self.v_scale[...]
            k, v = (k / k_scale).astype(k.dtype), (v / v_scale).astype(v.dtype)
            q = (q * k_scale).astype(q.dtype)
        kv = backend.attention.write(kv, k.reshape(b * c, -1, d), v.reshape(b * c, -1, d),
                                     write_index)
        out = backend.attention(q, kv, md, self.scale, self.sliding_window, self.soft_cap)
        if scaled:
            out = (out * v_scale).astype(out.dtype)
        return backend.sum_shards(linear("o_proj", out.reshape(b, c, -1))), kv


class MLP(nnx.Module):
    """SwiGLU; `intermediate_size`: another width than the config's (a shared expert's)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs,
                 intermediate_size: int | None = None):
        e = cfg.hidden_size
        i = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = _linear(e, i, False, dtype, rngs, cfg)
        self.up_proj = _linear(e, i, False, dtype, rngs, cfg)
        self.down_proj = _linear(i, e, False, dtype, rngs, cfg)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU
        self.lora = None  # LoRA's banks by module name, where enabled (model/lora.py)

    def __call__(self, x, backend, lora: LoraRows | None = None):
        return backend.sum_shards(self.partial(x, backend, lora))

    def partial(self, x, backend, lora: LoraRows | None = None):
        """The output before the shards' sum: under tensor parallelism, this shard's
        columns' share."""
        linear = functools.partial(_project, self, lora, backend)
        gate, up = linear("gate_proj", x), linear("up_proj", x)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return linear("down_proj", act * up)


class DecoderLayer(nnx.Module):
    """Pre-norm residual blocks; Gemma's also normalise each block's output (its
    post_attention_layernorm comes after attention, pre/post_feedforward_layernorm around the
    MLP), where the others' post_attention_layernorm is the MLP's input norm."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int = 0):
        e, eps, gemma = cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms
        self.input_layernorm = RMSNorm(e, eps, dtype, gemma)
        self.self_attn = Attention(cfg, dtype, rngs, layer)
        self.post_attention_layernorm = RMSNorm(e, eps, dtype, gemma)
        self.pre_feedforward_layernorm = RMSNorm(e, eps, dtype, gemma) if gemma else None
        self.post_feedforward_layernorm = RMSNorm(e, eps, dtype, gemma) if gemma else None
        self.mlp = SparseMoeBlock(cfg, dtype, rngs, MLP) if cfg.num_experts else MLP(cfg, dtype,
                                                                                     rngs)

    def __call__(self, x, cos, sin, kv, md, write_index, backend, lora=None):
        h, kv = self.self_attn(self.input_layernorm(x, backend), cos, sin, kv, md, write_index,
                               backend, lora)
        mlp = self.mlp if lora is None else functools.partial(self.mlp, lora=lora)
        if self.pre_feedforward_layernorm is None:
            x = x + h
            return x + mlp(self.post_attention_layernorm(x, backend), backend), kv
        x = x + self.post_attention_layernorm(h, backend)
        h = mlp(self.pre_feedforward_layernorm(x, backend), backend)
        return x + self.post_feedforward_layernorm(h, backend), kv


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02)) if (
            cfg.embedding_quantization is None) else QuantizedEmbed(
            cfg.vocab_size, cfg.hidden_size, dtype, cfg.embedding_quantization,
            cfg.quantization_group_size, cfg.embedding_offsets)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.gemma_norms)


class LlamaForCausalLM(nnx.Module):
    """tokens [B, C] + KV pages -> hidden states [B, C, hidden] and the updated pages. Every
    call takes `backend` (jaxserve/backends: its `ops` and `attention`), a static argument of
    the jitted steps."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Decoder(cfg, dtype, rngs)
        self.max_loras = 0  # LoRA's slots a layer (model/lora.py's attach_banks); 0: none
        self.lm_head = None if cfg.tie_word_embeddings else _linear(
            cfg.hidden_size, cfg.vocab_size, False, dtype, rngs
        )

    def __call__(self, tokens: jax.Array, kv: KVCache, md: AttentionMetadata | RaggedMetadata,
                 backend, rope: tuple[jax.Array, jax.Array] | None = None,
                 ) -> tuple[jax.Array, KVCache]:
        """`rope`: rope_tables' cos and sin (positions past them read the last row); without
        them the step computes its positions' cos and sin itself, to the same bits. A list of
        layers runs unrolled, stacked layers (`stack_layers`) under jax.lax.scan."""
        x = self.embed(tokens, backend)  # [B, C, hidden]
        if rope is None:
            cos, sin = rope_cos_sin(self.config, md.positions, x.dtype)  # [B, C, rotary_dim]
        else:
            cos, sin = (jnp.take(t, md.positions, axis=0, mode="clip").astype(x.dtype)
                        for t in rope)
        page, offset = md.write_index(kv.page_size)
        lora = None  # the step's tokens sorted by adapter, once for every layer
        if self.max_loras and md.lora_slots is not None:
            lora = LoraRows.of(md.token_lora_slots(), self.max_loras)
        local = None  # Gemma 3's sliding layers: RoPE of their own base
        if self.config.rope_local_theta is not None:
            local = rope_cos_sin(local_rope_config(self.config), md.positions, x.dtype)

        def run_layer(layer: DecoderLayer, x, kv: KVCache, index):
            first = index * kv.num_pages  # the layer's pages start at this pool row
            turn = (cos, sin) if local is None or layer.self_attn.sliding_window is None else local
            return layer(x, *turn, kv, md.layer_pages(first), (page + first, offset), backend,
                         lora)

        layers = self.model.layers
        if isinstance(layers, nnx.List):  # as loaded (and trained)
            for index, layer in enumerate(layers):
                x, kv = run_layer(layer, x, kv, index)
        else:
            graphdef, stacked = nnx.split(layers)
            num_layers = jax.tree.leaves(stacked)[0].shape[0]

            def body(carry, layer_state):
                state, index = layer_state
                return run_layer(nnx.merge(graphdef, state), *carry, index), None

            (x, kv), _ = jax.lax.scan(body, (x, kv),
                                      (stacked, jnp.arange(num_layers, dtype=jnp.int32)))
        return self.model.norm(x, backend), kv

    def embed(self, tokens: jax.Array, backend) -> jax.Array:  # [B, C] -> [B, C, hidden]
        """Each token's row of the embedding table (Gemma: times sqrt(hidden) in the model's
        dtype); split by vocabulary over shards, the one shard holding a token's row gives it
        and the others zeros, summed (exact)."""
        rows = self._embed_rows(tokens, backend)
        if not self.config.gemma_norms:
            return rows
        return rows * jnp.asarray(self.config.hidden_size**0.5, rows.dtype)

    def _embed_rows(self, tokens: jax.Array, backend) -> jax.Array:
        if backend.model_axis is None:
            return self.model.embed_tokens(tokens)
        embed = self.model.embed_tokens
        vocab = embed.embedding[...].shape[0]  # this shard's rows
        local = tokens - backend.vocab_offset(vocab)
        inside = (local >= 0) & (local < vocab)
        rows = embedding_rows(embed, jnp.where(inside, local, 0))
        return backend.sum_shards(jnp.where(inside[..., None], rows, jnp.zeros_like(rows)))

    def logits(self, hidden: jax.Array, backend) -> jax.Array:  # [..., vocab]
        """float32 logits; a tied head multiplies by the embedding table [vocab, hidden]. Split
        by vocabulary over shards, each computes its part and the parts are gathered."""
        return backend.gather_vocab(self.local_logits(hidden, backend))

    def local_logits(self, hidden: jax.Array, backend) -> jax.Array:  # [..., vocab / shards]
        """This shard's part of the logits (the whole of them on one device)."""
        if self.lm_head is not None:
            logits = backend.ops.linear(self.lm_head, hidden).astype(jnp.float32)
        else:
            logits = backend.ops.tied_logits(hidden, embedding_table(self.model.embed_tokens))
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: c * tanh(x / c), each logit alone
            logits = cap * jnp.tanh(logits / cap)
        return logits


def local_rope_config(cfg: ModelConfig) -> ModelConfig:
    """The config whose RoPE Gemma 3's sliding layers turn: base rope_local_theta, unscaled."""
    return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)


def stack_layers(graphdef: nnx.GraphDef, state: nnx.State,
                 consume: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """The model with its list of layers made one layer whose every weight has a leading layer
    axis [num_layers, ...], for the forward's jax.lax.scan. `consume`: the layers' own arrays
    are deleted as each weight's stack is made, so memory holds the weights once plus one
    weight's stack (an 8B model's gate_proj: 3.7 GB in bf16), not twice; `state` is unusable
    afterwards."""
    model = nnx.merge(graphdef, state)
    if not model.config.uniform_layers:
        raise ValueError("the model's layers differ (sliding-window and full attention): they "
                         "run unrolled, not stacked (scan_layers false)")
    layers = list(model.model.layers)
    layer_graphdef, first = nnx.split(layers[0])
    treedef = jax.tree.structure(first)
    per_layer = [jax.tree.leaves(nnx.state(layer)) for layer in layers]
    stacked = []
    for i in range(len(per_layer[0])):
        stacked.append(jnp.stack([leaves[i] for leaves in per_layer]))
        if consume:
            for leaves in per_layer:
                leaves[i].delete()
    model.model.layers = nnx.merge(layer_graphdef, jax.tree.unflatten(treedef, stacked))
    return nnx.split(model)
