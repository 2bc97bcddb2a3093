"""Which drafted tokens the target model accepts: exact speculative sampling (Leviathan et al. 2023, Chen et al.
2023) for drafts that are single tokens, not distributions.

A sequence that drafted ``d_1 .. d_k`` ran ``k + 1`` rows of logits in the step: row ``i`` is the target's
distribution ``p_i`` of the token after ``d_1 .. d_i`` (row 0: after the sequence's last real token). Each row is
processed exactly as a plain step would process it (penalties over the output so far plus the drafts before it,
banned ids, temperature, top-k, top-p, min-p), then, position by position::

    x_i = the token a plain step samples from p_i      (greedy: its argmax; else the sampler's own draw,
                                                         from the row's generator, one draw per position)
    x_i == d_{i+1}: accept the draft, go on             (i < k)
    else:           emit x_i and stop                   (at i = k every draft was accepted: x_k is the bonus)

For a draft that is one token (a draft distribution ``q`` one-hot at ``d``) this is the rejection rule of
speculative sampling: ``d`` is accepted with probability ``p(d) = min(1, p(d) / q(d))``, and a rejected position
emits a token distributed as ``p`` without ``d``, renormalised: ``norm(max(0, p - q))``. Each emitted token has
exactly a plain step's distribution; a step emits 1 .. k + 1 tokens. A request with a ``seed`` draws from its own
generator one number per emitted token, as plain steps do, so its output is the same with speculation on and
off, token for token; unseeded requests share the engine's generator, whose draws depend on the batch either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightinfer.layers.sampler import (
    INVALID_TOKEN,
    Sampler,
    SamplingRow,
    adjusted_logits,
    filter_logits_batch,
    greedy_pick,
    sample_batch,
    sample_by_inversion,
)


@dataclass
class DraftRows:
    """One sequence's part of a verify step.

    Attributes:
        first_row: its first row in the step's logits.
        drafts: the ``k`` drafted ids.
        rows: ``k + 1`` :class:`SamplingRow`, row ``i`` with the output so far plus ``drafts[:i]``.
    """

    first_row: int
    drafts: list[int]
    rows: list[SamplingRow]


@dataclass
class Verified:
    """What a sequence keeps: ``tokens`` (accepted drafts, then one more from the target; ends early at an
    :data:`INVALID_TOKEN` where a row's logits were not finite), ``logprobs`` one per token (None where not
    asked for) and ``num_accepted`` drafts."""

    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    num_accepted: int


def verify_drafts(logits: torch.Tensor, seqs: list[DraftRows], shared: torch.Generator) -> list[Verified]:
    """Accept or reject every sequence's drafts (module docstring).

    Args:
        logits: the step's logits, ``[rows, vocab]`` on any device; each sequence's ``k + 1`` rows from its
            ``first_row``.
        seqs: the sequences that drafted.
        shared: the engine's generator on ``logits.device``, for rows without their own.
    Returns:
        One :class:`Verified` per sequence, in order.
    """
    if not seqs:
        return []
    index = torch.tensor([s.first_row + i for s in seqs for i in range(len(s.rows))], dtype=torch.long,
                         device=logits.device)
    raw = logits.index_select(0, index).to(torch.float32)
    rows = [row for s in seqs for row in s.rows]
    params = [row.params for row in rows]
    x = adjusted_logits(raw, rows)
    argmax = greedy_pick(x)
    argmax_h = argmax.tolist()
    broken = (~torch.isfinite(raw.amax(dim=-1))).tolist()
    # the CPU's plain draw is by inversion of these probabilities, one row's the same in any batch
    probs = None
    if x.device.type == "cpu" and not all(p.greedy for p in params):
        probs = torch.softmax(filter_logits_batch(x, params), dim=-1)

    def sample(r: int, row: SamplingRow) -> int:
        if row.params.greedy:
            return argmax_h[r]
        own = {0: row.generator} if row.generator is not None else {}
        if probs is not None:
            return int(sample_by_inversion(probs[r:r + 1], [row.params], shared, own, argmax[r:r + 1]))
        return int(sample_batch(x[r:r + 1], [row.params], shared, own))

    out: list[Verified] = []
    offset = 0
    for s in seqs:
        tokens: list[int] = []
        for i, row in enumerate(s.rows):
            if broken[offset + i]:
                tokens.append(INVALID_TOKEN)
                break
            tokens.append(sample(offset + i, row))
            if i == len(s.drafts) or tokens[-1] != s.drafts[i]:
                break
        kept = tokens if tokens[-1] != INVALID_TOKEN else tokens[:-1]
        lps = Sampler.logprobs(raw[offset:offset + len(kept)], s.rows[:len(kept)], kept) if kept else []
        # every token but the last is an accepted draft (the last: a correction, the bonus, or INVALID_TOKEN)
        out.append(Verified(tokens, lps + [None] * (len(tokens) - len(kept)), len(tokens) - 1))
        offset += len(s.rows)
    return out
