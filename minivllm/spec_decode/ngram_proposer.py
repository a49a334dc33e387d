"""Prompt lookup: propose the tokens that followed an earlier occurrence of the last n-gram.

Text that repeats what the context already holds (code being edited, a quoted document, a
list echoed back) continues as it did before; each accepted proposal is a token the model
did not need a step of its own for. Nothing is learned: the proposal is a lookup.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to k (or max_tokens) tokens to follow token_ids: those after the latest earlier
        occurrence of its last n tokens, for the longest n in [min_n, max_n] that has one;
        none when no suffix of that length occurs before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        # Windows that start before the suffix's own start and have a token after them.
        history = token_ids[:-1]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n :]
            windows = sliding_window_view(history, n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the tokens that followed the latest occurrence
                return token_ids[start : start + k].tolist()
        return []
