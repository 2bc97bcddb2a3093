"""The engine's side of constrained decoding: one grammar matcher per constrained sequence, and the
per-step token bitmask applied to the logits before sampling.

One step, as :class:`LLMEngine` drives it::

    mask = manager.begin_step(seqs)      # before the forward: fill the bitmask (a worker thread may do it
                                         #   while the forward runs); None when no row is constrained
    logits = model_runner.run(...)
    manager.apply_(logits, mask, rows)   # wait for the fill, disallowed tokens -> -inf, constrained rows only
    tokens = sampler(logits, ...)
    manager.accept(seq, token)           # advance the grammar; "terminated" ends the sequence ("stop")

A step without a constrained sequence costs one dict-length check. Preemption by recompute keeps a
sequence's generated tokens, so its matcher stays valid as it is; ``n > 1`` forks the matcher with the
sequence (before either has accepted its own token).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lightinfer.engine.sequence import Sequence
from lightinfer.structured import GrammarBackend, GrammarMatcher, StructuredBatch, StructuredOutputs
from lightinfer.structured.bitmask import apply_token_bitmask_

logger = logging.getLogger("lightinfer")


@dataclass
class StructuredStats:
    """Where constrained decoding spends its time (seconds, totals since start)."""

    num_steps: int = 0  # steps with at least one constrained row
    num_rows: int = 0  # constrained rows masked, over those steps
    fill_seconds: float = 0.0  # computing the bitmask (on the worker thread when overlapped)
    apply_seconds: float = 0.0  # masking the logits
    blocking_seconds: float = 0.0  # what the engine thread spent on masks: inline fills (or waits), applies

    @property
    def fill_ms_per_step(self) -> float:
        """Bitmask computation per constrained step, milliseconds."""
        return 1e3 * self.fill_seconds / max(1, self.num_steps)

    @property
    def mask_ms_per_step(self) -> float:
        """Time the engine thread spent on the mask per constrained step, milliseconds (the fill, or the
        wait for an overlapped fill, plus the apply)."""
        return 1e3 * self.blocking_seconds / max(1, self.num_steps)


@dataclass
class StepMask:
    """The bitmask of one step being filled: row ``i`` belongs to ``seqs[i]``."""

    seqs: list[Sequence]
    rows: list[int]  # constrained rows (indices into seqs)
    future: Future[Any] | None = None
    filled: list[int] = field(default_factory=list)


class StructuredOutputManager:
    """Matchers of the constrained sequences and the per-step bitmask of one engine.

    Args:
        tokenizer: the model's fast tokenizer (None: an engine without one; constrained requests are
            then refused).
        eos_token_ids: the ids that end a completion (the grammar allows them where it may end).
        overlap: fill the bitmask on a worker thread while the forward runs. The engine turns it on for
            CUDA (the forward is asynchronous: the host is idle meanwhile) and leaves it off on CPU, where
            the forward already uses every core: ``bench/structured/structured_cpu.py`` found no gain there (32 rows:
            the fill is ~1 ms of a step of hundreds of ms; the threaded variant measured 0.90x of
            unconstrained against 0.97x inline, within the shared machine's noise).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: set[int] | list[int], overlap: bool = False) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self.matchers: dict[int, GrammarMatcher] = {}  # seq_id -> its grammar state
        self._batch: StructuredBatch | None = None
        self.overlap = overlap
        self._executor: ThreadPoolExecutor | None = None
        self.stats = StructuredStats()

    # ---------------------------------------------------------------- requests
    @property
    def backend(self) -> GrammarBackend:
        """:meth:`get_backend`."""
        return self.get_backend()

    def get_backend(self) -> GrammarBackend:
        """The grammar backend, built at first use (it reads the whole vocabulary: ~0.3-2 s). Thread-safe.

        Raises:
            ValueError: the engine has no tokenizer, or a slow one.
        """
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    if self._tokenizer is None:
                        raise ValueError("structured outputs need the model's tokenizer and this engine has none "
                                         "(skip_tokenizer_init, or a dummy model without tokenizer files)")
                    t0 = time.perf_counter()
                    self._backend = GrammarBackend(self._tokenizer, self._eos)
                    logger.info("grammar backend ready in %.2f s (%d tokens)", time.perf_counter() - t0,
                                self._backend.vocab_size)
        return self._backend

    @property
    def num_active(self) -> int:
        """Sequences with a matcher."""
        return len(self.matchers)

    def constrained_seq_ids(self) -> set[int]:
        """The ids of the sequences with a matcher (they do not draft: ``engine/spec/``)."""
        return set(self.matchers)

    def add(self, seq: Sequence, spec: StructuredOutputs) -> None:
        """A matcher at the grammar's start for ``seq`` (a cache hit when the front end compiled ``spec``)."""
        self.matchers[seq.seq_id] = self.backend.matcher(spec)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a new completion of ``n > 1``) gets a copy of ``parent``'s grammar state."""
        m = self.matchers.get(parent.seq_id)
        if m is not None:
            self.matchers[child.seq_id] = m.fork()

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq``'s matcher (finished or aborted)."""
        self.matchers.pop(seq.seq_id, None)

    # ---------------------------------------------------------------- step
    def begin_step(self, seqs: list[Sequence]) -> StepMask | None:
        """Start filling the bitmask of the sequences sampled this step (row ``i`` = ``seqs[i]``); None when
        none of them is constrained (then nothing is touched)."""
        matchers = [self.matchers.get(s.seq_id) for s in seqs]
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if self._batch is None:
            self._batch = StructuredBatch(self.backend.vocab_size)
        mask = StepMask(seqs, rows)
        if self.overlap:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightinfer-mask")
            mask.future = self._executor.submit(self._fill, matchers)
        else:
            self.stats.blocking_seconds += self._fill(matchers)
        return mask

    def _fill(self, matchers: list[GrammarMatcher | None]) -> float:
        t0 = time.perf_counter()
        assert self._batch is not None
        self._batch.fill(matchers)
        seconds = time.perf_counter() - t0
        self.stats.fill_seconds += seconds
        return seconds

    @torch.inference_mode()  # the logits are inference tensors: in-place writes need the mode
    def apply_(self, logits: torch.Tensor, mask: StepMask, rows: list[int]) -> torch.Tensor:
        """Mask ``logits`` in place: its row ``j`` samples for ``mask.seqs[rows[j]]`` (a request's first
        step samples all ``n`` completions from one sequence's row). Unconstrained rows are not touched.

        Returns:
            ``logits``.
        """
        t0 = time.perf_counter()
        if mask.future is not None:
            mask.future.result()  # re-raises a failed fill
        t1 = time.perf_counter()
        assert self._batch is not None
        bitmask = self._batch.bitmask[: len(mask.seqs)]
        constrained = set(mask.rows)
        if rows != list(range(len(mask.seqs))):
            bitmask = bitmask[torch.tensor(rows, dtype=torch.long)]
        targets = [j for j, r in enumerate(rows) if r in constrained]
        apply_token_bitmask_(logits, bitmask, targets, self._batch.vocab_size)
        t2 = time.perf_counter()
        s = self.stats
        s.num_steps += 1
        s.num_rows += len(targets)
        s.apply_seconds += t2 - t1
        s.blocking_seconds += t2 - t0
        return logits

    def accept(self, seq: Sequence, token: int) -> str | None:
        """Advance ``seq``'s grammar by its sampled ``token``.

        Returns:
            None (not constrained), "ok", "terminated" (the grammar has ended: finish with reason "stop")
            or "rejected" (the grammar refused the token; cannot happen with the mask applied).
        """
        m = self.matchers.get(seq.seq_id)
        if m is None:
            return None
        if not m.accept_token(token):
            logger.error("request %s: the grammar refused sampled token %d (%s)", seq.request_id, token, m.error)
            return "rejected"
        return "terminated" if m.is_terminated() else "ok"

    def shutdown(self) -> None:
        """Stop the worker thread (if any)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
