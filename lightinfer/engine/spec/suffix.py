"""Suffix drafts (after SuffixDecoding, Oliaro et al., arXiv 2411.04975): the most frequent continuation of the
sequence's last tokens, counted over its own prompt and output and over the recent outputs of every request,
as long as that continuation stays likely.

Two counts of "token t followed the context c" for every context of 1 .. ``max_depth`` tokens::

    own:     this sequence's prompt and output so far (grown as tokens arrive)
    shared:  the outputs (and prompts) of the last ``max_cached_requests`` finished sequences, oldest dropped
             first; what an agent loop repeats across requests (tool calls, the same JSON, the same code)

A draft grows one token at a time: for the longest context (own counts first, then shared) whose counts exist,
its most frequent next token ``t`` with share ``p = count(t) / count(all)``; the draft's score is the product of
the shares so far, and it stops when the score falls below ``min_token_prob`` or ``k`` tokens are drafted. A
pattern seen once with one continuation has share 1 and is followed to the end: the adaptive length of
SuffixDecoding, from counts instead of a suffix tree (each step is ``max_depth`` dict lookups).
"""

from __future__ import annotations

from collections import OrderedDict


class ContinuationCounts:
    """How often each token followed each context of 1 .. ``max_depth`` tokens, over the sequences added.

    Args:
        max_depth: the longest context counted.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: list[int], start: int = 0, sign: int = 1) -> None:
        """Count (``sign=-1``: uncount) each token from position ``start`` after each of its contexts."""
        counts = self._counts
        for j in range(max(start, 1), len(tokens)):
            nxt = tokens[j]
            for n in range(1, min(self.max_depth, j) + 1):
                ctx = tuple(tokens[j - n:j])
                row = counts.get(ctx)
                if row is None:
                    if sign < 0:
                        continue
                    row = counts[ctx] = {}
                left = row.get(nxt, 0) + sign
                if left > 0:
                    row[nxt] = left
                else:
                    row.pop(nxt, None)
                    if not row:
                        del counts[ctx]

    def best(self, tokens: list[int]) -> tuple[int, float, int] | None:
        """``(next token, its share, context length)`` for the longest context ending ``tokens`` that has counts;
        None when none has."""
        for n in range(min(self.max_depth, len(tokens)), 0, -1):
            row = self._counts.get(tuple(tokens[-n:]))
            if row:
                token, count = max(row.items(), key=lambda kv: kv[1])
                return token, count / sum(row.values()), n
        return None

    def __len__(self) -> int:
        return len(self._counts)


class SuffixProposer:
    """Suffix drafts for every running sequence (module docstring).

    Args:
        max_depth: longest context matched.
        max_cached_requests: finished sequences whose outputs stay counted in the shared counts.
        min_token_prob: the lowest score (product of the drafted tokens' shares) a draft is extended at.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.max_depth, self.max_cached, self.min_prob = max_depth, max_cached_requests, min_token_prob
        self.shared = ContinuationCounts(max_depth)
        # seq_id -> (its output with the prompt's last tokens before it, where the counted tokens start)
        self._cached: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        # seq_id -> (its counts, its token list (the sequence's own, growing), tokens counted, prompt length)
        self._own: dict[int, list] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int, num_prompt_tokens: int = 0) -> list[int]:
        """Up to ``k`` drafts continuing ``tokens``, the sequence ``seq_id`` so far (its list itself: at the
        sequence's end its output joins the shared counts from it); ``num_prompt_tokens`` of them are its
        prompt, counted for itself only."""
        own = self._own.get(seq_id)
        if own is None:
            own = self._own[seq_id] = [ContinuationCounts(self.max_depth), tokens, 0, num_prompt_tokens]
        counts = own[0]
        counts.add(tokens, own[2])
        own[1], own[2] = tokens, len(tokens)
        drafts: list[int] = []
        context = tokens[-self.max_depth:]
        score = 1.0
        while len(drafts) < k:
            mine, theirs = counts.best(context), self.shared.best(context)
            pick = mine if mine is not None and (theirs is None or mine[2] >= theirs[2]) else theirs
            if pick is None or score * pick[1] < self.min_prob:
                break
            score *= pick[1]
            drafts.append(pick[0])
            context = (context + [pick[0]])[-self.max_depth:]
        return drafts

    def keep_only(self, seq_ids: set[int]) -> None:
        """Sequences not in ``seq_ids`` have finished: their outputs join the shared counts (the oldest cached
        ones leave them beyond ``max_cached_requests``) and their own counts are dropped."""
        for gone in set(self._own) - seq_ids:
            _, tokens, _, prompt_len = self._own.pop(gone)
            lead = min(prompt_len, self.max_depth)  # the prompt's last tokens: the output's first contexts
            output = list(tokens[prompt_len - lead:])
            if self.max_cached <= 0 or len(output) <= lead:
                continue
            self.shared.add(output, lead)
            self._cached[gone] = (output, lead)
            while len(self._cached) > self.max_cached:
                _, (old, start) = self._cached.popitem(last=False)
                self.shared.add(old, start, sign=-1)

    def __len__(self) -> int:
        return len(self._own)
