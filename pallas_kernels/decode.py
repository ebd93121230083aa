"""Paged decode attention: a Pallas kernel for NVIDIA GPUs (Triton lowering), and the in-kernel
pieces it shares with ``prefill.py``.

One query per slot. A program owns one (slot, kv head, split): the query heads of its kv head
form one ``[group_pad, head_dim]`` tile, so every K/V page is read once per kv head. It walks
its share of the slot's pages a block of ``pages_per_block`` pages at a time, with an online
softmax; the splits' partial results (out, max, sum) are merged after the kernel in jnp
(flash-decoding):

    page_table[s] = [ 7  3 | 9  4 || 2  8 | 0  0 ]    page_size 4, seq_len 21: 6 pages used
                     blk 0   blk 1    blk 0   blk 1      pages_per_block 2, pages_per_split 4
                     <--- split 0 -->  <--- split 1 -->
    split 0 runs blocks 0, 1; split 1 runs block 0 only (its trip count depends on seq_len).
    Tokens 21..23 of page 8 are masked; ids past the used pages are read as the null page 0.

With a sliding window of w keys a slot's walk starts at the page holding key seq_len - w, not
page 0, and the splits share only the pages a window can touch (at most ceil((w - 1) /
page_size) + 1), so a step costs the window, not the context:

    page_size 4, seq_len 21, w 6: keys 15..20 -> walk pages 3 (key 15 on), 4, 5 of the row

Triton lowering rules this code keeps (interpret mode checks none of them): static grid, no
scalar prefetch, no scratch, power-of-two load shapes, tl.dot operands >= 16 on every side.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.reference import FP8_POOL, cap_scores, check_options, widen

# Finite stand-in for -inf, as in the reference: rows with no valid key stay NaN-free.
MASK_VALUE = -1e30
# Logits are kept in base 2 (exp2 is cheaper than exp on GPUs): scale * log2(e) is folded in.
LOG2E = math.log2(math.e)
# tl.dot needs M, N, K >= 16: query rows and key blocks are padded up to it; a head_dim below it
# takes the elementwise path in `_scores` / `_weighted_values`.
MIN_DOT = 16
# Auto num_splits aims at about this many programs (2 per SM on a 132-SM H200).
_TARGET_PROGRAMS = 256
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_shape_problem(head_dim: int, page_size: int) -> str | None:
    """Why the Triton kernels cannot take this head_dim / page_size, or None: block shapes
    must be powers of two."""
    for name, value in (("head_dim", head_dim), ("page_size", page_size)):
        if not _is_power_of_2(value):
            return f"{name} {value} is not a power of two (Triton block shapes must be)"
    return None


# --- in-kernel pieces shared with prefill.py ------------------------------------------------


def block_page_ids(page_table_ref, first_page, pages_per_block, used_pages, num_pages):
    """Page ids of one block of a slot, read from its page-table row: ``[pages_per_block]``.

    Entries past the slot's used pages may be stale or padding: they become the null page 0 (their
    tokens are masked anyway), and every id is clipped into the pool, as jnp indexing in the
    reference does, so the gather never reads outside the pool.
    """
    ids = page_table_ref[pl.ds(first_page, pages_per_block)]  # [pages_per_block] int32
    index = first_page + jnp.arange(pages_per_block, dtype=jnp.int32)
    ids = jnp.where(index < used_pages, ids, 0)
    return jnp.minimum(jnp.maximum(ids, 0), num_pages - 1)


def _dot(a, b, contract):
    # HIGHEST: float32 tiles multiply in IEEE float32; Triton's default would be TF32 (about 1e-3
    # off). 16-bit tiles are unaffected.
    return lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _scores(q, k):
    """``q @ k.T`` in float32: q ``[rows, head_dim]``, k ``[block_k, head_dim]``."""
    if q.shape[1] >= MIN_DOT:
        return _dot(q, k, ((1,), (1,)))
    prod = q[:, None, :].astype(jnp.float32) * k[None, :, :].astype(jnp.float32)
    return prod.sum(axis=2)


def _weighted_values(p, v):
    """``p @ v`` in float32: p ``[rows, block_k]`` in v's dtype, v ``[block_k, head_dim]``."""
    if v.shape[1] >= MIN_DOT:
        return _dot(p, v, ((1,), (0,)))
    prod = p[:, :, None].astype(jnp.float32) * v[None, :, :].astype(jnp.float32)
    return prod.sum(axis=1)


def init_carry(rows: int, head_dim: int):
    """Empty online-softmax state: (out ``[rows, head_dim]``, max ``[rows]``, sum ``[rows]``)."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def attend_page_block(q, k_pages_ref, v_pages_ref, page_ids, kv_head, valid, written, carry,
                      qk_scale, soft_cap=None):
    """One online-softmax step of the query rows ``q`` over one block of pages.

    q: ``[rows, head_dim]``; page_ids: ``[pages_per_block]``; valid: ``[rows, block_k]`` bool;
    written: ``[block_k]`` bool, the keys before the sequence's length (the others' values
    count as zeros: a page's unwritten tail may hold a previous request's NaN, and a zero
    weight times NaN is NaN); carry: unnormalised out ``[rows, head_dim]``, running max
    ``[rows]`` (base-2 logits) and running sum ``[rows]``, all float32; soft_cap: the cap
    on the natural-log scores, or None.

    With a sliding window a row may meet keys before its window ahead of any key it sees (in
    prefill, a later query of a block walked from its earliest query's window): its max stays
    MASK_VALUE and each such key adds exp2(0) = 1 to its sums. Harmless: the row's own key
    comes later in the walk, and the correction exp2(MASK_VALUE - max) it brings is exactly 0.
    """
    o_prev, m_prev, l_prev = carry
    block_k = page_ids.shape[0] * k_pages_ref.shape[1]
    head_dim = k_pages_ref.shape[3]
    # Gather: [pages_per_block, page_size, head_dim] -> [block_k, head_dim]; the pool stays in
    # HBM (memory_space=ANY), only these pages are loaded.
    k = widen(k_pages_ref[page_ids, :, kv_head, :].reshape(block_k, head_dim), q.dtype)
    v = widen(v_pages_ref[page_ids, :, kv_head, :].reshape(block_k, head_dim), q.dtype)
    v = jnp.where(jnp.broadcast_to(written[:, None], v.shape), v, jnp.zeros_like(v))
    s = _scores(q, k) * qk_scale  # [rows, block_k]
    if soft_cap is not None:
        s = cap_scores(s, soft_cap * LOG2E)  # in base 2, as s is
    s = jnp.where(valid, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    correction = jnp.exp2(m_prev - m_next)  # [rows]
    p = jnp.exp2(s - m_next[:, None])  # [rows, block_k]
    l_next = correction * l_prev + p.sum(axis=1)
    o_next = correction[:, None] * o_prev + _weighted_values(p.astype(v.dtype), v)
    return o_next, m_next, l_next


def normalise(o, row_sum):
    """out / sum, with 0 for rows that saw no key (empty slots): ``[rows, head_dim]``."""
    return o / jnp.maximum(row_sum, 1e-30)[:, None]


def check_lengths(name: str, array: jax.Array, shape: tuple[int, ...]) -> None:
    """An int32 array of per-row (or per-query) lengths or positions has `shape`."""
    if array.shape != shape or array.dtype != jnp.int32:
        raise ValueError(f"{name} is {array.dtype}{list(array.shape)}, expected "
                         f"int32{list(shape)}")


def check_paged_inputs(q_heads, q_head_dim, q_dtype, k_pages, v_pages, page_table, batch,
                       kernel: bool = True):
    """Shape and dtype checks shared by decode and prefill (and, with kernel=False, the XLA
    twins in blocked.py, which take any block shape and a pool dtype other than q's);
    ValueError names the values."""
    if batch < 1:
        raise ValueError(f"q has {batch} rows, expected at least 1")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages has shape {k_pages.shape}, expected "
            "[num_pages, page_size, num_kv_heads, head_dim]"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages has shape {v_pages.shape}, not k_pages' {k_pages.shape}")
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    if min(k_pages.shape) < 1:
        raise ValueError(f"k_pages has shape {k_pages.shape}, expected no empty dimension")
    if q_dtype not in _DTYPES:
        raise ValueError(f"q has dtype {q_dtype}, expected float32, bfloat16 or float16")
    # the XLA twins take a float32 pool under 16-bit queries (the CPU's kv_cache_dtype); the
    # kernels q's dtype or 8-bit floats
    if kernel and (k_pages.dtype not in (q_dtype, FP8_POOL) or v_pages.dtype != k_pages.dtype):
        raise ValueError(
            f"k_pages/v_pages have dtypes {k_pages.dtype}/{v_pages.dtype}, not q's {q_dtype}"
        )
    if q_heads % num_kv_heads:
        raise ValueError(
            f"q has {q_heads} heads, not a multiple of k_pages' {num_kv_heads} kv heads"
        )
    if q_head_dim != head_dim:
        raise ValueError(f"q has head_dim {q_head_dim}, k_pages has {head_dim}")
    problem = kernel_shape_problem(head_dim, page_size) if kernel else None
    if problem:
        raise ValueError(problem)
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
        raise ValueError(
            f"page_table has shape {page_table.shape}, expected [{batch}, pages_per_seq]"
        )
    if page_table.dtype != jnp.int32:
        raise ValueError(f"page_table has dtype {page_table.dtype}, expected int32")


def check_power_of_2(name: str, value: int) -> None:
    if not isinstance(value, int) or not _is_power_of_2(value):
        raise ValueError(f"{name} is {value!r}, expected a power of two")


def compiler_params(num_warps: int, num_stages: int, interpret: bool):
    """Triton compiler params (they also select the Triton lowering on CUDA); None in interpret."""
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# --- decode -------------------------------------------------------------------------------


def _decode_kernel(
    q_ref,  # [group_pad, head_dim]   the query heads of this kv head, zero-padded
    k_pages_ref,  # [num_pages, page_size, num_kv_heads, head_dim]   whole pool, in HBM
    v_pages_ref,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ref,  # [padded_pages]   this slot's row
    seq_len_ref,  # [1]
    o_ref,  # [group_pad, head_dim]   this split's normalised out
    m_ref,  # [group_pad]   this split's max (base-2 logits)
    l_ref,  # [group_pad]   this split's sum of exp2(logit - max)
    *,
    qk_scale: float,
    pages_per_block: int,
    pages_per_split: int,
    pages_per_seq: int,
    sliding_window: int | None,
    soft_cap: float | None,
):
    kv_head, split = pl.program_id(1), pl.program_id(2)
    num_pages, page_size = k_pages_ref.shape[:2]
    rows, head_dim = q_ref.shape
    block_k = pages_per_block * page_size

    seq_len = jnp.minimum(seq_len_ref[0], pages_per_seq * page_size)
    used_pages = pl.cdiv(seq_len, page_size)
    first_page = split * pages_per_split
    if sliding_window is not None:
        # the query (at seq_len - 1) sees keys from window_start on; the splits share the
        # pages from the one holding it
        window_start = jnp.maximum(seq_len_ref[0] - sliding_window, 0)
        first_page += window_start // page_size
    end_page = jnp.minimum(used_pages, first_page + pages_per_split)
    num_blocks = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)

    q = q_ref[...]

    def body(i, carry):
        start_page = first_page + i * pages_per_block
        ids = block_page_ids(page_table_ref, start_page, pages_per_block, used_pages, num_pages)
        tokens = start_page * page_size + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        written = tokens < seq_len
        seen = written
        if sliding_window is not None:
            seen &= tokens >= window_start
        valid = jnp.broadcast_to(seen[None, :], (rows, block_k))
        return attend_page_block(q, k_pages_ref, v_pages_ref, ids, kv_head, valid, written, carry,
                                 qk_scale, soft_cap)

    o, row_max, row_sum = lax.fori_loop(0, num_blocks, body, init_carry(rows, head_dim))
    o_ref[...] = normalise(o, row_sum).astype(o_ref.dtype)
    m_ref[...] = row_max
    l_ref[...] = row_sum


def _decode_call(
    q,  # [S, num_kv_heads, group_pad, head_dim]
    k_pages,
    v_pages,
    page_table,  # [S, num_splits * pages_per_split] int32
    seq_lens,  # [S] int32
    *,
    qk_scale: float,
    pages_per_block: int,
    num_splits: int,
    pages_per_split: int,
    pages_per_seq: int,
    sliding_window: int | None,
    soft_cap: float | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Runs the kernel over grid (slot, kv head, split); returns per-split (out, max, sum)."""
    slots, num_kv_heads, rows, head_dim = q.shape
    padded_pages = page_table.shape[1]
    kernel = functools.partial(
        _decode_kernel,
        qk_scale=qk_scale,
        pages_per_block=pages_per_block,
        pages_per_split=pages_per_split,
        pages_per_seq=pages_per_seq,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    split_shape = (num_splits, slots, num_kv_heads, rows)
    return pl.pallas_call(
        kernel,
        grid=(slots, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, k: (s, h, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec((None, padded_pages), lambda s, h, k: (s, 0)),
            pl.BlockSpec((1,), lambda s, h, k: (s,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, k: (k, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, head_dim), q.dtype),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        ],
        compiler_params=compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="paged_decode_attention",
    )(q, k_pages, v_pages, page_table, seq_lens)


def _merge_splits(o, row_max, row_sum):
    """Flash-decoding merge: o ``[splits, ..., head_dim]``, row_max and row_sum ``[splits, ...]``
    -> ``[..., head_dim]`` float32."""
    # [splits, ...]: each split's share of the softmax denominator; 0 for splits that saw no key
    weight = jnp.exp2(row_max - row_max.max(axis=0)) * row_sum
    total = (weight[..., None] * o.astype(jnp.float32)).sum(axis=0)
    return total / jnp.maximum(weight.sum(axis=0), 1e-30)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "pages_per_block",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "sliding_window",
        "soft_cap",
    ),
)
def decode_attention(
    q: jax.Array,  # [S, num_heads, head_dim]   one query per slot, at position seq_lens - 1
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: jax.Array,  # [S, pages_per_seq] int32
    seq_lens: jax.Array,  # [S] int32   0 for an empty slot
    scale: float,
    *,
    pages_per_block: int = 8,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [S, num_heads, head_dim]
    """Paged decode attention; same contract as ``decode_attention_ref``.

    pages_per_block: pages per loop step (a power of two); raised so a key block has >= 16
    tokens, lowered to the table's width. num_splits: sequence splits per (slot, kv head);
    None picks about 256 programs in all. num_warps, num_stages: Triton's. interpret: run on
    the CPU through the Pallas interpreter. scale is static (a Python float). Empty slots give
    zeros. sliding_window, soft_cap: as in ``reference.py`` (static); with a window a slot walks
    only the pages its window touches.
    """
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}, expected [slots, num_heads, head_dim]")
    slots, num_heads, head_dim = q.shape
    check_paged_inputs(num_heads, head_dim, q.dtype, k_pages, v_pages, page_table, slots)
    if seq_lens.shape != (slots,) or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"seq_lens is {seq_lens.dtype}{list(seq_lens.shape)}, expected int32[{slots}]"
        )
    check_power_of_2("pages_per_block", pages_per_block)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits is {num_splits!r}, expected a positive int or None")
    check_options(sliding_window, soft_cap)

    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    # the pages one slot's walk covers: all of its table, or as many as w keys can touch
    walk_pages = pages_per_seq
    if sliding_window is not None:
        walk_pages = min(pages_per_seq, pl.cdiv(sliding_window + page_size - 1, page_size))
    pages_per_block = max(
        min(pages_per_block, next_power_of_2(walk_pages)), MIN_DOT // page_size, 1
    )
    num_blocks = pl.cdiv(walk_pages, pages_per_block)
    if num_splits is None:
        num_splits = _TARGET_PROGRAMS // (slots * num_kv_heads)
    num_splits = max(1, min(num_splits, num_blocks))
    pages_per_split = pl.cdiv(num_blocks, num_splits) * pages_per_block
    num_splits = pl.cdiv(walk_pages, pages_per_split)  # no split left without pages
    padded_pages = num_splits * pages_per_split
    if sliding_window is not None:
        # a walk from its window's first page (any page) reads up to a block past its last
        padded_pages = max(padded_pages, pages_per_seq + pages_per_block - 1)

    # q: [S, H, D] -> [S, kv_heads, group_pad, D]; the pad rows are zeros and are dropped below.
    group_pad = max(next_power_of_2(group), MIN_DOT)
    q4 = q.reshape(slots, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    table = jnp.pad(page_table, ((0, 0), (0, padded_pages - pages_per_seq)))

    o, row_max, row_sum = _decode_call(
        q4,
        k_pages,
        v_pages,
        table,
        seq_lens,
        qk_scale=float(scale) * LOG2E,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        pages_per_split=pages_per_split,
        pages_per_seq=pages_per_seq,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    o, row_max, row_sum = o[..., :group, :], row_max[..., :group], row_sum[..., :group]
    # [S, kv_heads, group, D]; one split's out is already normalised
    out = o[0] if num_splits == 1 else _merge_splits(o, row_max, row_sum)
    return out.reshape(slots, num_heads, head_dim).astype(q.dtype)
