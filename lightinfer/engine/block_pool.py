"""One KV pool's blocks: ref counts, the LRU free queue and the prefix-cache hash map.

The pool is ``num_blocks`` blocks of ``block_size`` token slots. Once a block is full *and computed*, it is
registered under a chained hash ``h_i = sha256(h_{i-1} || tokens of block i)``; freed blocks keep their hash
and go to the back of the free queue, so the least recently used cached block is the first to be reused::

    free queue:  [least recently freed ... most recently freed]
                 allocation pops from the left; a cache hit on a free block takes it out.

``block_manager.py`` owns one pool per KV-cache group and decides which blocks a sequence holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

NULL_BLOCK = -1
"""A block-table entry whose block was freed (a sliding-window group's blocks the window has passed)."""


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


class BlockPool:
    """The blocks of one KV pool (module docstring).

    Args:
        num_blocks: blocks in the pool.
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def take(self, block_id: int | None = None) -> Block:
        """Take block ``block_id`` (or the least recently freed one) out of the free queue, ref count 1."""
        if block_id is None:
            block_id, _ = self.free_block_ids.popitem(last=False)
        else:
            del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def new_block(self) -> Block:
        """A fresh block for new content: the least recently freed one, its old hash dropped."""
        block = self.take()
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, []
        return block

    def share(self, block: Block) -> None:
        """One more holder of ``block`` (a prefix-cache hit or a fork); a free block leaves the free queue."""
        if block.ref_count == 0:
            self.take(block.block_id)
        else:
            block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One holder fewer; at zero the block goes to the back of the free queue (its hash kept)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than allocated"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def cached(self, block_hash: bytes, token_ids: list[int]) -> Block | None:
        """The block registered under ``block_hash`` if it still holds ``token_ids`` (checked on every hit)."""
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return self.blocks[block_id]

    def register(self, block_id: int, block_hash: bytes, token_ids: list[int]) -> None:
        """Record a full, computed block for later hits (the first block with a hash keeps it)."""
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, token_ids
        self.hash_to_block_id.setdefault(block_hash, block_id)
