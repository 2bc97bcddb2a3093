"""Paged KV cache bookkeeping: one block pool per KV-cache group, prefix caching, sliding windows.

A token's K/V live in its sequence's block ``i // block_size``, slot ``i % block_size``. Layers that keep
different amounts of context are kept in separate *KV-cache groups*, each with its own pool and its own
block table per sequence (``Sequence.block_tables[g]``)::

    group 0: full attention (Gemma's global layers)     table [b0 b1 b2 b3 b4 b5 b6 b7]   every block kept
    group 1: sliding window W (Gemma's local layers)    table [-1 -1 -1 -1 b4'b5'b6'b7']  blocks before the
                                                                                        window freed (-1)

Why separate pools and not one: a block id names memory in every layer of its pool, so a local layer's
block can only be given back when no layer of its pool needs it. With all layers in one pool the global
layers would pin every block; with the local layers in a pool of their own, a block whose tokens are all
older than the window of the next token to compute goes back to the free queue as decoding advances, and
a local layer holds at most ``(W + chunk - 2) // block_size + 2`` blocks per sequence whatever its length
(``chunk``: the tokens computed in one step). The split of the memory between the pools is the memory
plan's (``engine/memory.py``: in proportion to what one ``max_model_len`` sequence needs in each).

A sliding-window group allocates only the blocks of the step's tokens (the full groups reserve a whole
prompt on admission, as before): it frees as it goes, so reserving a long prompt there would hold blocks
the prompt's own later chunks free again.

Prefix caching (nano-vllm / vLLM): each pool registers its full, computed blocks under the chained hash of
their tokens (``block_pool.py``); freed blocks keep the hash until reused. A new sequence reuses ``k``
leading blocks when every group can serve them: a full group needs all ``k``, a sliding group only those
its window needs for the next token (blocks from ``(k * block_size - W + 1) // block_size`` on), so a
windowed prefix can hit even after its oldest blocks were reused. The largest ``k`` all groups agree on is
taken (a sliding group's valid ``k`` are not a prefix-closed set: the search runs until it is stable).
Only full, computed blocks are ever shared; :meth:`BlockManager.fork` copies a partially filled last block.

One call serves the scheduler, as vLLM v1's ``allocate_slots``: it admits a sequence (the prefix-cache
lookup runs once, there) or grows a running one, freeing what windows have passed, and answers False
instead of allocating when the free blocks of any pool do not suffice (then nothing changes).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from lightinfer.engine.block_pool import NULL_BLOCK, Block, BlockPool, chain_hash
from lightinfer.engine.sequence import Sequence

__all__ = ["NULL_BLOCK", "Block", "BlockManager", "BlockPool", "chain_hash"]


class BlockManager:
    """Allocates KV blocks to sequences in each KV-cache group (module docstring).

    Args:
        num_blocks: blocks per pool: one count for every group, or one per group.
        block_size: token slots per block.
        enable_prefix_caching: look up and register full blocks.
        windows: per group, its sliding window in tokens, or None for full attention (one full group by default).
    """

    def __init__(self, num_blocks: int | SequenceOf[int], block_size: int, enable_prefix_caching: bool = True,
                 windows: SequenceOf[int | None] = (None,)) -> None:
        self.windows = list(windows) or [None]
        counts = [num_blocks] * len(self.windows) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(self.windows):
            raise ValueError(f"{len(counts)} pool sizes for {len(self.windows)} KV-cache groups")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(n) for n in counts]
        self.num_registered: list[dict[int, int]] = [{} for _ in self.pools]  # seq_id -> leading blocks registered
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of which served from it

    # ------------------------------------------------------------------ accounting
    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def num_blocks(self) -> int:
        """Blocks of all pools."""
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of all pools (cached ones included: they are reusable)."""
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def blocks(self) -> list[Block]:
        """Group 0's blocks (the only group of a model without sliding windows)."""
        return self.pools[0].blocks

    @property
    def free_block_ids(self) -> dict[int, None]:
        return self.pools[0].free_block_ids

    @property
    def hash_to_block_id(self) -> dict[bytes, int]:
        return self.pools[0].hash_to_block_id

    def usage(self) -> float:
        """Share of blocks in use, 0..1, of the fullest pool (the one that limits the batch)."""
        return max(1.0 - p.num_free_blocks / max(1, p.num_blocks) for p in self.pools)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_held_blocks(self, seq: Sequence, group: int) -> int:
        """Blocks ``seq`` holds in ``group``'s pool (freed window entries not counted)."""
        tables = seq.block_tables
        return sum(1 for b in tables[group] if b != NULL_BLOCK) if group < len(tables) else 0

    def _first_needed_block(self, group: int, position: int) -> int:
        """The first block a token at ``position`` attends to in ``group`` (0 without a window)."""
        window = self.windows[group]
        return max(0, position - window + 1) // self.block_size if window else 0

    # ------------------------------------------------------------------ prefix cache
    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks, each block hashed once per
        sequence: they are kept on the sequence (its tokens only grow, so a full block never changes)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(chain_hash(hashes[-1] if hashes else b"", tokens))
        return hashes

    def _hit_length(self, group: int, found: list[Block | None], k: int) -> int:
        """The largest ``k' <= k`` whose blocks ``group`` holds: all ``k'`` leading ones for a full group, those
        the next token's window reaches for a sliding one."""
        if not self.windows[group]:
            return next((i for i in range(k) if found[i] is None), k)
        for end in range(k, 0, -1):
            first = self._first_needed_block(group, end * self.block_size)
            if all(found[i] is not None for i in range(end - 1, first - 1, -1)):
                return end
        return 0

    def _prefix_hits(self, seq: Sequence) -> tuple[int, list[list[Block]]]:
        """``(k, hits)``: the leading full blocks every group can serve (at least one token left to compute),
        and per group the cached blocks it takes (all ``k``, or a sliding group's window of them)."""
        if not self.enable_prefix_caching:
            return 0, [[] for _ in self.pools]
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        hashes = self._block_hashes(seq, num_full)
        found: list[list[Block | None]] = []
        for pool in self.pools:
            row: list[Block | None] = []
            for i in range(num_full):
                row.append(pool.cached(hashes[i], seq.token_ids[i * bs:(i + 1) * bs]))
                if row[-1] is None and len(self.pools) == 1 and not self.windows[0]:
                    row += [None] * (num_full - i - 1)  # one full pool: the first miss ends the prefix
                    break
            found.append(row)
        k, stable = num_full, False
        while not stable:  # a sliding group's valid lengths are not prefix-closed: iterate to a fixed point
            stable = True
            for g in range(len(self.pools)):
                kg = self._hit_length(g, found[g], k)
                if kg < k:
                    k, stable = kg, False
        hits = [[b for b in found[g][self._first_needed_block(g, k * bs):k]] for g in range(len(self.pools))]
        return k, hits  # type: ignore[return-value]

    # ------------------------------------------------------------------ API
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_step_tokens: int | None = None,
                       num_lookahead_tokens: int = 0) -> bool:
        """Give ``seq`` KV slots for its next ``num_new_tokens`` tokens to compute; False when blocks run out.

        A sequence without blocks is being admitted (new, or preempted and to be recomputed): its
        leading full blocks are first looked up in the prefix cache, once, and the hits are shared
        and count as computed (``seq.num_computed_tokens``; on the first admission also
        ``seq.num_cached_tokens``). Then full groups add slots for tokens up to ``num_computed_tokens +
        num_new_tokens`` (capped at the sequence's length): the scheduler asks for the whole prompt on
        admission and for the step's chunk (or the one decode token) afterwards. Sliding-window groups first
        free the blocks the window of the next token has passed, and add slots only for the tokens computed
        in this step (``num_step_tokens``, default ``num_new_tokens``).

        Args:
            seq: the sequence; its ``block_tables`` change in place.
            num_new_tokens: tokens to compute after those already computed (or cached).
            num_step_tokens: of which this step computes at most this many (admission: the step's budget).
            num_lookahead_tokens: slots past the sequence's last token (its drafts, ``engine/spec/``), counted in
                ``num_new_tokens``.
        Returns:
            True when every slot is there; False when the free blocks of a pool do not suffice, and then
            nothing changed: the caller preempts another sequence or leaves ``seq`` waiting.
        """
        while len(seq.block_tables) < len(self.pools):
            seq.block_tables.append([])
        admitting = not seq.block_tables[0]
        k, hits = self._prefix_hits(seq) if admitting else (0, [[] for _ in self.pools])
        computed = k * self.block_size if admitting else seq.num_computed_tokens
        step = num_new_tokens if num_step_tokens is None else min(num_new_tokens, num_step_tokens)
        plans = []
        for g, pool in enumerate(self.pools):
            table, windowed = seq.block_tables[g], bool(self.windows[g])
            first = self._first_needed_block(g, computed)
            length = k if admitting else len(table)
            target = min(seq.num_tokens + num_lookahead_tokens, computed + (step if windowed else num_new_tokens))
            num_new_blocks = max(0, self.blocks_needed(target) - length)
            drops = [i for i in range(min(first, len(table))) if table[i] != NULL_BLOCK] if windowed else []
            from_queue = sum(1 for b in hits[g] if b.ref_count == 0)  # hits that leave the free queue too
            released = sum(1 for i in drops if pool.blocks[table[i]].ref_count == 1)
            if num_new_blocks + from_queue > pool.num_free_blocks + released:
                return False
            plans.append((drops, num_new_blocks))
        for g, (pool, (drops, num_new_blocks)) in enumerate(zip(self.pools, plans)):
            table = seq.block_tables[g]
            for i in drops:  # blocks the window has passed: back to the free queue, their hashes kept
                pool.release(table[i])
                table[i] = NULL_BLOCK
            if admitting:
                table += [NULL_BLOCK] * (k - len(hits[g]))  # a sliding group's blocks before the window
                for block in hits[g]:
                    pool.share(block)
                    table.append(block.block_id)
            for _ in range(num_new_blocks):
                table.append(pool.new_block().block_id)
        if admitting:
            for registered in self.num_registered:
                registered[seq.seq_id] = k
            seq.num_computed_tokens = computed
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = seq.num_computed_tokens
                if self.enable_prefix_caching:
                    self.num_queries += seq.num_tokens
                    self.num_hits += seq.num_computed_tokens
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash every block of ``seq`` that is now full and computed, in every group, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        for g, pool in enumerate(self.pools):
            start = self.num_registered[g].get(seq.seq_id, 0)
            if start >= num_full or g >= len(seq.block_tables):
                continue
            hashes = self._block_hashes(seq, num_full)
            table = seq.block_tables[g]
            for i in range(start, num_full):
                if table[i] != NULL_BLOCK:
                    pool.register(table[i], hashes[i], seq.token_ids[i * bs:(i + 1) * bs])
            self.num_registered[g][seq.seq_id] = num_full

    def _fork_private(self, parent: Sequence, group: int) -> list[int]:
        """Indices of ``parent``'s blocks in ``group`` a fork cannot share: those not full and computed."""
        shared = parent.num_computed_tokens // self.block_size
        table = parent.block_tables[group] if group < len(parent.block_tables) else []
        return [i for i in range(shared, len(table)) if table[i] != NULL_BLOCK]

    def can_fork(self, parent: Sequence) -> bool:
        """Whether :meth:`fork` finds the free blocks it needs."""
        return all(len(self._fork_private(parent, g)) <= pool.num_free_blocks for g, pool in enumerate(self.pools))

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int, int]]:
        """Share ``parent``'s full, computed blocks with ``child``; give it its own copy of the rest.

        Returns:
            ``[(group, src_block_id, dst_block_id)]`` KV copies (of a partially computed block) the model
            runner must make before the next forward.
        Raises:
            RuntimeError: not enough free blocks (check :meth:`can_fork` first); nothing changed.
        """
        if not self.can_fork(parent):
            raise RuntimeError(f"fork needs {[len(self._fork_private(parent, g)) for g in range(self.num_groups)]} "
                               f"free blocks per pool, {[p.num_free_blocks for p in self.pools]} left")
        shared = parent.num_computed_tokens // self.block_size
        child.block_tables = [[] for _ in self.pools]
        copies: list[tuple[int, int, int]] = []
        for g, pool in enumerate(self.pools):
            table = parent.block_tables[g] if g < len(parent.block_tables) else []
            for i, block_id in enumerate(table):
                if block_id == NULL_BLOCK:
                    child.block_tables[g].append(NULL_BLOCK)
                elif i < shared:
                    pool.share(pool.blocks[block_id])
                    child.block_tables[g].append(block_id)
                else:
                    dst = pool.new_block()
                    if i * self.block_size < parent.num_computed_tokens:
                        copies.append((g, block_id, dst.block_id))
                    child.block_tables[g].append(dst.block_id)
            self.num_registered[g][child.seq_id] = self.num_registered[g].get(parent.seq_id, 0)
        return copies

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (last block first, so a prompt's tail is evicted before its head)."""
        for g, pool in enumerate(self.pools):
            if g < len(seq.block_tables):
                for block_id in reversed(seq.block_tables[g]):
                    if block_id != NULL_BLOCK:
                        pool.release(block_id)
            self.num_registered[g].pop(seq.seq_id, None)
        seq.block_tables = [[] for _ in self.pools]
