"""Sampler: greedy, top-k/top-p/min-p, penalties, seeds."""

from __future__ import annotations

import torch

from lightinfer.layers.sampler import Sampler, SamplingRow, apply_penalties, filter_logits
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
