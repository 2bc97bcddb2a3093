"""Sampler: greedy, top-k/top-p/min-p, penalties, seeds."""

from __future__ import annotations

import pytest
import torch

from lightinfer.layers.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    filter_logits,
    filter_logits_batch,
    sample_batch,
)
from lightinfer.sampling_params import SamplingParams


def row(params: SamplingParams, out: list[int] = (), gen: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params, [1, 2], list(out), gen)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.1, -1.0, 3.0]])


def test_top_k_1_equals_greedy() -> None:
    s = Sampler(0)
    greedy, _ = s(LOGITS, [row(SamplingParams(temperature=0))])
    topk1, _ = s(LOGITS, [row(SamplingParams(temperature=1.5, top_k=1))])
    assert greedy == topk1 == [5]


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    draws = []
    for batch in (1, 5):
        g = torch.Generator().manual_seed(7)
        s = Sampler(seed=batch)  # a different shared generator must not matter
        logits = LOGITS.repeat(batch, 1)
        rows = [row(SamplingParams(temperature=1.0)) for _ in range(batch - 1)] + [row(params, gen=g)]
        draws.append([s(logits, rows)[0][-1] for _ in range(20)])
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_filters() -> None:
    x = LOGITS[0]
    kept = lambda p: set(torch.nonzero(torch.isfinite(filter_logits(x.clone(), p))).flatten().tolist())
    assert kept(SamplingParams(top_k=2)) == {0, 5}
    probs = torch.softmax(x, -1)
    assert kept(SamplingParams(top_p=float(probs[5]) - 1e-3)) == {5}
    assert kept(SamplingParams(top_p=float(probs[5] + probs[0]) - 1e-3)) == {0, 5}
    assert kept(SamplingParams(min_p=float(probs[1] / probs[5]) - 1e-3)) == {0, 1, 5}


def test_penalties_follow_their_definitions() -> None:
    x = torch.tensor([2.0, -2.0, 1.0, 0.0])
    r = SamplingRow(SamplingParams(repetition_penalty=2.0), [0], [1], None)
    assert apply_penalties(x.clone(), r).tolist() == [1.0, -4.0, 1.0, 0.0]
    r = SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [0], [2, 2, 3], None)
    assert apply_penalties(x.clone(), r).tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.0 - 0.5 - 0.25]


def test_frequency_penalty_changes_the_distribution() -> None:
    s = Sampler(0)
    greedy, _ = s(LOGITS, [row(SamplingParams(temperature=0), out=[5])])
    penalised, _ = s(LOGITS, [row(SamplingParams(temperature=0, frequency_penalty=2.0), out=[5])])
    assert greedy == [5] and penalised == [0]


def test_logprobs_are_raw_and_include_sampled() -> None:
    s = Sampler(0)
    toks, lps = s(LOGITS, [row(SamplingParams(temperature=0, logprobs=2, frequency_penalty=2.0), out=[5])])
    raw = torch.log_softmax(LOGITS[0], -1)
    assert toks == [0]
    assert set(lps[0]) == {5, 0} and abs(lps[0][5] - float(raw[5])) < 1e-6


BATCH_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=40, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0),
    SamplingParams(temperature=2.0, top_k=1),
]


def test_batched_filter_is_filter_logits_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(BATCH_PARAMS), 64, generator=gen) * 3
    logits[0, :4] = 1.5  # ties
    got = filter_logits_batch(logits, BATCH_PARAMS)
    for i, p in enumerate(BATCH_PARAMS):
        want = logits[i] if p.greedy else filter_logits(logits[i].clone(), p)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), p
        torch.testing.assert_close(got[i][torch.isfinite(want)], want[torch.isfinite(want)])


def test_batched_draws_follow_the_filtered_distribution() -> None:
    # 40,000 rows of one distribution: the draw (by inversion on the CPU) must give each kept token its probability.
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1, -1.0, 3.0]]).repeat(40_000, 1)
    for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_p=0.9)):
        want = torch.softmax(filter_logits(logits[0].clone(), p), -1)
        drawn = sample_batch(logits, [p] * len(logits), torch.Generator().manual_seed(1))
        freq = torch.bincount(drawn, minlength=6).double() / len(drawn)
        assert (freq[want == 0] == 0).all(), (p, freq)
        torch.testing.assert_close(freq, want.double(), atol=0.01, rtol=0)


def test_the_cpu_draw_never_picks_a_token_of_probability_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inversion at the edges: U = 0 picks the first token with probability, U just below 1 the last one, and a
    U * total that rounds up to the total (forced here) falls back to the row's argmax, not to a dropped token."""
    from lightinfer.layers import sampler as sampler_mod

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]])
    argmax = torch.tensor([3])
    params = [SamplingParams(temperature=1.0)]
    for u, want in ((0.0, 1), (1.0 - 2.0**-24, 3), (1.0, 3)):  # 1.0: what a rounded-up U * total amounts to
        monkeypatch.setattr(sampler_mod.torch, "rand", lambda *a, u=u, **k: torch.full((1, 1), u))
        assert int(sampler_mod.sample_by_inversion(probs, params, torch.Generator(), {}, argmax)[0]) == want
    probs = torch.tensor([[0.5, 0.5, 0.0]])  # the fallback: U * total == total would pick index 2
    assert int(sampler_mod.sample_by_inversion(probs, params, torch.Generator(), {}, torch.tensor([0]))[0]) == 0


def test_sampler_mixes_plain_penalised_banned_and_seeded_rows() -> None:
    s = Sampler(3)
    seeded = SamplingParams(temperature=1.0, seed=5)
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=1.0, top_k=1)),
            row(seeded, gen=torch.Generator().manual_seed(5)),
            row(SamplingParams(temperature=0, frequency_penalty=2.0), out=[5]),
            SamplingRow(SamplingParams(temperature=0), [1], [], None, suppress_token_ids=(5,))]
    toks, _ = s(LOGITS.repeat(len(rows), 1), rows)
    assert toks[:2] == [5, 5] and toks[3] == 0 and toks[4] == 0
    # the seeded row drew from its own generator only: alone, with a fresh one, it draws the same
    alone, _ = Sampler(99)(LOGITS, [row(seeded, gen=torch.Generator().manual_seed(5))])
    assert toks[2] == alone[0]


def test_rows_without_a_finite_maximum_are_flagged_not_sampled() -> None:
    """NaN, +inf or all -inf logits give INVALID_TOKEN (and no logprobs) for that row only."""
    from lightinfer.layers.sampler import INVALID_TOKEN

    good = LOGITS[0]
    logits = torch.stack([good, good.clone().index_fill_(0, torch.tensor([2]), float("nan")),
                          good.clone().index_fill_(0, torch.tensor([0]), float("inf")),
                          torch.full_like(good, float("-inf")), good.clone().index_fill_(0, torch.tensor([1]), float("-inf"))])
    for params in (SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0.8, top_p=0.9, logprobs=1)):
        toks, lps = Sampler(0)(logits, [row(params) for _ in range(5)])
        assert toks[1:4] == [INVALID_TOKEN] * 3 and lps[1:4] == [None] * 3
        assert 0 <= toks[0] < 6 and 0 <= toks[4] < 6 and toks[4] != 1  # one -inf logit is a banned token, not broken
        assert lps[0] is not None and toks[0] in lps[0]
