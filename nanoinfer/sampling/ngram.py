"""N-gram prompt lookup: propose the tokens that followed the last occurrence of the sequence's own ending.

A model that rewrites, extracts from or edits its prompt copies long runs of it; a sequence
whose last n tokens already occurred earlier (in the prompt or its output so far) will likely
continue as it did then. No model runs: the proposal costs one pass over the token ids.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens: what followed the latest earlier occurrence of the sequence's last n
    tokens, for the longest n in [n_min, n_max] that occurs (none: no proposal). `tokens`: the
    sequence so far, int64."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at 0 .. length-1-n: each is followed by at least one token.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
