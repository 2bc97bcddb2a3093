"""Prompt-lookup drafts: the continuation of the longest recent match of a sequence's last tokens in its own
prompt and output (Saxena's prompt lookup decoding; vLLM's ``method: "ngram"``).

Each sequence keeps an index, grown as tokens arrive (O(n-gram lengths) per token, never a rescan)::

    index[n][tokens[j - n : j]] = j      the latest position j whose preceding n tokens are that n-gram
                                         (registered once tokens[j] exists: the match has a continuation)
    propose: for n = max .. min:  j = index[n].get(last n tokens)  ->  tokens[j : j + k]

The latest occurrence wins: in code edits and agent loops the most recent copy is the one being repeated.
"""

from __future__ import annotations


class NgramIndex:
    """One sequence's n-gram index (module docstring).

    Args:
        min_n / max_n: the shortest and longest n-gram matched (1 <= min_n <= max_n).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # positions j < _indexed are registered

    def update(self, tokens: list[int]) -> None:
        """Register the positions that gained a continuation since the last call (``tokens`` only grows)."""
        for j in range(max(self._indexed, self.min_n), len(tokens)):
            for n, index in self._index.items():
                if j >= n:
                    index[tuple(tokens[j - n:j])] = j
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``tokens`` (the sequence so far), or [] when its last
        ``min_n`` tokens occurred nowhere before. Calls :meth:`update` first."""
        self.update(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            j = self._index[n].get(tuple(tokens[length - n:]))
            if j is not None:
                return tokens[j:j + k]
        return []


class NgramProposer:
    """Drafts for every running sequence, each from its own :class:`NgramIndex`.

    Args:
        min_n / max_n: ``prompt_lookup_min`` / ``prompt_lookup_max``.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int, num_prompt_tokens: int = 0) -> list[int]:
        """Up to ``k`` drafts for sequence ``seq_id`` whose tokens are ``tokens`` (prompt and output alike)."""
        if k <= 0:  # nothing to draft, and a sequence's index serves only itself
            return []
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        return index.propose(tokens, k)

    def keep_only(self, seq_ids: set[int]) -> None:
        """Drop the indexes of sequences not in ``seq_ids`` (finished, aborted)."""
        for gone in set(self._indexes) - seq_ids:
            del self._indexes[gone]

    def __len__(self) -> int:
        return len(self._indexes)
