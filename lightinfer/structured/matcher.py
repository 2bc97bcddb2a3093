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
    """

    def __init__(self, ll_matcher: Any, eos_token_ids: Sequence[int]) -> None:
        self._m = ll_matcher
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_accepted = 0  # tokens accepted since the start (what rollback/replay can undo)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token (an EOS id is accepted where the grammar may end).

        Returns:
            True when accepted; False when the grammar does not allow ``token_id`` here (the state is
            unchanged; with the bitmask applied this means the sampler found no allowed token).
        """
        if self._m.validate_tokens([token_id]) != 1:
            return False
        ok = self._m.consume_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by several tokens, all or nothing. Returns False (state unchanged) when any is refused."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return True
        if self._m.validate_tokens(ids) != len(ids):
            return False
        ok = self._m.consume_tokens(ids)
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

    def allowed_token_ids(self) -> list[int]:
        """The tokens allowed next, as ids (for tests and debugging; :meth:`fill_bitmask` is the fast path)."""
        words = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return torch.nonzero(bits.flatten()).flatten().tolist()

    def is_terminated(self) -> bool:
        """The grammar has reached its end: nothing but EOS may follow (finish with reason "stop")."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is complete under the grammar (EOS is allowed now), though it may go on."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """The library's error when the state is broken (should not happen with the bitmask applied)."""
        return self._m.get_error() or None if self._m.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: ``num_tokens`` negative or more than were accepted.
        """
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self.error}")
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._m.reset()
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
        twin = GrammarMatcher(self._m.deep_copy(), self.eos_token_ids)
        twin.num_accepted = self.num_accepted
        return twin
