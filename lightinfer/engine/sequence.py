"""A Sequence: one completion's tokens, its KV blocks and its progress."""

from __future__ import annotations

import enum
import itertools

from lightinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """WAITING (queued or preempted), RUNNING (holds KV blocks), FINISHED."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_counter = itertools.count()


class Sequence:
    """Token ids (prompt + output) plus the engine's bookkeeping for one completion.

    Attributes:
        seq_id: unique id.
        request_id: the request it belongs to; ``index`` its completion number (0..n-1).
        token_ids: prompt then generated ids.
        num_prompt_tokens: prompt length in tokens.
        num_computed_tokens: tokens whose K/V are in the cache (prefix-cache hits included).
        num_cached_tokens: prompt tokens served by the prefix cache at the first admission.
        block_tables: per KV-cache group (``engine/block_manager.py``), its KV block ids in order; a
            sliding-window group has -1 where it freed a block its window has passed.
        block_table: ``block_tables[0]`` (the only one of a model without sliding windows).
        block_hashes: chained hashes of its full blocks, filled by the BlockManager as needed.
        spec_token_ids: draft tokens to verify in the next step (speculative decoding, ``engine/spec/``);
            not part of ``token_ids`` until accepted.
    """

    def __init__(
        self, request_id: str, token_ids: list[int], sampling_params: SamplingParams, index: int = 0
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_tables: list[list[int]] = [[]]
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.block_hashes: list[bytes] = []
        self.admitted = False  # admitted once: num_cached_tokens is fixed from then on
        self.spec_token_ids: list[int] = []

    @property
    def block_table(self) -> list[int]:
        """KV-cache group 0's block ids (the only group of a model without sliding windows)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, index: int) -> Sequence:
        """A sibling with the same tokens and progress (blocks are shared by the BlockManager)."""
        child = Sequence(self.request_id, self.token_ids, self.sampling_params, index)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.admitted = self.admitted
        child.block_hashes = list(self.block_hashes)  # same tokens so far: the same full blocks
        return child
