"""A draft-length policy for tests that must meet drafts on every step."""

from __future__ import annotations

from lightinfer.engine.spec.policy import DraftPolicy


class AlwaysDraft(DraftPolicy):
    """Every sequence verifies all the drafts it has, whatever the step costs (the real policy's choices are
    tested on their own in ``test_spec_units.py``)."""

    def choose(self, num_seqs: int, avail: list[tuple[int, int]], max_rows: int = 1 << 30) -> int:
        k = self.max_drafts
        while k and num_seqs + sum(min(k, n) for _, n in avail) > max_rows:
            k -= 1
        return k
