"""Paged attention for the TPU backend: JAX's own Pallas TPU kernel, `ragged_paged_attention`.

The kernel keeps K and V in one pool, interleaved over the head axis, and the TPU backend stores
its cache in that layout, so no step copies the pool into another one:

    kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]
    head axis: K0 V0 K1 V1 ... K(n-1) V(n-1)     (K of kv head h at 2h, its V at 2h + 1)

Token j of row b sits at page ``page_table[b, j // page_size]``, offset ``j % page_size``, as in
the rest of jaxserve; page 0 is the null page. The kernel takes ragged queries: the rows' new
tokens packed one after another, row b's at ``q[query_starts[b]:query_starts[b + 1]]``, the last
ones of its sequence (decode rows have one, prefill chunks many, in one call):

    q:            [ r0 r0 r0 | r1 | r2 r2 | pad pad ]     query_starts = [0, 3, 4, 6]
    causal mask:  query i of row b sits at position seq_lens[b] - query_lens[b] + i

sliding_window and soft_cap go to the kernel's own parameters of those names, whose semantics
(JAX 0.10.2, and its `ref_ragged_paged_attention`) are jaxserve's: key j is masked for the query
at p when p - w >= j, and the scaled score s becomes soft_cap * tanh(s / soft_cap) before the
mask. The kernel walks every row from its first page even so; `ragged_attention` drops the
pages before the row's first window from its table and length, which shifts every position by
the same count and so changes no mask (they compare positions only with each other):

    page_size 4, w 3, one query at 13 (keys 11..13): table [a b c d ..] len 14 -> [c d ..] len 6,
    the query at 5 (keys 3..5)

Interpret mode (`interpret=True`, the CPU): the kernel runs through Pallas's HLO interpreter,
which in JAX 0.10.2 needs two allowances, each explained where it is made: one fix to a
discharge rule (`_fix_masked_store_discharge`) and one grid step per call (`_interpret_call`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

from pallas_kernels.reference import check_options

# The dtypes the kernel's loads take: its query fold asserts float32 or bfloat16, and 8-bit
# pools need k_scale / v_scale, which jaxserve does not pass.
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The kernel's own kv pages per block where it has no tuned table for the chip.
_UNTUNED_PAGES_PER_BLOCK = 128


LANES = 128  # the kernel's lane width: head_dim a multiple of it


def lane_padded(head_dim: int) -> int:
    """The head_dim a pool holds for a model's `head_dim` with every head padded with zeros to
    whole lanes (64 -> 128): queries and keys padded with zeros give the same scores, values
    padded give outputs whose padding is zero and is cut off."""
    return -(-head_dim // LANES) * LANES


def shape_problem(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                  dtype) -> str | None:
    """Why the kernel cannot take this model / page shape, in plain words, or None.

    The rules are the kernel's own (JAX 0.10.2), checked here before any trace so that a server
    refuses a model at start-up with a reason rather than failing inside a compile."""
    dtype = jnp.dtype(dtype)
    if dtype not in _DTYPES:
        return f"dtype {dtype.name} is not float32 or bfloat16 (the kernel's loads take only these)"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if head_dim % 128:
        # its softmax state is kept 128 lanes wide and broadcast onto head_dim
        return f"head_dim {head_dim} is not a multiple of 128 (the kernel's lane width)"
    if page_size < 1:
        return f"page_size {page_size} is not positive"
    # the pool's head axis (K and V of every kv head) must fill whole TPU tiles: counted in
    # 32-bit words (two bfloat16 per word), 1, 2, 4, 8 or a multiple of 8 of them
    words = 2 * num_kv_heads * dtype.itemsize // 4
    if not (words in (1, 2, 4, 8) or words % 8 == 0):
        allowed = ("1, 2, 4 or a multiple of 4" if dtype.itemsize == 4
                   else "1, 2, 4, 8 or a multiple of 8")
        return (f"num_kv_heads {num_kv_heads} does not tile the pool's K/V head axis for "
                f"{dtype.name} (the kernel takes {allowed} kv heads)")
    return None


def kv_pages_zeros(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype
) -> jax.Array:  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    """One layer's empty pool in the kernel's combined layout (K and V interleaved by head)."""
    return jnp.zeros((num_pages, page_size, 2 * num_kv_heads, head_dim), dtype)


def write_kv(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [N, num_kv_heads, head_dim]   new keys
    v: jax.Array,  # [N, num_kv_heads, head_dim]   new values
    page: jax.Array,  # [N] int32   padding tokens: the null page 0
    offset: jax.Array,  # [N] int32
) -> jax.Array:  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    """Scatter new K and V at (page, offset), interleaved as the kernel reads them.

    The new tokens are interleaved first (small); the pool is indexed directly, with no reshape
    around the scatter, so that under donation XLA writes into the pool in place."""
    n, num_kv_heads, head_dim = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(n, 2 * num_kv_heads, head_dim)
    return kv_pages.at[page, offset].set(kv.astype(kv_pages.dtype))


def _tuned_block_sizes(q: jax.Array, kv_pages: jax.Array, pages_per_seq: int) -> tuple[int, int]:
    """(kv pages, queries) per block from JAX's tuned table, for the chip the call compiles
    for: the default device where one is set (a compile-only target's), else the first. The
    kernel's own lookup reads jax.devices()[0], which on a machine compiling for a TPU it does
    not have is a CPU. The rule is the kernel's: untuned shapes (128, 32); v4 (32, 32)."""
    device = jax.config.jax_default_device
    kind = getattr(device if isinstance(device, jax.Device) else jax.devices()[0],
                   "device_kind", "")
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    heads_q, combined_per_block = rpa.get_min_heads_per_blk(num_heads, combined, q.dtype,
                                                           kv_pages.dtype)
    key = tuned.simplify_key((q.dtype, kv_pages.dtype, heads_q, combined_per_block // 2,
                              head_dim, page_size, num_tokens, pages_per_seq))
    name = " ".join(kind.split()[:2])  # "TPU v5 lite" -> "TPU v5", the table's names
    pages, queries = (32, 32) if name == "TPU v4" else (
        tuned.TUNED_BLOCK_SIZES.get(name, {}).get(key, (128, 32)))
    return min(pages_per_seq, pages), min(num_tokens, queries)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_sizes",
                                             "sliding_window", "soft_cap"))
def ragged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]   rows' new tokens packed, then padding
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, pages_per_seq] int32
    query_starts: jax.Array,  # [B + 1] int32   row b's queries: [query_starts[b], [b + 1])
    seq_lens: jax.Array,  # [B] int32   tokens in the row's pages, its queries' included
    num_seqs: jax.Array | int,  # [] or [1] int32   rows past it are ignored
    scale: float,
    interpret: bool = False,
    block_sizes: tuple[int, int] | None = None,  # (kv pages, queries) per kernel block
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_heads, head_dim]
    """Causal attention of packed queries over their rows' pages, through the TPU kernel.

    Row b's n = query_starts[b + 1] - query_starts[b] queries are the last n of its
    seq_lens[b] tokens (n <= seq_lens[b] <= pages_per_seq * page_size, as the kernel needs;
    not checked, the values being traced). Tokens past the rows' queries (padding) and rows
    with no queries come out as zeros. block_sizes: None takes the kernel's tuned table, which
    exists on a TPU only; interpret mode uses (min(pages_per_seq, 128), T) and honours only the
    kv-page part (see `_interpret_call`). sliding_window, soft_cap: as in ``reference.py``
    (static), the kernel's own; with a window the pages before each row's first window are
    not walked (see the module's docstring).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    if combined % 2:
        raise ValueError(f"kv_pages has shape {kv_pages.shape}: its head axis holds K and V "
                         "interleaved, an even count")
    if problem := shape_problem(num_heads, combined // 2, head_dim, page_size, q.dtype):
        raise ValueError(problem)
    if kv_pages.dtype != q.dtype or kv_pages.shape[3] != head_dim:
        raise ValueError(f"kv_pages {kv_pages.shape} {kv_pages.dtype} does not match q "
                         f"{q.shape} {q.dtype}: same dtype and head_dim")
    rows = page_table.shape[0]
    if query_starts.shape != (rows + 1,) or seq_lens.shape != (rows,):
        raise ValueError(f"query_starts {query_starts.shape} and seq_lens {seq_lens.shape} do not "
                         f"fit page_table {page_table.shape}: [B + 1] and [B]")
    check_options(sliding_window, soft_cap)

    # Rows with no queries go after the live ones and out of num_seqs. The kernel prefetches
    # each row's first KV block while it finishes the row before; a row of seq_len 0 never
    # waits for its block, so the next row reads that block instead of its own (seen in
    # interpret mode: the row after an empty one came out wrong). Stable, so the live rows'
    # queries stay where they are in q.
    query_lens = query_starts[1:] - query_starts[:-1]  # [B]
    live = (query_lens > 0) & (jnp.arange(rows) < jnp.reshape(num_seqs, ()))
    order = jnp.argsort(~live, stable=True)
    live = live[order]
    query_lens = jnp.where(live, query_lens[order], 0)
    starts = query_starts[0] + jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
    # ids outside the pool are clipped, as jnp indexing in the reference does: the kernel's
    # DMA would read outside the pool
    table = jnp.clip(page_table[order], 0, kv_pages.shape[0] - 1).astype(jnp.int32)
    kv_lens = jnp.where(live, seq_lens[order], 0).astype(jnp.int32)
    if sliding_window is not None:
        # the pages wholly before the window of the row's first query, dropped: its table
        # starts later, its length is shorter by as many tokens (at least its queries remain)
        first_key = jnp.maximum(kv_lens - query_lens - sliding_window + 1, 0)  # [B]
        skip = first_key // page_size
        column = skip[:, None] + jnp.arange(table.shape[1], dtype=jnp.int32)
        table = jnp.take_along_axis(table, column, axis=1, mode="clip")
        kv_lens = kv_lens - skip * page_size
    args = (q, kv_pages, kv_lens, table, starts.astype(jnp.int32),
            jnp.sum(live, dtype=jnp.int32)[None])
    options = {"sm_scale": scale, "sliding_window": sliding_window, "soft_cap": soft_cap}
    if interpret:
        out = _interpret_call(*args, options=options, block_sizes=block_sizes)
    else:
        pages, queries = block_sizes or _tuned_block_sizes(q, kv_pages, table.shape[1])
        out = rpa.ragged_paged_attention(*args, **options, num_kv_pages_per_block=pages,
                                         num_queries_per_block=queries)
    # the kernel leaves tokens past the last row's queries as its scratch held them
    token = jnp.arange(num_tokens)
    real = (token >= starts[0]) & (token < starts[-1])
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_sizes",
                                             "sliding_window", "soft_cap"))
def padded_attention(
    q: jax.Array,  # [B, C, num_heads, head_dim]   C = 1: decode; C > 1: prefill chunks
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    page_table: jax.Array,  # [B, pages_per_seq] int32
    positions: jax.Array,  # [B, C] int32   absolute position of each query (not read, see below)
    query_lens: jax.Array,  # [B] int32   real queries in the row, the rest padding; 0: empty
    seq_lens: jax.Array,  # [B] int32   positions[:, 0] + query_lens
    scale: float,
    interpret: bool = False,
    block_sizes: tuple[int, int] | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, C, num_heads, head_dim]
    """The padded step's attention (one layout for decode and prefill chunks) through the
    ragged kernel: the rows' real queries are packed to the front, padding to the back, and
    the result is put back in place. Padding queries and empty rows give zeros.

    The kernel places a row's queries at the end of its sequence, so positions is implied by
    seq_lens and query_lens (positions[b, c] = seq_lens[b] - query_lens[b] + c, which is what
    a padded step holds); it is taken so the call reads as the other backends' calls do.
    """
    del positions
    batch, chunk, num_heads, head_dim = q.shape
    query_lens = jnp.clip(query_lens, 0, chunk)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(query_lens, dtype=jnp.int32)])
    # where each (row, query) goes in the packed q: real ones after their row's start, padding
    # after all the real ones, in order: a permutation of [0, B * C)
    c = jnp.arange(chunk, dtype=jnp.int32)
    real = (c[None, :] < query_lens[:, None]).reshape(-1)  # [B * C]
    pad_rank = jnp.cumsum(~real, dtype=jnp.int32) - 1
    dest = jnp.where(real, (starts[:-1, None] + c[None, :]).reshape(-1), starts[-1] + pad_rank)
    packed = q.reshape(batch * chunk, num_heads, head_dim)[jnp.argsort(dest)]
    out = ragged_attention(packed, kv_pages, page_table, starts, seq_lens, batch, scale=scale,
                           interpret=interpret, block_sizes=block_sizes,
                           sliding_window=sliding_window, soft_cap=soft_cap)
    return out[dest].reshape(q.shape)


def _interpret_call(
    q: jax.Array,  # [T, num_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [B] int32
    page_table: jax.Array,  # [B, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    options: dict,
    block_sizes: tuple[int, int] | None,
) -> jax.Array:  # [T, num_heads, head_dim]
    """The kernel through Pallas's HLO interpreter (JAX 0.10.2), in calls of one grid step.

    The kernel carries its place (row, KV buffer) from one grid step to the next in a scalar
    prefetch ref that it writes; the interpreter passes those refs to each step afresh and
    drops the writes, so a step after the first may wait on the wrong buffer (seen: wrong
    output in the second head block, and in the second query block after a row of an odd
    number of KV blocks). One query block of all T tokens, and one call per head block
    (the kernel's smallest, `get_min_heads_per_blk`), make every call a single grid step. The
    kernel's math, its KV-block walk and its in-step prefetch chain all run; its hand-over
    between grid steps is what a TPU alone can check.
    """
    _fix_masked_store_discharge()
    num_tokens, num_heads, _ = q.shape
    pages = min(page_table.shape[1], _UNTUNED_PAGES_PER_BLOCK) if block_sizes is None else (
        block_sizes[0])
    heads, combined = rpa.get_min_heads_per_blk(num_heads, kv_pages.shape[2], q.dtype,
                                                kv_pages.dtype)
    outs = []
    # True (not InterpretParams): the HLO interpreter. The TPU simulator that InterpretParams
    # selects fails on this kernel's reshape of its KV buffer ('ReshapeTransform' object has no
    # attribute 'indices').
    with pltpu.force_tpu_interpret_mode(True):
        for g in range(num_heads // heads):
            outs.append(rpa.ragged_paged_attention(
                q[:, g * heads:(g + 1) * heads], kv_pages[:, :, g * combined:(g + 1) * combined],
                kv_lens, page_table, cu_q_lens, num_seqs, **options,
                num_kv_pages_per_block=pages, num_queries_per_block=num_tokens))
    return jnp.concatenate(outs, axis=1)


def _fix_masked_store_discharge() -> None:
    """Let JAX 0.10.2's HLO interpreter take a masked store into a ref indexed by a Python int.

    The kernel does ``pltpu.store(m_ref.at[kv_head], x, mask=...)`` for its softmax state. The
    store's discharge rule asks each index for ``.shape``, and a Python int traced into the
    kernel arrives as ``jax._src.literals.TypedInt``, which has none: "AttributeError:
    'TypedInt' object has no attribute 'shape'" (any kernel with such a store fails the same
    way). The wrapped rule hands such indices over as numpy int32 scalars, the same index with
    a shape. Installed once; a JAX without these internals is left as it is.
    """
    try:
        from jax._src.literals import TypedInt
        from jax._src.pallas.primitives import swap_p
        from jax._src.state.discharge import _discharge_rules
    except ImportError:
        return
    rule = _discharge_rules.get(swap_p)
    if rule is None or getattr(rule, "fixes_typed_int_index", False):
        return

    def as_index(x):
        return np.int32(x) if isinstance(x, TypedInt) else x

    def swap_discharge(in_avals, out_avals, *args, args_tree, **params):
        ref, transforms, val, mask = args_tree.unflatten(args)
        transforms = jax.tree.map(as_index, transforms)
        args, args_tree = jax.tree.flatten((ref, transforms, val, mask))
        return rule(in_avals, out_avals, *args, args_tree=args_tree, **params)

    swap_discharge.fixes_typed_int_index = True
    _discharge_rules[swap_p] = swap_discharge
