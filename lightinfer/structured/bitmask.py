"""The batched step: fill one token bitmask for the constrained rows, apply it to the logits in place.

Layout: int32 ``[batch, ceil(vocab / 32)]``; token ``t`` is allowed in row ``r`` when bit ``t % 32`` of
``bitmask[r, t // 32]`` is 1 (llguidance's and xgrammar's layout, so either library's fill works).
The fill is CPU work that drops the GIL, so an engine can run :meth:`StructuredBatch.fill` on a
thread while the forward pass runs and only :meth:`StructuredBatch.apply_` waits for the logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from lightinfer.structured.matcher import GrammarMatcher


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask ``[batch, ceil(vocab_size / 32)]``, all tokens allowed (-1 = all bits set);
    pinned when CUDA is present so that the copy to the GPU can overlap."""
    if batch < 1 or vocab_size < 1:
        raise ValueError(f"batch and vocab_size must be >= 1, got {batch} and {vocab_size}")
    pin = torch.cuda.is_available()
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


def unpack_bitmask(bitmask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """bool ``[rows, num_tokens]`` (True = allowed) from int32 ``[rows, words]``, on the bitmask's device.
    Tokens past ``32 * words`` come out False."""
    rows, words = bitmask.shape
    covered = min(num_tokens, 32 * words)
    if bitmask.device.type == "cpu":  # numpy's unpackbits: ~20x faster than shifts on CPU
        raw = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)
        bits = torch.from_numpy(np.unpackbits(raw, axis=1, count=covered, bitorder="little").view(np.bool_))
    else:
        bits = unpack_bitmask_by_shifts(bitmask, covered)
    if covered < num_tokens:
        bits = torch.cat([bits, bits.new_zeros(rows, num_tokens - covered)], dim=1)
    return bits


def unpack_bitmask_by_shifts(bitmask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """:func:`unpack_bitmask`'s device path (any device; ``num_tokens <= 32 * words``): torch shifts."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :num_tokens].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None,
                         vocab_size: int | None = None) -> torch.Tensor:
    """Set the disallowed tokens of the constrained rows to ``-inf``, in place.

    Args:
        logits: float ``[batch, V]`` on any device; ``V`` may exceed the tokenizer's vocabulary (padded
            LM head): columns ``>= vocab_size`` are disallowed in constrained rows.
        bitmask: int32 ``[batch, words]`` (CPU or ``logits.device``); row ``r`` belongs to logits row ``r``.
        rows: the constrained rows (others are not read or written); None = all.
        vocab_size: the tokens the bitmask describes (default ``32 * words``).
    Returns:
        ``logits``.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [batch, vocab] and bitmask [batch, words] must have the same batch, got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    batch, width = logits.shape
    idx = list(range(batch)) if rows is None else list(rows)
    if not idx:
        return logits
    vocab = min(width, 32 * bitmask.shape[1] if vocab_size is None else vocab_size)
    whole = len(idx) == batch and idx == list(range(batch))
    if logits.device.type == "cpu" and bitmask.device.type == "cpu":
        return _apply_on_cpu(logits, bitmask, idx, whole, vocab)
    # on a GPU the small int32 mask travels (async from pinned memory) and is unpacked there
    words = bitmask.to(logits.device, non_blocking=True)
    sub = words if whole else words[torch.tensor(idx, device=words.device)]
    allowed = unpack_bitmask(sub, vocab)
    if whole:
        logits[:, :vocab].masked_fill_(~allowed, float("-inf"))
        logits[:, vocab:] = float("-inf")
    else:
        at = torch.tensor(idx, device=logits.device)
        picked = logits.index_select(0, at)
        picked[:, :vocab].masked_fill_(~allowed, float("-inf"))
        picked[:, vocab:] = float("-inf")
        logits.index_copy_(0, at, picked)
    return logits


def _apply_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, idx: list[int], whole: bool,
                  vocab: int) -> torch.Tensor:
    """:func:`apply_token_bitmask_` on the CPU: the *disallowed* bits are unpacked (one numpy pass over the
    inverted words) and written into each constrained row in place, no row of logits copied. numpy does the
    writes (fp32/fp16): single-threaded, so a step's few milliseconds of masking never wait on torch's
    intra-op thread pool, whose threads spin against other work on a busy CPU."""
    words = bitmask if whole else bitmask.index_select(0, torch.tensor(idx, dtype=torch.long))
    raw = np.bitwise_not(np.ascontiguousarray(words.numpy())).view(np.uint8)
    banned = np.unpackbits(raw, axis=1, count=vocab, bitorder="little").view(np.bool_)
    if logits.dtype not in (torch.float32, torch.float16, torch.float64):  # bfloat16: no numpy view
        banned_t = torch.from_numpy(banned)
        for j, r in enumerate(idx):
            logits[r, :vocab].masked_fill_(banned_t[j], float("-inf"))
            logits[r, vocab:] = float("-inf")
        return logits
    rows = logits.numpy()
    for j, r in enumerate(idx):
        np.putmask(rows[r, :vocab], banned[j], -np.inf)
        rows[r, vocab:] = -np.inf
    return logits


class StructuredBatch:
    """The reusable per-step helper: one bitmask buffer, grown as batches grow.

    ``fill(matchers)`` then ``apply_(logits)`` each step (or ``__call__`` for both), where
    ``matchers[r]`` is row ``r``'s :class:`GrammarMatcher` or None for an unconstrained row. Rows
    without a matcher are never touched, so their logits stay bit-identical.

    Args:
        vocab_size: tokens the matchers describe (``GrammarBackend.vocab_size``).
        num_threads: rows are filled on this many threads (llguidance's executor) when there are at
            least ``parallel_min_rows`` constrained rows; 1 = always on the calling thread. Default: 1
            on machines with <= 2 cores (thread hand-off costs more than it saves there), else
            ``min(8, cores // 2)``.
    """

    def __init__(self, vocab_size: int, num_threads: int | None = None, parallel_min_rows: int = 8) -> None:
        cores = os.cpu_count() or 1
        self.vocab_size = vocab_size
        self.num_threads = num_threads if num_threads is not None else (1 if cores <= 2 else min(8, cores // 2))
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        self.parallel_min_rows = parallel_min_rows
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.rows: list[int] = []
        self._executor = None

    def fill(self, matchers: Sequence[GrammarMatcher | None]) -> list[int]:
        """Fill the bitmask rows of the constrained sequences. Returns their row indices."""
        if len(matchers) > self.bitmask.shape[0]:
            self.bitmask = allocate_token_bitmask(max(len(matchers), 2 * self.bitmask.shape[0]), self.vocab_size)
        self.rows = [r for r, m in enumerate(matchers) if m is not None]
        if self.num_threads > 1 and len(self.rows) >= self.parallel_min_rows:
            import llguidance

            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
            width = self.bitmask.shape[1] * 4
            pairs = [(matchers[r]._m, r) for r in self.rows]
            self._executor.unsafe_compute_mask_ptr(pairs, self.bitmask.data_ptr(), width, self.bitmask.shape[0])
            for r in self.rows:  # the JSON number bound of JSON rows (cheap: a small grammar)
                matchers[r].and_guard(self.bitmask[r])
        else:
            for r in self.rows:
                matchers[r].fill_bitmask(self.bitmask, r)
        return self.rows

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` ``[batch, V]`` in place with the rows of the last :meth:`fill`."""
        if not self.rows:
            return logits
        return apply_token_bitmask_(logits, self.bitmask[: logits.shape[0]], self.rows, self.vocab_size)

    def __call__(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """:meth:`fill` then :meth:`apply_`."""
        if len(matchers) != logits.shape[0]:
            raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} rows of logits")
        self.fill(matchers)
        return self.apply_(logits)
