"""Draft tokens for speculative decoding by n-gram lookup in the request's own tokens (prompt lookup).

Reasoning and code outputs often repeat spans of the prompt or of themselves; the continuation of the
latest earlier occurrence of the sequence's last n tokens is a free draft. The index maps every n-gram
(n_min..n_max) to where its latest continuation starts and is updated as tokens arrive (O(n_max) per
token), so proposing costs a few dict lookups whatever the length.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}
        """n-gram -> index of the token that followed its latest occurrence."""

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            i = len(self.tokens)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self.latest[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(self.tokens)), self.n_min - 1, -1):
            start = self.latest.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + k]
        return []
