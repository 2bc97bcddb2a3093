"""A draft-length policy for tests that must meet drafts on every step."""

from __future__ import annotations

from lightinfer.engine.spec.policy import DraftPolicy, longest_within


class AlwaysDraft(DraftPolicy):
    """Every sequence verifies all the drafts it has, whatever the step costs (the real policy's choices are
    tested on their own in ``test_spec_units.py``)."""

    def choose(self, num_seqs: int, avail: list[tuple[int, int]], max_rows: int = 1 << 30) -> int:
        return longest_within(num_seqs, [n for _, n in avail], self.max_drafts, max_rows)
