"""Device bundles for paged attention: the KV pages and the metadata of one step.

Token j of the sequence in row b is stored at page ``page_table[b, j // page_size]``, offset
``j % page_size``. Page 0 is the null page: padding tokens write there and empty rows read it.
"""

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """All layers' KV pages: layer l's page p is row `l * num_pages + p` of each pool, so a
    layer's kernels read and write the one pool through its own page table (`layer_pages`)
    and a step run under `jax.lax.scan` copies no layer's pages. The pools' layout is the
    backend's (jaxserve/backends): K and V apart, each
    [num_layers * num_pages, page_size, num_kv_heads, head_dim], unless a backend says
    otherwise."""

    pools: tuple[jax.Array, ...]
    num_pages: int = field(metadata=dict(static=True))  # per layer, the null page 0 included

    @property
    def page_size(self) -> int:
        return self.pools[0].shape[1]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype) -> int:
        """A page of every layer's keys and values."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens sit: B rows (sequences) of C tokens (C = 1 for decode)."""

    positions: jax.Array  # [B, C] int32   absolute position of each token
    query_lens: jax.Array  # [B] int32   real tokens in each row; the rest is padding (0: empty row)
    seq_lens: jax.Array  # [B] int32   tokens in the pages after this step (positions[:, 0] + query_lens)
    page_table: jax.Array  # [B, pages_per_seq] int32
    # [B] int32 each row's LoRA slot (model/lora.py; 0: the base model); None: no adapters
    lora_slots: jax.Array | None = None

    def token_lora_slots(self) -> jax.Array:  # [B * C] int32: each token's row's
        return jnp.repeat(self.lora_slots, self.positions.shape[1],
                          total_repeat_length=self.positions.size)

    def layer_pages(self, first: jax.Array) -> "AttentionMetadata":
        """The metadata of the layer whose pages start at pool row `first`."""
        return replace(self, page_table=self.page_table + first)

    def write_index(self, page_size: int) -> tuple[jax.Array, jax.Array]:  # 2 x [B * C] int32
        """(page, offset) each token's K/V goes to; padding tokens go to the null page."""
        page = jnp.take_along_axis(
            self.page_table, self.positions // page_size, axis=1, mode="clip"
        )
        chunk = self.positions.shape[1]
        real = jnp.arange(chunk, dtype=jnp.int32)[None, :] < self.query_lens[:, None]
        page = jnp.where(real, page, 0).reshape(-1)
        return page, (self.positions % page_size).reshape(-1)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedMetadata:
    """A ragged prefill call: B rows' prompt chunks packed one after another into a single row
    of T tokens (tokens [1, T]), then padding: no row pads its chunk to a bucket, only the call
    pads its total. Rows with no tokens are empty."""

    positions: jax.Array  # [1, T] int32   absolute position of each token (padding: 0)
    token_rows: jax.Array  # [T] int32   the row each token belongs to; B for padding
    query_starts: jax.Array  # [B + 1] int32   row b's tokens: query_starts[b] .. [b + 1] - 1
    seq_lens: jax.Array  # [B] int32   tokens in the row's pages after this call
    page_table: jax.Array  # [B, pages_per_seq] int32
    # [B] int32 each row's LoRA slot (model/lora.py; 0: the base model); None: no adapters
    lora_slots: jax.Array | None = None

    def token_lora_slots(self) -> jax.Array:  # [T] int32: each token's row's (padding: 0)
        return jnp.take(self.lora_slots, self.token_rows, mode="fill", fill_value=0)

    def layer_pages(self, first: jax.Array) -> "RaggedMetadata":
        """The metadata of the layer whose pages start at pool row `first`."""
        return replace(self, page_table=self.page_table + first)

    def write_index(self, page_size: int) -> tuple[jax.Array, jax.Array]:  # 2 x [T] int32
        """(page, offset) each token's K/V goes to; padding tokens go to the null page."""
        rows = self.page_table.shape[0]
        positions = self.positions[0]
        real = self.token_rows < rows
        page = self.page_table[jnp.minimum(self.token_rows, rows - 1),
                               jnp.minimum(positions // page_size, self.page_table.shape[1] - 1)]
        return jnp.where(real, page, 0), positions % page_size
