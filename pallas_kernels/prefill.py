"""Paged prefill attention: a Pallas kernel for NVIDIA GPUs (Triton lowering).

A chunk of queries per sequence attends causally (by absolute position) to the sequence's pages,
flash-attention style. A program owns one (sequence, kv head, query block); the query heads of
its kv head are folded into the rows of one tile, so each K/V page is read once per kv head and
query block:

    q block [block_q, group_pad, head_dim] -> rows [block_q * group_pad, head_dim]
    row r = query (r // group_pad) of the block, head (r % group_pad) of the kv head's group

    block_q 2, group_pad 2:    row 0 = (query 0, head 0)   row 1 = (query 0, head 1)
                               row 2 = (query 1, head 0)   row 3 = (query 1, head 1)

Keys are walked a block of pages at a time, up to the block's last query position: blocks of
keys past it are never loaded. Row r may use key j when j <= positions[r // group_pad] and
j < seq_len. With a sliding window of w keys (also j > positions[r // group_pad] - w) the walk
starts at the page holding the first key the block's earliest query sees:

    page_size 4, w 5, query block at positions 20..23: keys 16..23 -> pages 4, 5 only
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.decode import (
    LOG2E,
    MIN_DOT,
    attend_page_block,
    block_page_ids,
    check_paged_inputs,
    check_power_of_2,
    compiler_params,
    init_carry,
    next_power_of_2,
    normalise,
)
from pallas_kernels.reference import check_options

# Query rows per program when block_q is None (block_q * group_pad).
_TARGET_ROWS = 128


def _prefill_kernel(
    q_ref,  # [block_q, group_pad, head_dim]
    k_pages_ref,  # [num_pages, page_size, num_kv_heads, head_dim]   whole pool, in HBM
    v_pages_ref,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ref,  # [padded_pages]   this sequence's row
    positions_ref,  # [block_q]   -1 for the padding queries added by the wrapper
    seq_len_ref,  # [1]
    o_ref,  # [block_q, group_pad, head_dim]
    *,
    qk_scale: float,
    pages_per_block: int,
    pages_per_seq: int,
    sliding_window: int | None,
    soft_cap: float | None,
):
    kv_head = pl.program_id(1)
    num_pages, page_size = k_pages_ref.shape[:2]
    block_q, group_pad, head_dim = q_ref.shape
    rows = block_q * group_pad
    block_k = pages_per_block * page_size

    q = q_ref[...].reshape(rows, head_dim)
    positions = positions_ref[...]  # [block_q]
    row_positions = jnp.broadcast_to(positions[:, None], (block_q, group_pad)).reshape(rows)

    seq_len = jnp.minimum(seq_len_ref[0], pages_per_seq * page_size)
    used_pages = pl.cdiv(seq_len, page_size)
    # Causal skip: no query of this block sees a key past its largest position.
    kv_len = jnp.minimum(seq_len, positions.max() + 1)
    first_page = 0
    if sliding_window is not None:
        # Window skip: no query of this block sees a key before its earliest query's window
        # (the wrapper's padding queries, at -1, see nothing and do not count).
        earliest = jnp.where(positions >= 0, positions, positions.max()).min()
        first_page = jnp.maximum(earliest - sliding_window + 1, 0) // page_size
    num_blocks = pl.cdiv(jnp.maximum(kv_len - first_page * page_size, 0), block_k)

    def body(i, carry):
        start_page = first_page + i * pages_per_block
        ids = block_page_ids(page_table_ref, start_page, pages_per_block, used_pages, num_pages)
        keys = start_page * page_size + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        written = keys < seq_len
        valid = (keys[None, :] <= row_positions[:, None]) & written[None, :]
        if sliding_window is not None:
            valid &= keys[None, :] > row_positions[:, None] - sliding_window
        return attend_page_block(q, k_pages_ref, v_pages_ref, ids, kv_head, valid, written, carry,
                                 qk_scale, soft_cap)

    o, _, row_sum = lax.fori_loop(0, num_blocks, body, init_carry(rows, head_dim))
    o_ref[...] = normalise(o, row_sum).astype(o_ref.dtype).reshape(block_q, group_pad, head_dim)


def _prefill_call(
    q,  # [B, chunk_pad, num_kv_heads, group_pad, head_dim]
    k_pages,
    v_pages,
    page_table,  # [B, padded_pages] int32
    positions,  # [B, chunk_pad] int32
    seq_lens,  # [B] int32
    *,
    qk_scale: float,
    block_q: int,
    pages_per_block: int,
    pages_per_seq: int,
    sliding_window: int | None,
    soft_cap: float | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Runs the kernel over grid (sequence, kv head, query block); returns q's shape."""
    batch, chunk_pad, num_kv_heads, group_pad, head_dim = q.shape
    padded_pages = page_table.shape[1]
    kernel = functools.partial(
        _prefill_kernel,
        qk_scale=qk_scale,
        pages_per_block=pages_per_block,
        pages_per_seq=pages_per_seq,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    q_spec = pl.BlockSpec(
        (None, block_q, None, group_pad, head_dim), lambda b, h, i: (b, i, h, 0, 0)
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, chunk_pad // block_q),
        in_specs=[
            q_spec,
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec((None, padded_pages), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
            pl.BlockSpec((1,), lambda b, h, i: (b,)),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="paged_prefill_attention",
    )(q, k_pages, v_pages, page_table, positions, seq_lens)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_q",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "interpret",
        "sliding_window",
        "soft_cap",
    ),
)
def prefill_attention(
    q: jax.Array,  # [B, C, num_heads, head_dim]   a chunk of C queries per sequence
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, pages_per_seq] int32
    positions: jax.Array,  # [B, C] int32   absolute position of each query
    seq_lens: jax.Array,  # [B] int32   keys valid in the pages (chunk included)
    scale: float,
    *,
    block_q: int | None = None,
    pages_per_block: int = 4,
    num_warps: int = 8,
    num_stages: int = 2,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, C, num_heads, head_dim]
    """Paged causal prefill attention; same contract as ``prefill_attention_ref``.

    block_q: queries per program (a power of two); None gives 128 rows (block_q * group_pad);
    raised to 16 rows, lowered to the chunk. pages_per_block: pages per loop step (a power of
    two); raised so a key block has >= 16 tokens, lowered to the table's width. num_warps,
    num_stages: Triton's. interpret: run on the CPU through the Pallas interpreter. scale is
    static (a Python float). Queries with no valid key (padding) give finite values that
    callers ignore, as the reference's do. sliding_window, soft_cap: as in ``reference.py``
    (static); with a window a query block walks from the first page its queries' windows touch.
    """
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}, expected [batch, chunk, num_heads, head_dim]")
    batch, chunk, num_heads, head_dim = q.shape
    if chunk < 1:
        raise ValueError(f"q has shape {q.shape}: a chunk of at least 1 query")
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, batch)
    if positions.shape != (batch, chunk) or positions.dtype != jnp.int32:
        raise ValueError(
            f"positions is {positions.dtype}{list(positions.shape)}, "
            f"expected int32[{batch}, {chunk}]"
        )
    if seq_lens.shape != (batch,) or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"seq_lens is {seq_lens.dtype}{list(seq_lens.shape)}, expected int32[{batch}]"
        )
    if block_q is not None:
        check_power_of_2("block_q", block_q)
    check_power_of_2("pages_per_block", pages_per_block)
    check_options(sliding_window, soft_cap)

    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if block_q is None:
        block_q = max(_TARGET_ROWS // group_pad, 1)
    block_q = max(min(block_q, next_power_of_2(chunk)), MIN_DOT // group_pad, 1)
    chunk_pad = pl.cdiv(chunk, block_q) * block_q
    pages_per_seq = page_table.shape[1]
    pages_per_block = max(
        min(pages_per_block, next_power_of_2(pages_per_seq)), MIN_DOT // page_size, 1
    )
    padded_pages = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    if sliding_window is not None:
        # a walk from its window's first page (any page) reads up to a block past its last
        padded_pages = max(padded_pages, pages_per_seq + pages_per_block - 1)

    # q: [B, C, H, D] -> [B, chunk_pad, kv_heads, group_pad, D]; pad queries get position -1
    # (no key), pad heads are zeros; both are dropped below.
    q5 = q.reshape(batch, chunk, num_kv_heads, group, head_dim)
    q5 = jnp.pad(q5, ((0, 0), (0, chunk_pad - chunk), (0, 0), (0, group_pad - group), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, chunk_pad - chunk)), constant_values=-1)
    table = jnp.pad(page_table, ((0, 0), (0, padded_pages - pages_per_seq)))

    out = _prefill_call(
        q5,
        k_pages,
        v_pages,
        table,
        positions,
        seq_lens,
        qk_scale=float(scale) * LOG2E,
        block_q=block_q,
        pages_per_block=pages_per_block,
        pages_per_seq=pages_per_seq,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    return out[:, :chunk, :, :group].reshape(batch, chunk, num_heads, head_dim)
