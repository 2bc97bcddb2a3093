"""Speculative decoding's parts without a model: prompt-lookup drafts, the draft-length policy, the config, and
the acceptance rule (greedy exactness; the sampled distribution checked statistically)."""

from __future__ import annotations

import pytest
import torch

from lightinfer.engine.spec.ngram import NgramIndex, NgramProposer
from lightinfer.engine.spec.policy import EXPLORE_EVERY, DraftPolicy
from lightinfer.engine.spec.verify import DraftRows, verify_drafts
from lightinfer.layers.sampler import INVALID_TOKEN, SamplingRow
from lightinfer.sampling_params import SamplingParams
from lightinfer.speculative_config import SpeculativeConfig


def test_ngram_proposes_the_continuation_of_the_longest_latest_match() -> None:
    idx = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 2, 3]
    # [2, 3] last seen before at 6..7 followed by 7, 6, 5 (the latest, over 1..2 followed by 9)
    assert idx.propose(tokens, 3) == [7, 6, 5]
    assert idx.propose(tokens + [1, 2, 3], 4) == [7, 6, 5, 2]  # 3-gram [1, 2, 3] wins over shorter ones
    assert NgramIndex(2, 3).propose([5, 6, 7, 8], 3) == []  # nothing repeats
    assert NgramIndex(1, 1).propose([5, 6, 5], 4) == [6, 5]  # cut at the end of the sequence


def test_ngram_index_grown_step_by_step_equals_a_fresh_one() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    grown = NgramIndex(2, 4)
    for n in range(10, 300, 7):
        assert grown.propose(tokens[:n], 5) == NgramIndex(2, 4).propose(tokens[:n], 5)


def test_the_proposer_forgets_finished_sequences() -> None:
    p = NgramProposer(1, 2)
    p.propose(1, [1, 2, 1], 2)
    p.propose(2, [3, 3], 2)
    p.keep_only({2})
    assert len(p) == 1


def test_policy_drafts_while_verifying_is_cheap_and_stops_when_it_is_not() -> None:
    cheap = DraftPolicy(4)
    for rows, ms in ((1, 10.0), (2, 10.1), (3, 10.2), (4, 10.3), (5, 10.4)):
        cheap.record_step(rows, ms / 1e3)
        cheap.record_step(rows, ms / 1e3)  # the first of a row count is not counted (recording, compiling)
    assert cheap.choose(1, [(7, 4)]) == 4
    dear = DraftPolicy(4)
    for rows in range(1, 6):
        dear.record_step(rows, rows * 0.010)
        dear.record_step(rows, rows * 0.010)  # each row costs a whole step: drafts can only lose
    for _ in range(EXPLORE_EVERY - 1):
        assert dear.choose(1, [(7, 4)]) == 0
    assert dear.choose(1, [(7, 4)]) == 1  # one decision in EXPLORE_EVERY measures a longer step again
    assert dear.choose(1, []) == 0


def test_policy_extrapolates_costs_along_the_measured_line() -> None:
    p = DraftPolicy(4)
    assert p.cost(3) is None
    p.record_step(16, 0.0)
    p.record_step(16, 0.128)
    assert p.cost(20) == pytest.approx(0.128 * (1 + 0.05 * 4))  # one measurement: the optimistic prior
    for rows in (1, 2, 4):
        p.record_step(rows, 0.0)
        p.record_step(rows, 0.008 * rows)  # 8 ms a row
    assert p.cost(20) == pytest.approx(0.160, rel=0.02)  # the line, not the prior's 0.154
    assert p.cost(3) == pytest.approx(0.024)  # between measured neighbours
    assert p.choose(16, [(i, 4) for i in range(16)]) == 0  # at 16 rows a row costs a token's time: no gain


def test_policy_keeps_a_step_within_its_rows_of_the_same_numerics() -> None:
    p = DraftPolicy(4)
    for rows in range(1, 12):
        p.record_step(rows, 0.010)
        p.record_step(rows, 0.010)  # every row free: the most drafts pay
    assert p.choose(2, [(1, 4), (2, 4)]) == 4
    assert p.choose(2, [(1, 4), (2, 4)], max_rows=7) == 2  # 2 + 2 * 2 <= 7 < 2 + 2 * 3
    assert p.choose(2, [(1, 4), (2, 1)], max_rows=7) == 4  # 2 + 4 + 1
    assert p.choose(4, [(1, 4)], max_rows=4) == 0


def test_policy_acceptance_follows_what_was_accepted() -> None:
    p = DraftPolicy(4)
    assert p.acceptance(1) == pytest.approx(0.5)
    for _ in range(20):
        p.record_verify(1, drafted=4, accepted=4)
        p.record_verify(2, drafted=4, accepted=0)
    assert p.acceptance(1) > 0.8 and p.acceptance(2) < 0.2
    assert p.overall_acceptance == pytest.approx(80 / 100)


def test_config_errors_say_what_is_wrong_with_a_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file: .*missing.json"):
        SpeculativeConfig.parse(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{method: ngram}")
    with pytest.raises(ValueError, match=f"speculative_config file {bad}: not valid JSON"):
        SpeculativeConfig.parse(str(bad))
    with pytest.raises(ValueError, match="'draft_model' is not supported"):  # not "unknown key 'model'"
        SpeculativeConfig.parse({"method": "draft_model", "model": "x", "num_speculative_tokens": 2})


def test_config_parses_what_users_give(tmp_path) -> None:
    path = tmp_path / "spec.json"
    path.write_text('{"method": "ngram", "num_speculative_tokens": 6}')
    assert SpeculativeConfig.parse(str(path)).num_speculative_tokens == 6
    assert SpeculativeConfig.parse({"prompt_lookup_max": 3}).prompt_lookup_max == 3
    for bad, field in (({"method": "eagle3"}, "method"), ({"suffix_decoding_min_token_prob": 2}, "min_token_prob"), ({"k": 2}, "unknown key"),
                       ({"num_speculative_tokens": 17}, "num_speculative_tokens"), ("[1]", "JSON object"), ("", "not valid JSON"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min")):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(bad)


def _row(params: SamplingParams, gen: torch.Generator | None = None, suppress: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(params, [], [], gen, suppress)


def test_greedy_accepts_up_to_the_first_mismatch_then_takes_the_targets_token() -> None:
    logits = torch.full((8, 6), -5.0)
    for r, best in enumerate([2, 3, 4, 1, 0, 5, 5, 5]):
        logits[r, best] = 5.0
    g = SamplingParams(temperature=0)
    seqs = [DraftRows(0, [2, 3, 0], [_row(g)] * 4),  # 2, 3 accepted; 0 rejected for row 2's argmax 4
            DraftRows(4, [0, 5, 5], [_row(g)] * 4)]  # all accepted: the bonus is row 7's argmax
    a, b = verify_drafts(logits, seqs, torch.Generator().manual_seed(0))
    assert (a.tokens, a.num_accepted) == ([2, 3, 4], 2)
    assert (b.tokens, b.num_accepted) == ([0, 5, 5, 5], 3)
    logits[1, 0] = float("nan")
    c, = verify_drafts(logits, [DraftRows(0, [2, 3, 0], [_row(g)] * 4)], torch.Generator())
    assert c.tokens == [2, INVALID_TOKEN]  # a broken row ends the run there


def test_banned_ids_and_logprobs_follow_the_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    g = SamplingParams(temperature=0, logprobs=1)
    v, = verify_drafts(logits, [DraftRows(0, [1], [_row(g, suppress=(1,)), _row(g)])], torch.Generator())
    assert v.tokens == [2] and v.num_accepted == 0  # the draft is a banned id: rejected
    assert set(v.logprobs[0]) == {1, 2} and v.logprobs[0][1] == pytest.approx(torch.log_softmax(logits[0], 0)[1])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.0, top_p=0.8)])
def test_sampled_tokens_have_the_targets_distribution(params: SamplingParams) -> None:
    """12,000 sequences draft token 0 then 1; the first token kept (accepted draft or resampled correction) and
    the second must be distributed as the target's processed rows. Dropping the residual (resampling from p
    itself after a rejection) moves the first token's share of id 0 from p(0) to p(0)^2 + (1 - p(0)) p(0)."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.0, 0.5, 0.0, -2.0], [0.3, 0.2, 0.1, 0.0, 0.0]])
    from lightinfer.layers.sampler import filter_logits

    target = [torch.softmax(filter_logits(logits[r], params), 0) for r in range(2)]
    n = 12_000
    seqs = [DraftRows(0, [0, 1], [_row(params)] * 3) for _ in range(n)]
    out = verify_drafts(logits, seqs, torch.Generator().manual_seed(1))
    first = torch.bincount(torch.tensor([v.tokens[0] for v in out]), minlength=5).double() / n
    assert torch.allclose(first, target[0].double(), atol=0.015), (first, target[0])
    # the second token, among runs whose first was the draft 0: the target's second row
    second = torch.tensor([v.tokens[1] for v in out if v.tokens[0] == 0])
    share = torch.bincount(second, minlength=5).double() / len(second)
    assert torch.allclose(share, target[1].double(), atol=0.025), (share, target[1])
    accepted = sum(v.num_accepted >= 1 for v in out) / n
    assert accepted == pytest.approx(float(target[0][0]), abs=0.015)


def test_a_seeded_row_draws_from_its_own_generator() -> None:
    logits = torch.zeros(3, 50)
    p = SamplingParams(temperature=1.0)

    def run(seed: int) -> list[int]:
        return verify_drafts(logits, [DraftRows(0, [7, 8], [_row(p, torch.Generator().manual_seed(seed))] * 3)],
                             torch.Generator().manual_seed(99))[0].tokens

    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(8)}) > 1


def test_suffix_counts_add_and_remove() -> None:
    from lightinfer.engine.spec.suffix import ContinuationCounts

    c = ContinuationCounts(3)
    c.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert c.best([7, 1, 2]) == (3, pytest.approx(2 / 3), 2)  # after [1, 2]: 3 twice, 4 once
    assert c.best([3, 1, 2]) == (4, 1.0, 3)  # the longest context wins: [3, 1, 2] was followed by 4 only
    c.add([1, 2, 3, 1, 2, 4, 1, 2, 3], sign=-1)
    assert len(c) == 0 and c.best([1, 2]) is None


def test_suffix_drafts_follow_a_likely_continuation_and_share_finished_outputs() -> None:
    from lightinfer.engine.spec.suffix import SuffixProposer

    p = SuffixProposer(max_depth=4, max_cached_requests=2, min_token_prob=0.3)
    # a request's own repetition: after [7, 8] came 9, 10 twice
    assert p.propose(1, [7, 8, 9, 10, 0, 7, 8, 9, 10, 0, 7, 8], 3, num_prompt_tokens=5) == [9, 10, 0]
    # request 2 answers with a tool call; once it has finished, request 3 meets the same start and gets the rest
    call = [50, 51, 52, 53, 54, 55]
    assert p.propose(2, [1, 2, 3] + call, 2, num_prompt_tokens=3) == []
    p.keep_only({1, 3})  # 2 finished: its output joins the shared counts
    assert p.propose(3, [4, 5, 6, 50, 51], 4, num_prompt_tokens=3) == [52, 53, 54, 55]
    # unlikely continuations stop a draft: after 60 came 61, 62, 63 and 64 once each (share 1/4 < 0.3)
    assert p.propose(4, [60, 61, 60, 62, 60, 63, 60, 64, 60], 4) == []
    # beyond max_cached_requests (2) the oldest finished outputs leave the shared counts
    for sid, tokens in ((5, [9, 9, 70, 71, 72]), (6, [9, 9, 80, 81, 82])):
        p.keep_only({1, sid})  # 3, then 5 finish
        p.propose(sid, tokens, 1, num_prompt_tokens=2)
    p.keep_only({1})  # 6 finishes: cached are 5 and 6; 2 and 3 were evicted
    assert p.propose(7, [0, 50, 51], 2) == []
    assert p.propose(8, [0, 80], 2) == [81, 82]


def test_a_sequence_that_cannot_draft_still_feeds_the_suffix_counts() -> None:
    """A grammar request (no room to draft) is seen by the suffix proposer: its tool call, once finished, is
    drafted for the next request; prompt lookup keeps no index for it."""
    from lightinfer.engine.sequence import Sequence
    from lightinfer.engine.spec.speculator import Speculator
    from tests.engine.spec.policies import AlwaysDraft

    spec = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=4), 1024)
    spec.policy = AlwaysDraft(4)
    first = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=50))
    first.token_ids += [40, 41, 42, 43, 44]
    first.num_computed_tokens = first.num_tokens - 1
    spec.propose([first], constrained={first.seq_id}, alive={first.seq_id})
    assert first.spec_token_ids == []
    second = Sequence("b", [7, 8, 40], SamplingParams(max_tokens=50))
    second.num_computed_tokens = second.num_tokens - 1
    spec.propose([second], constrained=set(), alive={second.seq_id})  # `first` has finished
    assert second.spec_token_ids == [41, 42, 43, 44]
    lookup = Speculator(SpeculativeConfig(method="ngram"), 1024)
    lookup.propose([first], constrained={first.seq_id}, alive={first.seq_id})
    assert len(lookup.proposer) == 0
