"""Stop strings found in time linear in the new text, however many a request has.

The strings are indexed once per request by length: a set of the strings of each length.
A character the text gains can only complete a stop string that ends there, so it looks up
the text's suffix of each length in that length's set: work per new character grows with
the number of distinct lengths (at most the longest string's length), not with the number
of strings. Among strings completed at the same character, the one listed first wins, as
vLLM's scan in list order does for a single match.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._order = {}
        for i, stop in enumerate(stops):
            if stop:
                self._order.setdefault(stop, i)
        by_length: dict[int, set[str]] = {}
        for stop in self._order:
            by_length.setdefault(len(stop), set()).add(stop)
        self._lengths = sorted(by_length)
        self._sets = [by_length[n] for n in self._lengths]
        self.max_length = self._lengths[-1] if self._lengths else 0

    def find(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """The first stop string that ends in the last ``new_chars`` characters of text, as
        (its start index, the string), or None."""
        if not self._lengths:
            return None
        for end in range(max(len(text) - new_chars, 0) + 1, len(text) + 1):
            found = None
            for n, strings in zip(self._lengths, self._sets):
                if n > end:
                    break
                piece = text[end - n : end]
                if piece in strings and (found is None or self._order[piece] < self._order[found]):
                    found = piece
            if found is not None:
                return end - len(found), found
        return None
