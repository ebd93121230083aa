"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) in Flax NNX over the paged KV cache.

Attribute names mirror Hugging Face's parameter names (model.layers.0.self_attn.q_proj ...), so
the loader maps a checkpoint mechanically. Callers split graph and state once and jit pure
functions of the state (see model/step.py).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.attention import paged_attention
from jaxserve.model.kv_cache import AttentionMetadata, KVCache, RaggedMetadata, write_kv
from jaxserve.model.linear import project
from jaxserve.model.reductions import row_sum_squares
from jaxserve.model_config import ModelConfig
from pallas_kernels.cpu_matmul import matmul_cpu


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:  # [head_dim // 2] float32
    """RoPE inverse frequencies, with linear or llama3 scaling, computed in float32 as HF does."""
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
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


def rope_angles(cfg: ModelConfig, positions: jax.Array) -> jax.Array:  # [..., head_dim] f32
    """Each position's rotation angles, the half-dimension frequencies repeated (HF's layout)."""
    freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)
    return jnp.concatenate([freqs, freqs], axis=-1)


def rope_tables(cfg: ModelConfig, num_positions: int, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every position's angles, [num_positions, head_dim] each: a step that reads
    them from these tables computes no cosine. Left to compute them, XLA on the CPU fuses cos
    and sin into every layer's rotation of q and k and recomputes them per head and layer:
    about a tenth of a prefill call's time."""
    angles = rope_angles(cfg, jnp.arange(num_positions, dtype=jnp.int32))
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, C, heads, head_dim]; cos/sin: [B, C, head_dim]. HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, matmul_impl: str = "xla") -> jax.Array:
        xf = x.astype(jnp.float32)
        # with the CPU kernels, the batch-invariant sum (reductions.py)
        xf = xf * jax.lax.rsqrt(row_sum_squares(xf, matmul_impl) / x.shape[-1] + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _linear(cfg_in: int, cfg_out: int, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(cfg_in, cfg_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(e, cfg.num_heads * d, cfg.qkv_bias, dtype, rngs)
        self.k_proj = _linear(e, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.v_proj = _linear(e, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.o_proj = _linear(cfg.num_heads * d, e, cfg.o_bias, dtype, rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def __call__(self, x, cos, sin, k_pages, v_pages, md: AttentionMetadata, write_index,
                 attention_impl: str, matmul_impl: str):
        b, c, _ = x.shape
        q = project(self.q_proj, x, matmul_impl).reshape(b, c, self.num_heads, self.head_dim)
        k = project(self.k_proj, x, matmul_impl).reshape(b, c, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, x, matmul_impl).reshape(b, c, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pages = write_kv(k_pages, k, write_index)
        v_pages = write_kv(v_pages, v, write_index)
        out = paged_attention(q, k_pages, v_pages, md, self.head_dim**-0.5, attention_impl)
        return project(self.o_proj, out.reshape(b, c, -1), matmul_impl), k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(e, i, False, dtype, rngs)
        self.up_proj = _linear(e, i, False, dtype, rngs)
        self.down_proj = _linear(i, e, False, dtype, rngs)

    def __call__(self, x, matmul_impl: str = "xla"):
        gate, up = project(self.gate_proj, x, matmul_impl), project(self.up_proj, x, matmul_impl)
        return project(self.down_proj, jax.nn.silu(gate) * up, matmul_impl)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, cos, sin, k_pages, v_pages, md, write_index, attention_impl,
                 matmul_impl):
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x, matmul_impl), cos, sin,
                                             k_pages, v_pages, md, write_index, attention_impl,
                                             matmul_impl)
        x = x + h
        h = self.post_attention_layernorm(x, matmul_impl)
        return x + self.mlp(h, matmul_impl), k_pages, v_pages


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nnx.Module):
    """tokens [B, C] + KV pages -> hidden states [B, C, hidden] and the updated pages."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Decoder(cfg, dtype, rngs)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(
            cfg.hidden_size, cfg.vocab_size, False, dtype, rngs
        )

    def __call__(self, tokens: jax.Array, kv: KVCache, md: AttentionMetadata | RaggedMetadata,
                 attention_impl: str, matmul_impl: str = "xla",
                 rope: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, KVCache]:
        """`rope`: rope_tables' cos and sin (positions past them read the last row); without
        them the step computes its positions' cos and sin itself, to the same bits."""
        x = self.model.embed_tokens(tokens)  # [B, C, hidden]
        if rope is None:
            angles = rope_angles(self.config, md.positions)  # [B, C, head_dim]
            cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        else:
            cos, sin = (jnp.take(t, md.positions, axis=0, mode="clip").astype(x.dtype)
                        for t in rope)
        write_index = md.write_index(kv.k[0].shape[1])
        new_k, new_v = [], []
        for layer, k_pages, v_pages in zip(self.model.layers, kv.k, kv.v, strict=True):
            x, k_pages, v_pages = layer(x, cos, sin, k_pages, v_pages, md, write_index,
                                        attention_impl, matmul_impl)
            new_k.append(k_pages)
            new_v.append(v_pages)
        return self.model.norm(x, matmul_impl), KVCache(k=tuple(new_k), v=tuple(new_v))

    def logits(self, hidden: jax.Array, matmul_impl: str = "xla") -> jax.Array:  # [..., vocab]
        """float32 logits; a tied head multiplies by the embedding table [vocab, hidden]."""
        if self.lm_head is not None:
            return project(self.lm_head, hidden, matmul_impl).astype(jnp.float32)
        table = self.model.embed_tokens.embedding[...]
        if matmul_impl == "cpu":
            return matmul_cpu(hidden, table, transposed=True)
        return jnp.einsum("...e,ve->...v", hidden, table, preferred_element_type=jnp.float32)
