"""What a request's penalties touch: the distinct tokens of its prompt and output.

Repetition penalty applies to every token of the prompt and the output, presence and
frequency penalties to the output's tokens by count. A request sees a few hundred distinct
tokens of a vocabulary of tens of thousands, so the sampler gathers and scatters just those
(row, token) pairs instead of building [batch, vocab] counts every step. The set is built
from the prompt once, then grows by the one token a step adds.
"""

from __future__ import annotations

import numpy as np


class SeenTokens:
    """One request's distinct prompt and output tokens, and how often the output has each."""

    def __init__(self, prompt_ids: list[int]) -> None:
        unique = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        capacity = max(64, 2 * len(unique))
        self._ids = np.empty(capacity, dtype=np.int64)
        self._ids[: len(unique)] = unique
        self._counts = np.zeros(capacity, dtype=np.float32)
        self._position = {token: i for i, token in enumerate(unique.tolist())}
        self._size = len(unique)
        self._outputs_counted = 0

    def update(self, output_ids: list[int]) -> None:
        """Count the output tokens added since the last call (usually one)."""
        for token in output_ids[self._outputs_counted :]:
            i = self._position.get(token)
            if i is None:
                i = self._size
                if i == len(self._ids):  # full: double both arrays
                    self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._ids[i] = token
                self._position[token] = i
                self._size += 1
            self._counts[i] += 1
        self._outputs_counted = len(output_ids)

    @property
    def token_ids(self) -> np.ndarray:
        return self._ids[: self._size]

    @property
    def output_counts(self) -> np.ndarray:
        return self._counts[: self._size]
