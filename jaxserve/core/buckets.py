"""How an iteration's rows are padded into compiled shapes: the runner's rule, shared with the
simulator's cost model so both split an iteration the same way (`prefill_calls`).

A call pads its rows to a row bucket and every row's tokens to the chunk bucket of its longest
row. One prefill call mixing a 200-token chunk with three 20-token chunks would compute 4 x 256
tokens for 260 real ones, so an iteration's prompt chunks are split into calls of similar length:

    sort the chunks by length; cut the sorted list at chunk-bucket boundaries so that
    sum over calls (padded rows x padded chunk + CALL_TOKENS) is smallest

A call's cost depends only on where it starts and ends in the sorted list, so the best cuts
come from a shortest path over the boundaries: O(boundaries^2) per iteration, however many
chunk buckets a config lists.
"""

import bisect
import itertools

# A call's fixed cost (dispatch, weights streamed once more, the sampler) in padded tokens'
# worth: merging two calls saves it, so small groups join their neighbour.
CALL_TOKENS = 64


def bucket(n: int, sizes: tuple[int, ...], what: str) -> int:
    """The smallest size >= n."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


def prefill_row_buckets(row_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Row buckets of a prefill call: the decode row buckets and 1. Decode rows start at 2 (XLA
    may fuse a lone one-token K/V write into a copy of the pool); a lone prompt chunk is a
    scatter of many tokens and runs as one row, which matters because a request joining a full
    batch is usually the iteration's only chunk."""
    return row_buckets if row_buckets[0] == 1 else (1, *row_buckets)


def prefill_shapes(chunk_buckets: tuple[int, ...], row_buckets: tuple[int, ...],
                   budget: int) -> list[tuple[int, int]]:
    """The (rows, chunk) buckets a budget-bound prefill call can land in (`row_buckets`: a
    prefill call's): its longest chunk is past the previous chunk bucket, its other rows past
    the previous row bucket, and every prompt chunk is at least 2 tokens (a 1-token row is a
    decode row)."""
    out = []
    for ci, c in enumerate(chunk_buckets):
        longest = max(2, chunk_buckets[ci - 1] + 1 if ci else 2)
        for bi, b in enumerate(row_buckets):
            rows = row_buckets[bi - 1] + 1 if bi else 1
            if longest + 2 * (rows - 1) <= budget:
                out.append((b, c))
    return out


def prefill_groups(lengths: list[int], row_buckets: tuple[int, ...],
                   chunk_buckets: tuple[int, ...]) -> list[list[int]]:
    """Indices into `lengths` (tokens per prompt chunk), one list per prefill call, shortest
    chunks first; within a call, in the order given. `row_buckets` are the call's (prefill)
    row buckets."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    keys = [bisect.bisect_left(chunk_buckets, lengths[i]) for i in order]
    # bucket boundaries, the only places a cut may go
    points = [0, *(j for j in range(1, len(order)) if keys[j] != keys[j - 1]), len(order)]
    # best[b] = (cost, calls) of the cheapest split of order[:points[b]]; fewer calls break ties
    best: list[tuple[int, int]] = [(0, 0)]
    last: list[int] = [0]  # where best[b]'s last call starts (an index into points)
    for b in range(1, len(points)):
        hi = points[b]
        chunk = bucket(lengths[order[hi - 1]], chunk_buckets, "chunk length")
        options = ((best[a][0] + bucket(hi - points[a], row_buckets, "prefill rows") * chunk
                    + CALL_TOKENS, best[a][1] + 1, a) for a in range(b))
        cost, calls, a = min(options)
        best.append((cost, calls))
        last.append(a)
    bounds, b = [len(order)], len(points) - 1
    while b:
        b = last[b]
        bounds.append(points[b])
    return [sorted(order[lo:hi]) for lo, hi in itertools.pairwise(reversed(bounds))]


def prefill_calls(lengths: list[int], alone: list[bool], row_buckets: tuple[int, ...],
                  chunk_buckets: tuple[int, ...]) -> list[list[int]]:
    """An iteration's prefill calls: indices into `lengths`, one list per call. A chunk marked
    `alone` (its request wants prompt logprobs) runs as a call of its own: the prompt-logprob
    step (logits at every position) is compiled for one row only, which keeps start-up short
    (the demo: 34 shapes instead of 54). The cost falls on workloads where every request wants
    them (log-likelihood evaluations): their chunks run one row per call, which a chunk of a few
    hundred tokens nearly pays for by itself. The rest are grouped by `prefill_groups`."""
    rest = [i for i, a in enumerate(alone) if not a]
    groups = prefill_groups([lengths[i] for i in rest], row_buckets, chunk_buckets)
    return [[i] for i, a in enumerate(alone) if a] + [[rest[j] for j in g] for g in groups]


# -- ragged prefill: an iteration's prompt chunks packed into one row of tokens -----------------

def ragged_token_buckets(chunk_buckets: tuple[int, ...], budget: int) -> tuple[int, ...]:
    """Token counts a ragged prefill call pads to: the chunk buckets below the token budget,
    then steps of 1.25x (multiples of 16) up to the budget. A call packs its rows with no
    padding between them, so only its total is rounded up."""
    sizes = [c for c in chunk_buckets if c < budget]
    t = sizes[-1] if sizes else 0
    while t < budget:
        t = max(t + 16, -(-t * 5 // 4 // 16) * 16)
        t = budget if t * 9 // 8 >= budget else t  # no bucket just below the budget
        sizes.append(t)
    return tuple(sizes)


def ragged_calls(lengths: list[int], token_buckets: tuple[int, ...],
                 max_rows: int) -> list[tuple[list[int], int]]:
    """An iteration's ragged prefill calls: (indices into `lengths`, in order; the call's token
    bucket), as few as the largest bucket and `max_rows` rows a call allow."""
    calls, start = [], 0
    while start < len(lengths):
        end, total = start, 0
        while (end < len(lengths) and end - start < max_rows
               and total + lengths[end] <= token_buckets[-1]):
            total += lengths[end]
            end += 1
        if end == start:
            raise ValueError(f"a prompt chunk of {lengths[start]} tokens exceeds the largest "
                             f"ragged bucket {token_buckets[-1]}")
        size = next(t for t in token_buckets if t >= total)
        calls.append((list(range(start, end)), size))
        start = end
    return calls
