"""The engine's side of speculative decoding: drafts before a step, the policy's length, the counters.

Per step (``LLMEngine.step``)::

    propose(running)       each running sequence that is decoding gets up to num_speculative_tokens drafts
                           (ngram.py or suffix.py), all cut to the length the policy chooses (policy.py); they
                           are ``seq.spec_token_ids``
    scheduler              a sequence with drafts computes 1 + k tokens: its last token and the drafts, as k + 1
                           decode rows sharing its block table (step_inputs.py), KV slots included
    verify (verify.py)     the accepted drafts and one more token are appended; the KV of the rejected ones
                           stays in slots the next tokens overwrite (num_computed_tokens counts accepted only)
    record_step            the step's time by its row count, for the policy

Sequences under a grammar (structured outputs) do not draft.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightinfer.engine.sequence import Sequence
from lightinfer.engine.spec.ngram import NgramProposer
from lightinfer.engine.spec.policy import DraftPolicy
from lightinfer.engine.spec.suffix import SuffixProposer
from lightinfer.speculative_config import SpeculativeConfig


@dataclass
class SpecStats:
    """Totals since start (vLLM's ``spec_decode`` counters)."""

    num_drafts: int = 0  # verify steps of one sequence
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


class Speculator:
    """Drafts, policy and counters of one engine.

    Args:
        config: the resolved ``speculative_config``.
        max_model_len: the engine's, in tokens (no draft may run a sequence past it).
        max_rows: rows of a plain step -> the most rows its drafts may bring it to with each row still computed as
            in the plain step (``Platform.same_numerics_rows``: greedy output stays the same).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 max_rows: Callable[[int], int] = lambda rows: 1 << 30) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.max_rows = max_rows
        self.proposer: NgramProposer | SuffixProposer
        if config.method == "suffix":
            self.proposer = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                           config.suffix_decoding_max_cached_requests,
                                           config.suffix_decoding_min_token_prob)
        else:
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.policy = DraftPolicy(config.num_speculative_tokens)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: list[Sequence], constrained: set[int], alive: set[int]) -> None:
        """Set ``spec_token_ids`` of every running sequence: drafts where it decodes and has a match, cut to the
        policy's length; [] elsewhere. ``constrained``: seq ids under a grammar (no drafts); ``alive``: the ids
        of every unfinished sequence, running or waiting (the others' state is dropped, a suffix proposer shares
        their outputs)."""
        self.proposer.keep_only(alive)
        self.policy.forget(alive)
        candidates: list[tuple[Sequence, list[int]]] = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            p = seq.sampling_params
            room = 0 if seq.seq_id in constrained else min(
                self.config.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1)
            # with no room the proposer still sees the tokens: a grammar request's output (a tool call) is what a
            # suffix proposer offers the next requests
            drafts = self.proposer.propose(seq.seq_id, seq.token_ids, max(room, 0), seq.num_prompt_tokens)
            if drafts:
                candidates.append((seq, drafts))
        k = self.policy.choose(len(running), [(s.seq_id, len(d)) for s, d in candidates], self.max_rows(len(running)))
        for seq, drafts in candidates:
            seq.spec_token_ids = drafts[:k]

    def record_verify(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count one sequence's verification."""
        self.policy.record_verify(seq.seq_id, drafted, accepted)
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_pos[i] += 1

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows took ``seconds`` (for the policy)."""
        self.policy.record_step(rows, seconds)

    def info(self) -> dict[str, Any]:
        """For ``model_info()`` and ``/stats``: the config, the counters, the acceptance rate and the mean
        tokens a verifying sequence gained per step."""
        st = self.stats
        return {**self.config.to_dict(), "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                "num_accepted_tokens": st.num_accepted_tokens, "accepted_per_pos": list(st.accepted_per_pos),
                "acceptance_rate": round(st.num_accepted_tokens / st.num_draft_tokens, 4) if st.num_draft_tokens else None,
                "mean_accepted_length": round(1 + st.num_accepted_tokens / st.num_drafts, 3) if st.num_drafts else None}
