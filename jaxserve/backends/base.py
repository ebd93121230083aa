"""The backend seam's two halves and the plain-XLA ("reference") versions of both.

A `Backend` is chosen once at start-up (`select.select_backend`) and passed to the model as a
static argument of the jitted steps: the model calls `backend.ops` for its linear layers and row
reductions and `backend.attention` for the KV pool and paged attention, and names no platform.

    Attention   the KV pool's layout and dtype, the write of a step's keys and values, and
                paged attention over padded rows (decode, prefill chunks) and, where a backend
                has it, over ragged rows (`ragged_calls`: the runner packs prompt chunks)
    Ops         linear layers, the tied LM head, and the row sums of RMSNorm and the sampler

Every pool holds all layers' pages in one array per pool, layer l's page p at
`l * kv.num_pages + p` (`KVCache`): the model runs its layers under `jax.lax.scan` and hands
each kernel the whole pool with the layer's page table, so no step copies a layer's pages.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.kv_cache import AttentionMetadata, KVCache, RaggedMetadata
from jaxserve.model.quant import QuantizedLinear
from pallas_kernels.blocked import decode_attention_blocked, prefill_attention_blocked
from pallas_kernels.reference import FP8_POOL

# JAX's Hopper grouped matmul's tiles: 64 rows (one warpgroup's wgmma), 128 output columns,
# 64 of the contraction a pipeline step, four steps in flight (114 KiB of shared memory)
HOPPER_TILES = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def hopper_ragged_dot_fits(x: jax.Array, w: jax.Array) -> bool:
    """Whether JAX's Mosaic GPU ragged_dot takes these operands: one 16-bit float dtype, the
    contraction a whole number of block_k and the outputs of block_n."""
    return (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
            and w.shape[1] % HOPPER_TILES["block_k"] == 0
            and w.shape[2] % HOPPER_TILES["block_n"] == 0)


def hopper_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                      kernel=None) -> jax.Array:
    """jax.lax.ragged_dot(x, w, group_sizes) by JAX's Mosaic GPU kernel for Hopper
    (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu): it reads each row's expert only, where
    XLA's GPU lowering multiplies every row by every expert. It leaves the rows past the
    groups' total unwritten; they are zeroed here, as ragged_dot's. `kernel`: the function
    called in its place (tests, on a machine without a Hopper)."""
    if kernel is None:
        from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot as kernel
    m = x.shape[0]
    pad = -m % HOPPER_TILES["block_m"]  # whole tiles of rows, whatever the step's
    y = kernel(jnp.pad(x, ((0, pad), (0, 0))), w, group_sizes=group_sizes, **HOPPER_TILES)[:m]
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))


def to_pool(x: jax.Array, dtype) -> jax.Array:
    """Keys or values in the pool's dtype; into 8-bit floats clamped to their largest finite
    value first (e4m3 has no infinity: the cast alone makes NaN of what lies past it). The
    per-tensor scale is vLLM's default of 1: the values are stored as they are."""
    if dtype == FP8_POOL:
        limit = float(jnp.finfo(FP8_POOL).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


@dataclass(frozen=True)
class Attention:
    """Plain XLA: the block walk of pallas_kernels/blocked.py over separate K and V pools."""

    name = "reference"
    ragged_calls = False  # whether `ragged` runs: the runner packs prompt chunks into one row

    def pool_head_dim(self, head_dim: int) -> int:
        """The head_dim the pool holds for the model's (the TPU kernel's pads to whole
        lanes)."""
        return head_dim

    def pool_dtype(self, dtype: str):
        """The pool array's dtype for a KV cache of dtype `dtype` ("float32", "bfloat16",
        "fp8": float8_e4m3fn, which the kernels widen as they load)."""
        return FP8_POOL if dtype == "fp8" else jnp.dtype(dtype)

    def zeros(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype: str) -> KVCache:
        shape = (num_layers * num_pages, page_size, num_kv_heads, head_dim)
        pool = self.pool_dtype(dtype)
        return KVCache(pools=(jnp.zeros(shape, pool), jnp.zeros(shape, pool)),
                       num_pages=num_pages)

    def write(self, kv: KVCache, k: jax.Array, v: jax.Array,
              index: tuple[jax.Array, jax.Array]) -> KVCache:
        """k, v [N, kv_heads, head_dim] into the pools at (page [N], offset [N]); indexing the
        pool directly (no reshape around the scatter) lets XLA write in place."""
        page, offset = index
        k_pool, v_pool = kv.pools
        return KVCache(pools=(k_pool.at[page, offset].set(to_pool(k, k_pool.dtype)),
                              v_pool.at[page, offset].set(to_pool(v, v_pool.dtype))),
                       num_pages=kv.num_pages)

    def padded(self, q: jax.Array, kv: KVCache, md: AttentionMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        """q [B, C, heads, head_dim] -> the same shape; md's page table is the layer's.
        `sliding_window` w: a query at position p sees positions p - w + 1 .. p (None: all up
        to p); `soft_cap` c: each scaled score s becomes c * tanh(s / c) (None: as it is)."""
        k_pool, v_pool = kv.pools
        window = dict(sliding_window=sliding_window, soft_cap=soft_cap)
        if q.shape[1] == 1:  # walks only the pages the longest sequence uses
            return decode_attention_blocked(q[:, 0], k_pool, v_pool, md.page_table,
                                            md.seq_lens, scale, **window)[:, None]
        return prefill_attention_blocked(q, k_pool, v_pool, md.page_table, md.positions,
                                         md.seq_lens, scale=scale, **window)

    def ragged(self, q: jax.Array, kv: KVCache, md: RaggedMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        """q [1, T, heads, head_dim] packed rows -> the same shape."""
        raise ValueError(f"a ragged call runs on the cpu or tpu attention, not {self.name!r}")

    def __call__(self, q: jax.Array, kv: KVCache, md: AttentionMetadata | RaggedMetadata,
                 scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None) -> jax.Array:
        if isinstance(md, RaggedMetadata):
            return self.ragged(q, kv, md, scale, sliding_window, soft_cap)
        return self.padded(q, kv, md, scale, sliding_window, soft_cap)


@dataclass(frozen=True)
class Ops:
    """Plain XLA: the dot and reductions of any platform and dtype (the only ops that
    differentiate, for training)."""

    name = "xla"
    # whether the engine stacks the layers under jax.lax.scan (config.scan_layers None): one
    # layer compiled whatever the depth, and as fast as unrolled where XLA reads a scanned
    # layer's weights in place (select.py turns it off where it does not)
    scan_layers: bool = True
    # tensor parallelism's sums of the shards' partial products in one fixed order, the same
    # whatever the rows (Backend.sum_shards); else one all-reduce, whose order XLA may choose
    ordered_shard_sums = False
    # fp8 weights multiply fp8 activations in the device's fp8 matmul (QuantizedLinear's
    # fp8_product: each row scaled into e4m3 as it goes) where it has one (select.py:
    # NVIDIA compute capability 8.9 on); else they widen inside the product (weight-only)
    native_fp8: bool = False
    # the mixture of experts' grouped matmul in JAX's Mosaic GPU kernel (hopper_ragged_dot)
    # where the device is a Hopper (compute capability 9.x: select.py); else jax.lax.ragged_dot,
    # which XLA's GPU compiler expands into one dense dot over every expert (NOTES-jax.md)
    hopper_grouped: bool = False

    def linear(self, layer: nnx.Linear | QuantizedLinear,
               x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        if self.native_fp8 and isinstance(layer, QuantizedLinear) and (
                layer.takes_fp8_activations):
            return layer.fp8_product(x)
        return layer(x)

    def grouped_linear(self, layer, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Mixture-of-experts' grouped matmul: x [M, in] with rows sorted by expert, the first
        group_sizes[0] rows times expert 0's kernel [in, out] (layer.kernel [E, in, out]), the
        next group_sizes[1] expert 1's, ...; rows past the groups' total are zero."""
        w = layer.kernel[...]
        if self.hopper_grouped and hopper_ragged_dot_fits(x, w):
            return hopper_ragged_dot(x, w, group_sizes)
        return jax.lax.ragged_dot(x, w, group_sizes)

    def tied_logits(self, hidden: jax.Array, table: jax.Array) -> jax.Array:
        """hidden [..., e] against the embedding table [vocab, e] -> float32 [..., vocab]."""
        return jnp.einsum("...e,ve->...v", hidden, table, preferred_element_type=jnp.float32)

    def row_sum(self, x: jax.Array) -> jax.Array:  # [..., n] float32 -> [..., 1]
        return jnp.sum(x, axis=-1, keepdims=True)

    def row_sum_squares(self, x: jax.Array) -> jax.Array:  # [..., n] float32 -> [..., 1]
        return self.row_sum(x * x)

    def log_softmax(self, x: jax.Array) -> jax.Array:  # [..., n] float32
        return jax.nn.log_softmax(x, axis=-1)

    def softmax(self, x: jax.Array) -> jax.Array:  # [..., n] float32
        return jax.nn.softmax(x, axis=-1)

    def pack_weights(self, graphdef: nnx.GraphDef,
                     state: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
        """The weights in the layout `linear` reads fastest. XLA takes them as they are, but
        for the fp8 matmul (`native_fp8`): its operands are read along the contracted axis
        (cuBLASLt's fp8 GEMM on Hopper takes no other layout), so those kernels are held
        [out, in] (QuantizedLinear.out_major), or XLA would transpose each one every step."""
        if not self.native_fp8:
            return graphdef, state
        model = nnx.merge(graphdef, state)  # shares state's variables
        for _, module in nnx.iter_modules(model):
            if (isinstance(module, QuantizedLinear) and module.takes_fp8_activations
                    and not module.out_major and module.kernel.get_value().ndim == 2):
                module.kernel.set_value(module.kernel.get_value().T)
                module.out_major = True
        return nnx.split(model)


@dataclass(frozen=True)
class Backend:
    """What differs between platforms, chosen once (`select.select_backend`); frozen and
    hashable, so the jitted steps take it as a static argument."""

    name: str  # "gpu" | "tpu" | "cpu" | "reference"
    attention: Attention
    ops: Ops
    # tensor parallelism (jaxserve/parallel/sharding.py): the mesh axis the heads, the MLP's columns and
    # the vocabulary are split over, the model running once per shard under shard_map on its
    # part of each weight; None: the whole model on one device
    model_axis: str | None = None

    def sum_shards(self, x: jax.Array) -> jax.Array:
        """A row-split layer's partial products (each shard's heads or MLP columns) summed:
        the layer's whole output on every shard."""
        if self.model_axis is None:
            return x
        if not self.ops.ordered_shard_sums:
            return jax.lax.psum(x, self.model_axis)  # one all-reduce
        parts = jax.lax.all_gather(x, self.model_axis)  # [shards, ...], summed in shard order
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather_vocab(self, logits: jax.Array) -> jax.Array:  # [..., vocab / shards] -> [..., vocab]
        if self.model_axis is None:
            return logits
        return jax.lax.all_gather(logits, self.model_axis, axis=logits.ndim - 1, tiled=True)

    def shard_index(self) -> jax.Array | int:  # this shard's place on the model axis
        return 0 if self.model_axis is None else jax.lax.axis_index(self.model_axis)

    def vocab_offset(self, rows: int) -> jax.Array | int:
        """The first token id of this shard's part of the vocabulary (`rows` ids a shard)."""
        return 0 if self.model_axis is None else jax.lax.axis_index(self.model_axis) * rows


REFERENCE = Backend("reference", Attention(), Ops())
