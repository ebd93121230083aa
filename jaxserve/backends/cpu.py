"""The CPU backend: the C++ kernels of `cpu_kernels` through XLA's FFI, batch invariant.

With both halves, a token's logits are bitwise the same whatever else its step holds: the
matmul, the attention and every row sum run one chain of additions fixed by the row alone
(XLA's own CPU reductions sum a row of a [4, n] array differently from a row of a [2, n] one).

    CpuAttention  decode and prefill chunks, padded or ragged (`ragged_calls`: the runner packs
                  prompt chunks into one row); a bfloat16 or fp8 pool is held as its bits
                  (uint16, uint8), which XLA on the CPU scatters in place
    CpuOps        float32 linear layers on packed panels (or AMX tiles; int8 or fp8 weights
                  with their column scales), mixture-of-experts' grouped matmuls (each row
                  its expert's chain), and the row sums as the kernel's products with a
                  column of ones
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from cpu_kernels.attention import (
    BF16_BITS,
    FP8_BITS,
    bf16_bits,
    decode_attention_cpu,
    fp8_bits,
    prefill_attention_cpu,
    prefill_attention_cpu_ragged,
)
from cpu_kernels.matmul import (
    amx_packable,
    matmul_cpu,
    matmul_cpu_amx,
    matmul_cpu_grouped,
    matmul_cpu_grouped_panels,
    matmul_cpu_panels,
    matmul_cpu_quant,
    matmul_cpu_quant_panels,
    pack_amx,
    pack_expert_panels,
    pack_panels,
    row_sum_squares_cpu,
)
from jaxserve.backends.base import Attention, Ops
from jaxserve.model.kv_cache import AttentionMetadata, KVCache, RaggedMetadata
from jaxserve.model.moe import ExpertLinear
from jaxserve.model.quant import QuantizedEmbed, QuantizedLinear


@dataclass(frozen=True)
class CpuAttention(Attention):
    name = "cpu"
    ragged_calls = True

    def pool_dtype(self, dtype: str):
        return {"bfloat16": BF16_BITS, "fp8": FP8_BITS}.get(dtype) or jnp.dtype(dtype)

    def write(self, kv: KVCache, k: jax.Array, v: jax.Array,
              index: tuple[jax.Array, jax.Array]) -> KVCache:
        if kv.pools[0].dtype == BF16_BITS:
            k, v = bf16_bits(k), bf16_bits(v)
        elif kv.pools[0].dtype == FP8_BITS:
            k, v = fp8_bits(k), fp8_bits(v)
        return super().write(kv, k, v, index)

    def padded(self, q: jax.Array, kv: KVCache, md: AttentionMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        k_pool, v_pool = kv.pools
        window = dict(sliding_window=sliding_window, soft_cap=soft_cap)
        if q.shape[1] == 1:
            return decode_attention_cpu(q[:, 0], k_pool, v_pool, md.page_table, md.seq_lens,
                                        scale, **window)[:, None]
        return prefill_attention_cpu(q, k_pool, v_pool, md.page_table, md.positions,
                                     md.seq_lens, scale, **window)

    def ragged(self, q: jax.Array, kv: KVCache, md: RaggedMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        k_pool, v_pool = kv.pools
        return prefill_attention_cpu_ragged(q[0], k_pool, v_pool, md.page_table,
                                            md.positions[0], md.query_starts, md.seq_lens,
                                            scale, sliding_window=sliding_window,
                                            soft_cap=soft_cap)[None]


@dataclass(frozen=True)
class CpuOps(Ops):
    """float32 only. `amx`: kernels whose input size is a multiple of 32 packed as bf16 parts
    for the AMX kernel (bf16x3: within about 1e-5 of float32, not its bits)."""

    amx: bool = False
    # The kernels take a layer's weights as whole buffers: under scan XLA slices each layer's
    # out of the stack into a copy every step (bench/compile_time.py, 32 layers: a decode step
    # 2.2x the unrolled one's), so the CPU backend keeps its layers unrolled
    scan_layers: bool = False
    # batch invariance under tensor parallelism: XLA's all-reduce on the CPU adds 4 or more
    # shards' parts in an order that depends on the buffer's shape, so a row's sum changed with
    # the call's rows (tiny Qwen2, tp=4: a prompt alone against the same prompt in a batch)
    ordered_shard_sums = True

    @property
    def name(self) -> str:
        return "amx" if self.amx else "cpu"

    def linear(self, layer: nnx.Linear | QuantizedLinear, x: jax.Array) -> jax.Array:
        w = layer.kernel[...]
        if isinstance(layer, QuantizedLinear):
            x = layer.ordered(x)
        if isinstance(layer, QuantizedLinear) and (layer.group_scale is not None
                                                   or layer.zeros() is not None):
            # group-wise scales or zero points: the kernel's one scale a column does not fit
            # them; the weights dequantised (elementwise, so rows stay independent), then
            # multiplied
            y = matmul_cpu(x, layer.dequantized())
        elif isinstance(layer, QuantizedLinear):  # the narrow weights widened in registers
            scale = layer.scale[...]
            if w.dtype == jnp.int4:  # unpacked (split over a mesh): the kernel reads int8
                w = w.astype(jnp.int8)
            y = (matmul_cpu_quant_panels(x, w, scale, layer.out_features) if w.ndim == 3
                 else matmul_cpu_quant(x, w, scale))
        elif w.ndim == 4:  # pack_amx's bf16 parts
            y = matmul_cpu_amx(x, w, layer.out_features)
        elif w.ndim == 3:  # pack_panels' panels
            y = matmul_cpu_panels(x, w, layer.out_features)
        else:
            y = matmul_cpu(x, w)
        return y if layer.bias is None else y + layer.bias[...]

    def grouped_linear(self, layer, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Each row its own chain with its expert's weights, whatever the groups (a token's
        expert outputs do not depend on its step's other tokens); XLA's ragged_dot on the CPU
        runs every expert on every row."""
        w = layer.kernel[...]
        if w.ndim == 4:  # pack_expert_panels' panels
            return matmul_cpu_grouped_panels(x, w, group_sizes, layer.out_features)
        return matmul_cpu_grouped(x, w, group_sizes)

    def tied_logits(self, hidden: jax.Array, table: jax.Array) -> jax.Array:
        return matmul_cpu(hidden, table, transposed=True)

    def row_sum(self, x: jax.Array) -> jax.Array:
        return matmul_cpu(x, jnp.ones((x.shape[-1], 1), jnp.float32))

    def row_sum_squares(self, x: jax.Array) -> jax.Array:  # row_sum(x * x)'s bits, one kernel
        return row_sum_squares_cpu(x)

    def log_softmax(self, x: jax.Array) -> jax.Array:  # the max is exact anyway
        shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        return shifted - jnp.log(self.row_sum(jnp.exp(shifted)))

    def softmax(self, x: jax.Array) -> jax.Array:
        e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
        return e / self.row_sum(e)

    def pack_weights(self, graphdef: nnx.GraphDef,
                     state: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
        """Every Linear's kernel [in, out] as panels [ceil(out / 64), in, 64] (pack_panels), and
        every expert's of a mixture of experts (pack_expert_panels),
        which the kernel streams from memory in one run (1.1-1.6x the in-place layout's speed
        at a decode step's 2-64 rows, bench/cpu_kernel_speed.py); the same bits. With `amx`, a
        kernel whose input size is a multiple of 32 becomes its bf16 parts instead. The
        packing happens in `state`'s own variables, one kernel at a time, so each in-place
        kernel is freed as its panels are made: the state passed in is the packed one
        afterwards."""
        model = nnx.merge(graphdef, state)  # shares state's variables
        _dequantize_groups(model)
        for _, module in nnx.iter_modules(model):
            if isinstance(module, ExpertLinear) and module.kernel.get_value().ndim == 3:
                module.kernel.set_value(pack_expert_panels(module.kernel.get_value()))
                continue
            if (isinstance(module, nnx.Linear | QuantizedLinear)
                    and module.kernel.get_value().ndim == 2
                    and getattr(module, "group_scale", None) is None
                    and getattr(module, "zero", None) is None):
                w = module.kernel.get_value()
                if w.dtype == jnp.int4:  # the kernel reads int8: a byte a weight on the CPU
                    w = w.astype(jnp.int8)
                amx = self.amx and amx_packable(w) and not isinstance(module, QuantizedLinear)
                packed = pack_amx(w) if amx else pack_panels(w)
                module.kernel.set_value(packed)
        return nnx.split(model)


def _dequantize_groups(model: nnx.Module) -> None:
    """Layers held in groups (GGUF's blocks, GPTQ's and AWQ's group-wise or zero-pointed
    weights) and a narrow embedding (quant.QuantizedEmbed) as float ones of the model's dtype,
    once: the C++ kernels take one scale a column, and dequantising every weight in every step
    cost SmolLM2-135M's Q4_1 layers 11x its float decode step here (bench/RESULTS.md)."""
    inner = getattr(model, "model", None)  # a whole model (not a bare layer): its dtype
    dtype = inner.norm.weight.get_value().dtype if inner is not None else jnp.float32
    for path, module in list(nnx.iter_modules(model)):
        if not path:  # the root: a bare layer stays as it is (linear() still takes it)
            continue
        if isinstance(module, QuantizedEmbed):
            table = module.table()
            new = nnx.eval_shape(lambda t=table: nnx.Embed(
                t.shape[0], t.shape[1], dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
            new.embedding.set_value(table.astype(dtype))
        elif isinstance(module, QuantizedLinear) and (
                module.group_scale is not None or module.zeros() is not None):
            new = nnx.eval_shape(lambda m=module: nnx.Linear(
                m.in_features, m.out_features, use_bias=m.bias is not None, dtype=dtype,
                param_dtype=dtype, rngs=nnx.Rngs(0)))
            new.kernel.set_value(module.dequantized(dtype))  # (in the kernel's rows' order)
            if module.input_order is not None:  # GPTQ act-order: back in the inputs' order
                new.kernel.set_value(jnp.zeros_like(new.kernel.get_value()).at[
                    module.input_order.get_value()].set(new.kernel.get_value()))
            if module.bias is not None:
                new.bias.set_value(module.bias.get_value())
        else:
            continue
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
