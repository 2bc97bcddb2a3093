"""How many drafts to verify in a step: from the step costs this engine measures and the acceptance it sees,
never a fixed batch-size cliff.

A verify step runs each drafting sequence's ``k + 1`` tokens as rows of a decode step (``step_inputs.py``), so
its cost is that of a decode step of more rows, which the engine measures as it runs: ``cost(rows)``, the
moving average of the wall time of decode-only steps by their row count. With ``a_s`` the rate at which
sequence ``s`` has had its drafts accepted (per draft position, a running count with a prior from all
sequences), a step of ``b`` sequences drafting up to ``k`` each is expected to give::

    tokens(k) = b + sum_s sum_{j=1..min(k, avail_s)} a_s^j        rows(k) = b + sum_s min(k, avail_s)

and the policy takes the ``k`` in ``0 .. num_speculative_tokens`` with the most ``tokens(k) / cost(rows(k))``.
A row count not measured yet is estimated from its measured neighbours, or (above every measurement) as the
least-squares line through the measured ones (with a single measurement, that cost plus
:data:`PRIOR_ROW_SHARE` of it per extra row: optimistic, so that it is tried and then known). One decision in
:data:`EXPLORE_EVERY` with drafts that chose fewer than it could draws one more, to keep the next longer step's
cost measured as the machine's load changes. On a busy server, where a plain step's rows already
fill the hardware, extra rows cost what they take and speculation turns itself off.
"""

from __future__ import annotations

import math

PRIOR_ROW_SHARE = 0.05  # a decode step's rows are nearly free while its weights' reading dominates
EXPLORE_EVERY = 128
EMA = 0.2  # weight of a new step time in its row count's average
PRIOR_ACCEPTANCE = 0.5
PRIOR_TRIES = 4.0  # how many draft positions the prior counts for in a new sequence's acceptance


class DraftPolicy:
    """Chooses a step's draft length (module docstring).

    Args:
        max_drafts: ``num_speculative_tokens``.
    Attributes:
        costs: row count -> average seconds of a decode-only step of that many rows.
    """

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.costs: dict[int, float] = {}
        self._seen: set[int] = set()
        self._seq: dict[int, list[float]] = {}  # seq_id -> [accepted, tried] draft positions
        self._all = [0.0, 0.0]
        self._decisions = 0

    # ------------------------------------------------------------------ measurements
    def record_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows took ``seconds``. The first step of a row count is not counted: it
        is the one that records a CPU step or compiles a kernel for that shape."""
        if rows not in self._seen:
            self._seen.add(rows)
            return
        old = self.costs.get(rows)
        self.costs[rows] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def record_verify(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A sequence had ``accepted`` of its ``drafted`` drafts accepted: ``accepted`` positions passed, and one
        more was tried and failed unless all passed."""
        tried = accepted + (1 if accepted < drafted else 0)
        for counts in (self._seq.setdefault(seq_id, [0.0, 0.0]), self._all):
            counts[0] += accepted
            counts[1] += tried

    def forget(self, seq_ids: set[int]) -> None:
        """Keep the acceptance counts of ``seq_ids`` only (the running sequences)."""
        for gone in set(self._seq) - seq_ids:
            del self._seq[gone]

    def acceptance(self, seq_id: int) -> float:
        """The rate a draft position of ``seq_id`` is accepted at: its counts with the prior of every
        sequence's (or :data:`PRIOR_ACCEPTANCE`) counted as :data:`PRIOR_TRIES` positions."""
        a_all, t_all = self._all
        prior = (a_all + PRIOR_ACCEPTANCE * PRIOR_TRIES) / (t_all + PRIOR_TRIES)
        a, t = self._seq.get(seq_id, (0.0, 0.0))
        return (a + prior * PRIOR_TRIES) / (t + PRIOR_TRIES)

    @property
    def overall_acceptance(self) -> float | None:
        """Accepted over tried draft positions, all sequences so far (None before any)."""
        a, t = self._all
        return a / t if t else None

    # ------------------------------------------------------------------ decision
    def cost(self, rows: int) -> float | None:
        """Estimated seconds of a decode-only step of ``rows`` rows (None: nothing measured yet): the measured
        average, else the line between the measured neighbours, else (outside the measured range) the least-squares
        line through every measured row count, never below the nearest measurement; with one measurement only,
        that plus :data:`PRIOR_ROW_SHARE` of it per extra row."""
        if rows in self.costs:
            return self.costs[rows]
        if not self.costs:
            return None
        below = [r for r in self.costs if r < rows]
        above = [r for r in self.costs if r > rows]
        if below and above:
            r0, r1 = max(below), min(above)
            c0, c1 = self.costs[r0], self.costs[r1]
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
        nearest = max(below) if below else min(above)
        if len(self.costs) == 1:
            return self.costs[nearest] * (1 + PRIOR_ROW_SHARE * max(0, rows - nearest))
        n = len(self.costs)
        mean_r = sum(self.costs) / n
        mean_c = sum(self.costs.values()) / n
        var = sum((r - mean_r) ** 2 for r in self.costs)
        slope = max(0.0, sum((r - mean_r) * (c - mean_c) for r, c in self.costs.items()) / var)
        line = mean_c + slope * (rows - mean_r)
        return max(line, self.costs[nearest]) if below else min(line, self.costs[nearest])

    def choose(self, num_seqs: int, avail: list[tuple[int, int]], max_rows: int = 1 << 30) -> int:
        """The draft length for this step.

        Args:
            num_seqs: sequences in the step (each samples at least one token).
            avail: ``(seq_id, drafts it has)`` for each sequence that could draft.
            max_rows: the most rows the step may carry (``Platform.same_numerics_rows``).
        Returns:
            0 (no drafts) .. ``max_drafts``.
        """
        if not avail:
            return 0
        self._decisions += 1
        rates = [(self.acceptance(sid), n) for sid, n in avail]
        best_k, best = 0, -math.inf
        most = min(self.max_drafts, max(n for _, n in avail))
        most = longest_within(num_seqs, [n for _, n in avail], most, max_rows)
        for k in range(most + 1):
            rows = num_seqs + sum(min(k, n) for _, n in rates)
            tokens = num_seqs + sum(sum(a ** j for j in range(1, min(k, n) + 1)) for a, n in rates)
            cost = self.cost(rows)
            value = math.inf if cost is None else tokens / max(cost, 1e-9)
            if value > best:
                best_k, best = k, value
        if best_k < most and self._decisions % EXPLORE_EVERY == 0:
            return best_k + 1  # the next longer step measured again, at the cost of one step of a few more rows
        return best_k


def longest_within(num_seqs: int, avail: list[int], k: int, max_rows: int) -> int:
    """The longest draft length up to ``k`` whose step (``num_seqs`` rows plus ``min(k, n)`` for each sequence's
    ``n`` available drafts) stays within ``max_rows`` rows (0 when none does)."""
    while k and num_seqs + sum(min(k, n) for n in avail) > max_rows:
        k -= 1
    return k
