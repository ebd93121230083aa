"""Prompt lookup (vLLM's `ngram` method): propose the tokens that followed the latest earlier
occurrence of the context's last n tokens, the longest n first.

    context  ... a b c d e ... x y a b c | ?        n = 3: "a b c" occurred before,
                     ^^^^^ followed by "d e ..."   propose d e ... (up to k tokens)

Code edits, quoting, and extraction repeat their input: there the proposals are often right,
and a right run of k tokens costs one step instead of k. Host only (numpy).
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxserve.request import Request


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to `k` tokens for the request's next positions ([] when its last tokens occur
        nowhere earlier)."""
        if k <= 0:
            return []
        context = np.asarray(request.all_ids, np.int32)
        return propose_ngram(context, self.min_n, self.max_n, k)


def propose_ngram(context: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the latest earlier match of the longest suffix of `context` (n from
    max_n down to min_n) that has one; at most k, fewer where the context ends."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows that start early enough to be followed by a token: [0, length - n)
        windows = sliding_window_view(context[:length - 1], n)
        hits = np.flatnonzero((windows == context[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start:start + k].tolist()
    return []
