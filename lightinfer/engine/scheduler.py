"""Continuous batching: which sequences run in the next step, and how many tokens each.

As in vLLM v1, every running sequence is handed a number of new tokens to compute, so
prefill, chunked prefill and decode are one mechanism: a decode is a sequence with one
uncomputed token, a prefill one with many, cut to the step's token budget.

    step budget = max_num_batched_tokens
    1. running sequences, oldest first: decodes (1 token, plus its drafts when speculating: ``engine/spec/``)
       and unfinished prefills (a chunk, at most
       ``long_prefill_token_threshold`` tokens of one request: on a CPU a long prompt would otherwise hold
       every request behind it for its whole prefill);
       when a sequence needs a block and none is free, the newest running sequence is
       preempted (blocks freed, recomputed later from its tokens).
    2. waiting sequences, oldest first, while budget, blocks and max_num_seqs allow
       (prefix-cache hits make part of the prompt free).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lightinfer.config import EngineConfig
from lightinfer.engine.block_manager import BlockManager
from lightinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """A sequence in this step: compute tokens ``[start, start + num_new_tokens)``, of which the last
    ``len(draft_ids)`` are drafts to verify (past ``seq.token_ids``; ``engine/spec/``)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    draft_ids: list[int] = field(default_factory=list)

    @property
    def completes_prompt(self) -> bool:
        """True when after this step every token is computed, so a next token is sampled."""
        return self.start + self.num_new_tokens - len(self.draft_ids) == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One real token to compute (and maybe drafts): the step runs it as decode rows, one per token."""
        return self.num_new_tokens - len(self.draft_ids) == 1


@dataclass
class SchedulerOutput:
    """The step's batch: decodes (one new token) first, then prefill chunks."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)  # (KV-cache group, src, dst)
    num_preempted: int = 0

    @property
    def num_decodes(self) -> int:
        """Scheduled sequences that decode (with or without drafts)."""
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_ids) for s in self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue and the running list.

    Args:
        config: the engine settings (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``).
        block_manager: the KV block pool.
        eos_token_ids: ids that end a completion unless ``ignore_eos``.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids: set[int]) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = int(config.long_prefill_token_threshold or 0)
        self.max_model_len = int(config.max_model_len or 0)
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int, int]] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (it joins a batch at the next step that has room)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts (see module docstring)."""
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, budget)
            drafts: list[int] = []
            if seq.spec_token_ids and num_new == 1 and seq.num_computed_tokens == seq.num_tokens - 1:
                drafts = seq.spec_token_ids[:budget - 1]
                num_new += len(drafts)
            while not bm.allocate_slots(seq, num_new, num_lookahead_tokens=len(drafts)):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, drafts))
            budget -= num_new
            i += 1
        while not out.num_preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # the whole prompt (past any cached prefix); a sliding-window group takes only this step's chunk
            if not bm.allocate_slots(seq, seq.num_tokens, num_step_tokens=budget):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = self._chunk(seq, budget)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        out.scheduled.sort(key=lambda s: not s.is_decode)  # decodes first, stable
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` computes this step: what it has left, within the budget, and a prompt chunk within
        ``long_prefill_token_threshold`` (so the requests behind a long prompt join the next steps)."""
        left = seq.num_tokens - seq.num_computed_tokens
        cap = self.long_prefill_token_threshold
        return min(left, budget, cap) if cap > 0 and left > 1 else min(left, budget)

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new completion sharing ``parent``'s blocks (before its last token is appended).

        Falls back to a waiting sequence that recomputes (mostly from the prefix cache) when no
        block is free for the copy of a partial block.
        """
        child = parent.fork(index)
        if self.block_manager.can_fork(parent):
            self.pending_copies += self.block_manager.fork(parent, child)
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)
        return child

    def postprocess(self, out: SchedulerOutput) -> None:
        """Advance every scheduled sequence's computed-token count and hash its full blocks. Drafts do not count
        until accepted (:meth:`commit_drafts`)."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens - len(s.draft_ids)
            s.seq.spec_token_ids = []
            self.block_manager.register_computed_blocks(s.seq)

    def commit_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """``num_accepted`` of ``seq``'s verified drafts were accepted: their KV counts as computed (call before
        appending them; the rejected ones' slots are overwritten by later tokens)."""
        seq.num_computed_tokens += num_accepted

    def register_blocks(self, seq: Sequence) -> None:
        """Hash ``seq``'s full computed blocks (after accepted drafts were appended)."""
        if not seq.is_finished:
            self.block_manager.register_computed_blocks(seq)

    def check_stop(self, seq: Sequence) -> bool:
        """After a token was appended: EOS, stop token, max_tokens, max_model_len. Finishes ``seq``."""
        p = seq.sampling_params
        token = seq.token_ids[-1]
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        if (is_eos or token in p.stop_token_ids) and seq.num_output_tokens >= p.min_tokens:
            self.finish(seq, "stop", token)
        elif seq.num_output_tokens >= p.max_tokens or (self.max_model_len and seq.num_tokens >= self.max_model_len):
            self.finish(seq, "length")
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark ``seq`` finished and free its blocks (idempotent)."""
        if seq.is_finished:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` with reason "abort"; returns them."""
        seqs = [s for s in list(self.running) + list(self.waiting) if s.request_id == request_id]
        for s in seqs:
            self.finish(s, "abort")
        return seqs
