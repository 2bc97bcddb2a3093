"""Per-sequence grammar state: which tokens may come next, fed one sampled token at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class GrammarMatcher:
    """The grammar state of one sequence (made by :meth:`GrammarBackend.matcher`).

    Life of a constrained sequence, once per decode step: :meth:`fill_bitmask` writes the allowed
    tokens into the sequence's row of the batch bitmask, the sampler draws from the masked logits,
    :meth:`accept_token` advances the state. When :meth:`is_terminated` turns true the grammar can
    take nothing more but EOS: the completion is finished (reason "stop"). A token the grammar rejects
    is refused (False) and leaves the state as it was.

    Preemption by recompute: :meth:`replay` (reset, then accept the tokens generated so far).
    ``n > 1`` / beam-like copies: :meth:`fork`. Speculative or jump-forward rewinds: :meth:`rollback`.

    ``guard`` (JSON constraints): a second llguidance matcher that every token must also pass, the JSON
    number bound (:data:`~lightinfer.structured.spec.JSON_NUMBER_GUARD_LARK`); the allowed tokens are
    those both allow, and it moves in step with the main grammar.
    """

    def __init__(self, ll_matcher: Any, eos_token_ids: Sequence[int], guard: Any = None) -> None:
        self._m = ll_matcher
        self._guard = guard
        self._guard_words: torch.Tensor | None = None  # scratch row for the guard's mask
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_accepted = 0  # tokens accepted since the start (what rollback/replay can undo)

    def _matchers(self) -> tuple[Any, ...]:
        return (self._m,) if self._guard is None else (self._m, self._guard)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token (an EOS id is accepted where the grammar may end).

        Returns:
            True when accepted; False when the grammar does not allow ``token_id`` here (the state is
            unchanged; with the bitmask applied this means the sampler found no allowed token).
        """
        if any(m.validate_tokens([token_id]) != 1 for m in self._matchers()):
            return False
        done = [m.consume_token(token_id) for m in self._matchers()]  # both advance, no short cut
        ok = all(done)
        if ok:
            self.num_accepted += 1
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by several tokens, all or nothing. Returns False (state unchanged) when any is refused."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return True
        if any(m.validate_tokens(ids) != len(ids) for m in self._matchers()):
            return False
        done = [m.consume_tokens(ids) for m in self._matchers()]
        ok = all(done)
        if ok:
            self.num_accepted += len(ids)
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``: bit ``t % 32`` of int32 word ``t // 32``
        is 1 when token ``t`` is allowed. ``bitmask`` is a CPU, contiguous int32 ``[batch, words]``
        tensor (see :func:`allocate_token_bitmask`). Drops the GIL while it works."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError(f"bitmask must be a contiguous int32 CPU tensor, got {bitmask.dtype} on "
                             f"{bitmask.device} (contiguous={bitmask.is_contiguous()})")
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is outside the bitmask's {bitmask.shape[0]} rows")
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        self.and_guard(words)

    def and_guard(self, words: torch.Tensor) -> None:
        """Clear in ``words`` (this sequence's int32 bitmask row, CPU, contiguous) the tokens the guard
        refuses; nothing without a guard. :meth:`fill_bitmask` calls it; a batched fill of the main
        grammars calls it after."""
        if self._guard is None:
            return
        if self._guard_words is None or self._guard_words.numel() != words.numel():
            self._guard_words = torch.empty_like(words)
        self._guard.unsafe_compute_mask_ptr(self._guard_words.data_ptr(), self._guard_words.numel() * 4)
        words.bitwise_and_(self._guard_words)

    def allowed_token_ids(self) -> list[int]:
        """The tokens allowed next, as ids (for tests and debugging; :meth:`fill_bitmask` is the fast path)."""
        words = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)
        if self._guard is not None:
            words = words & torch.frombuffer(bytearray(self._guard.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return torch.nonzero(bits.flatten()).flatten().tolist()

    def is_terminated(self) -> bool:
        """The grammar has reached its end: nothing but EOS may follow (finish with reason "stop")."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is complete under the grammar (EOS is allowed now), though it may go on."""
        return all(m.is_accepting() for m in self._matchers())

    @property
    def error(self) -> str | None:
        """The library's error when the state is broken (should not happen with the bitmask applied)."""
        for m in self._matchers():
            if m.is_error():
                return m.get_error() or "grammar error"
        return None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: ``num_tokens`` negative or more than were accepted.
        """
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        undone = [m.rollback(num_tokens) for m in self._matchers()] if num_tokens else []
        if not all(undone):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self.error}")
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar."""
        for m in self._matchers():
            m.reset()
        self.num_accepted = 0

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Reset, then accept ``token_ids`` (a preempted sequence's generated tokens, on recompute).
        Returns False, reset, when they do not fit the grammar."""
        self.reset()
        if self.accept_tokens(token_ids):
            return True
        self.reset()
        return False

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same state (one per extra completion of ``n > 1``)."""
        twin = GrammarMatcher(self._m.deep_copy(), self.eos_token_ids,
                              guard=self._guard.deep_copy() if self._guard is not None else None)
        twin.num_accepted = self.num_accepted
        return twin
