"""Paged KV cache bookkeeping with prefix caching.

The pool is ``num_blocks`` blocks of ``block_size`` token slots. A sequence's ``block_table``
lists its blocks; token ``i`` lives in slot ``block_table[i // block_size] * block_size +
i % block_size``.

Prefix caching (as in nano-vllm / vLLM): once a block is full *and computed*, it is registered
under a chained hash ``h_i = sha256(h_{i-1} || tokens of block i)``. A new sequence whose first
blocks hash the same (and hold the same tokens, checked on every hit) reuses them with a ref
count. Freed blocks keep their hash and go to the back of the free queue, so the least recently
used cached block is the first to be reused::

    free queue:  [least recently freed ... most recently freed]
                 allocation pops from the left; a cache hit on a free block takes it out.

Only full, computed blocks are ever shared; :meth:`BlockManager.fork` copies a partially
filled last block (copy-on-fork) and returns the copies the model runner must make.

One call serves the scheduler, as vLLM v1's ``allocate_slots``: it admits a sequence (the
prefix-cache lookup runs once, there) or grows a running one, and answers False instead of
allocating when the free blocks do not suffice. Each full block of a sequence is hashed once
(the hashes live on the sequence), whether for a lookup or for registering it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from lightinfer.engine.sequence import Sequence


def chain_hash(prev: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block given its predecessor's hash (b"" for the first block)."""
    return hashlib.sha256(prev + array("q", token_ids).tobytes()).digest()


class Block:
    """One KV block: its id, ref count, and (once full and computed) hash and tokens."""

    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: list[int] = []


class BlockManager:
    """Allocates KV blocks to sequences; prefix caching by chained block hashes.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: look up and register full blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.num_registered: dict[int, int] = {}  # seq_id -> how many of its leading blocks are registered
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of which served from it

    # ------------------------------------------------------------------ accounting
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        """Share of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------ internals
    def _take_free(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, _ = self.free_block_ids.popitem(last=False)
        else:
            del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def _new_block(self) -> Block:
        """A fresh block for new content: the least recently freed one, its old hash dropped."""
        block = self._take_free()
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, []
        return block

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks, each block hashed once per
        sequence: they are kept on the sequence (its tokens only grow, so a full block never changes)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(chain_hash(hashes[-1] if hashes else b"", tokens))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[Block]:
        """Blocks that hold this sequence's leading full blocks (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Block] = []
        num_full = (seq.num_tokens - 1) // self.block_size
        for i, h in enumerate(self._block_hashes(seq, num_full)[:num_full]):
            block_id = self.hash_to_block_id.get(h)
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            if block_id is None or self.blocks[block_id].token_ids != tokens:  # token check on every hit
                break
            hits.append(self.blocks[block_id])
        return hits

    # ------------------------------------------------------------------ API
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` KV slots for its next ``num_new_tokens`` tokens to compute; False when blocks run out.

        A sequence without blocks is being admitted (new, or preempted and to be recomputed): its
        leading full blocks are first looked up in the prefix cache, once, and the hits are shared
        and count as computed (``seq.num_computed_tokens``; on the first admission also
        ``seq.num_cached_tokens``). Then slots are added for tokens up to ``num_computed_tokens +
        num_new_tokens`` (capped at the sequence's length): the scheduler asks for the whole prompt
        on admission and for the step's chunk (or the one decode token) afterwards.

        Args:
            seq: the sequence; its ``block_table`` grows in place.
            num_new_tokens: tokens to compute after those already computed (or cached).
        Returns:
            True when every slot is there; False when the free blocks do not suffice, and then
            nothing changed: the caller preempts another sequence or leaves ``seq`` waiting.
        """
        admitting = not seq.block_table
        hits = self._cached_prefix(seq) if admitting else []
        num_tokens = min(seq.num_tokens, len(hits) * self.block_size + (
            0 if admitting else seq.num_computed_tokens) + num_new_tokens)
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - len(hits) - len(seq.block_table))
        in_free_queue = sum(1 for b in hits if b.ref_count == 0)  # hits that leave the free queue too
        if num_new_blocks + in_free_queue > self.num_free_blocks:
            return False
        for block in hits:
            if block.ref_count == 0:
                self._take_free(block.block_id)
            else:
                block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._new_block().block_id)
        if admitting:
            self.num_registered[seq.seq_id] = len(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = seq.num_computed_tokens
                if self.enable_prefix_caching:
                    self.num_queries += seq.num_tokens
                    self.num_hits += seq.num_computed_tokens
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash every block of ``seq`` that is now full and computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self.num_registered.get(seq.seq_id, 0)
        if start >= num_full:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = hashes[i], seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            self.hash_to_block_id.setdefault(hashes[i], block.block_id)
        self.num_registered[seq.seq_id] = num_full

    def _fork_private(self, parent: Sequence) -> list[int]:
        """Indices of ``parent``'s blocks a fork cannot share: those not full and computed."""
        shared = parent.num_computed_tokens // self.block_size
        return list(range(shared, len(parent.block_table)))

    def can_fork(self, parent: Sequence) -> bool:
        """Whether :meth:`fork` finds the free blocks it needs."""
        return len(self._fork_private(parent)) <= self.num_free_blocks

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Share ``parent``'s full, computed blocks with ``child``; give it its own copy of the rest.

        Returns:
            ``[(src_block_id, dst_block_id)]`` KV copies (of a partially computed block) the model
            runner must make before the next forward.
        Raises:
            RuntimeError: not enough free blocks (check :meth:`can_fork` first); nothing changed.
        """
        private = self._fork_private(parent)
        if len(private) > self.num_free_blocks:
            raise RuntimeError(f"fork needs {len(private)} free blocks, {self.num_free_blocks} left")
        copies: list[tuple[int, int]] = []
        for i, block_id in enumerate(parent.block_table):
            if i < len(parent.block_table) - len(private):
                self.blocks[block_id].ref_count += 1
                child.block_table.append(block_id)
                continue
            dst = self._new_block()
            if i * self.block_size < parent.num_computed_tokens:
                copies.append((block_id, dst.block_id))
            child.block_table.append(dst.block_id)
        self.num_registered[child.seq_id] = self.num_registered.get(parent.seq_id, 0)
        return copies

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (last block first, so a prompt's tail is evicted before its head)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than allocated"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        self.num_registered.pop(seq.seq_id, None)
