"""BlockManager invariants under random allocate / append / fork / free (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightinfer.engine.block_manager import BlockManager
from lightinfer.engine.sequence import Sequence
from lightinfer.sampling_params import SamplingParams

BS = 4


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for seq in live:
        assert len(seq.block_table) == bm.blocks_needed(seq.num_tokens)
        for b in seq.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], "ref count != number of tables holding the block"
        assert (block.ref_count == 0) == (block.block_id in bm.free_block_ids)
    assert bm.num_free_blocks + sum(1 for r in refs if r) == bm.num_blocks
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h
    for seq in live:  # a block shared by several sequences is full and identical in each
        for i, b in enumerate(seq.block_table):
            if refs[b] > 1:
                assert (i + 1) * BS <= seq.num_computed_tokens
                assert bm.blocks[b].token_ids == seq.token_ids[i * BS:(i + 1) * BS]


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "compute"]),
                         st.integers(0, 1000), st.integers(1, 20)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=True)
    live: list[Sequence] = []
    for op, pick, size in operations:
        if op == "add":
            # few distinct prompts so that prefix hits happen
            seq = Sequence("r", [pick % 3] * size + list(range(pick % 2)), SamplingParams())
            if bm.allocate_slots(seq, seq.num_tokens):
                assert seq.num_computed_tokens < seq.num_tokens
                live.append(seq)
        elif live:
            seq = live[pick % len(live)]
            if op == "append":
                seq.token_ids.append(pick % 5)
                if not bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                    seq.token_ids.pop()
            elif op == "compute":
                seq.num_computed_tokens = seq.num_tokens
                bm.register_computed_blocks(seq)
            elif op == "fork" and bm.can_fork(seq):
                child = seq.fork(1)
                bm.fork(seq, child)
                live.append(child)
            elif op == "free":
                bm.free(seq)
                live.remove(seq)
        check_invariants(bm, live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_hit_token_check_and_lru_reuse() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = Sequence("a", list(range(10)), SamplingParams())
    bm.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = 10
    bm.register_computed_blocks(a)
    bm.free(a)
    b = Sequence("b", list(range(9)) + [99], SamplingParams())
    bm.allocate_slots(b, b.num_tokens)  # two full blocks shared with a's prompt
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a_blocks_expected(bm, list(range(8)))
    # a corrupted cached block fails the token check: no hit
    bm.blocks[b.block_table[0]].token_ids = [7, 7, 7, 7]
    c = Sequence("c", list(range(10)), SamplingParams())
    bm.allocate_slots(c, c.num_tokens)
    assert c.num_cached_tokens == 0


def a_blocks_expected(bm: BlockManager, tokens: list[int]) -> list[int]:
    from lightinfer.engine.block_manager import chain_hash

    out, prev = [], b""
    for i in range(0, len(tokens), BS):
        prev = chain_hash(prev, tokens[i:i + BS])
        out.append(bm.hash_to_block_id[prev])
    return out
