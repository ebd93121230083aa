"""Device bundles for paged attention: the KV pages and the metadata of one step.

Token j of the sequence in row b is stored at page ``page_table[b, j // page_size]``, offset
``j % page_size``. Page 0 is the null page: padding tokens write there and empty rows read it.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_attention import BF16_BITS, bf16_bits


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer: [num_pages, page_size, num_kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # per layer: [num_pages, page_size, num_kv_heads, head_dim]

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype) -> "KVCache":
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens sit: B rows (sequences) of C tokens (C = 1 for decode)."""

    positions: jax.Array  # [B, C] int32   absolute position of each token
    query_lens: jax.Array  # [B] int32   real tokens in each row; the rest is padding (0: empty row)
    seq_lens: jax.Array  # [B] int32   tokens in the pages after this step (positions[:, 0] + query_lens)
    page_table: jax.Array  # [B, pages_per_seq] int32

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

    def write_index(self, page_size: int) -> tuple[jax.Array, jax.Array]:  # 2 x [T] int32
        """(page, offset) each token's K/V goes to; padding tokens go to the null page."""
        rows = self.page_table.shape[0]
        positions = self.positions[0]
        real = self.token_rows < rows
        page = self.page_table[jnp.minimum(self.token_rows, rows - 1),
                               jnp.minimum(positions // page_size, self.page_table.shape[1] - 1)]
        return jnp.where(real, page, 0), positions % page_size


def write_kv(pages: jax.Array, new: jax.Array, index: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Scatter new K or V [B, C, kv_heads, head_dim] into the pages at (page, offset).

    Indexing the 4-D pool directly (not a flattened view) lets XLA write in place; a reshape
    around the scatter made it copy the whole pool every step.
    """
    _, _, kv_heads, head_dim = pages.shape
    page, offset = index
    new = new.reshape(-1, kv_heads, head_dim)
    # a bfloat16 pool on the CPU holds its values' bits (cpu_attention.BF16_BITS)
    new = bf16_bits(new) if pages.dtype == BF16_BITS else new.astype(pages.dtype)
    return pages.at[page, offset].set(new)
