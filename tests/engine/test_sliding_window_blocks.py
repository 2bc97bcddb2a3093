"""Sliding-window KV groups: a local layer's blocks are freed as decoding advances, so the blocks a long
sequence holds there stay bounded; the block manager's invariants hold with two pools; the memory plan
counts the groups apart."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightinfer import LLM, SamplingParams
from lightinfer.engine.block_manager import NULL_BLOCK, BlockManager
from lightinfer.engine.memory import KVGroupNeed, sliding_window_blocks, split_kv_pool
from lightinfer.engine.sequence import Sequence
from lightinfer.sampling_params import SamplingParams as SP
from tests.models.arch_cases import write_case

BS = 4


def test_a_long_sequence_holds_a_bounded_number_of_local_blocks(tmp_path) -> None:
    """Gemma 2 (window 24, 16-token blocks): over a 40 + 200 token sequence the local group never holds more
    than the window plus one step's chunk, decoding holds 3 blocks, the global group holds them all."""
    path = write_case(tmp_path / "m", "gemma2")
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    bm = engine.block_manager
    assert engine.model_runner.kv_windows == [None, 24]
    engine.add_request("r", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    held, while_decoding = [], []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            held.append((bm.num_held_blocks(seq, 0), bm.num_held_blocks(seq, 1), seq.num_computed_tokens))
            if seq.num_computed_tokens > seq.num_prompt_tokens:
                while_decoding.append(bm.num_held_blocks(seq, 1))
    assert held and max(h[1] for h in held) <= sliding_window_blocks(24, 32, 16)  # prefill chunks of 32
    assert max(while_decoding) <= sliding_window_blocks(24, 1, 16) == 3
    last_full, last_local, computed = held[-1]
    assert computed > 200 and last_full == (computed + 1 + 15) // 16 > 12  # the global layers keep every block
    assert last_local <= 3
    assert bm.num_free_blocks == bm.num_blocks  # and everything comes back at the end


def test_an_all_sliding_model_has_one_windowed_group(tmp_path) -> None:
    path = write_case(tmp_path / "m", "mistral-sliding")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert llm.llm_engine.model_runner.kv_windows == [24]
    # 8 blocks of 16 tokens = 128 slots, yet a 300-token sequence runs: its old blocks are reused
    out = llm.generate([list(range(3, 43))], SamplingParams(temperature=0, max_tokens=260, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 260


def test_split_kv_pool_serves_the_same_number_of_long_sequences() -> None:
    full, local = KVGroupNeed("full", 100, 512), KVGroupNeed("local", 100, 260)
    counts = split_kv_pool(10_000_000, [full, local])
    assert counts[0] * 100 + counts[1] * 100 <= 10_000_000
    assert abs(counts[0] / 512 - counts[1] / 260) < 1  # as many max-length sequences in each pool
    assert split_kv_pool(1000, [full]) == [10]


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "fork", "free"]), st.integers(0, 1000),
                         st.integers(1, 30)), max_size=60)


@settings(max_examples=120, deadline=None)
@given(ops)
def test_random_operations_keep_invariants_with_a_sliding_group(operations: list[tuple[str, int, int]]) -> None:
    window = 6
    bm = BlockManager([40, 40], block_size=BS, enable_prefix_caching=True, windows=[None, window])
    live: list[Sequence] = []
    allocated_at: dict[int, int] = {}  # seq_id -> computed tokens at its last allocation (frees happen there)
    for op, pick, size in operations:
        if op == "add":
            seq = Sequence("r", [pick % 3] * size + list(range(pick % 2)), SP())
            if bm.allocate_slots(seq, seq.num_tokens, num_step_tokens=8):
                live.append(seq)
                allocated_at[seq.seq_id] = seq.num_computed_tokens
        elif live:
            seq = live[pick % len(live)]
            if op == "step":  # compute up to 8 tokens (a chunk or a decode), then append one when done
                todo = min(8, seq.num_tokens - seq.num_computed_tokens)
                if todo == 0:
                    seq.token_ids.append(pick % 5)
                    todo = 1
                if bm.allocate_slots(seq, todo):
                    allocated_at[seq.seq_id] = seq.num_computed_tokens
                    seq.num_computed_tokens += todo
                    bm.register_computed_blocks(seq)
                elif seq.num_computed_tokens == seq.num_tokens - 1 and todo == 1:
                    seq.token_ids.pop()
            elif op == "fork" and bm.can_fork(seq):
                child = seq.fork(1)
                bm.fork(seq, child)
                live.append(child)
                allocated_at[child.seq_id] = allocated_at[seq.seq_id]
            elif op == "free":
                bm.free(seq)
                live.remove(seq)
        for g, pool in enumerate(bm.pools):
            refs = [0] * pool.num_blocks
            for s in live:
                for b in s.block_tables[g]:
                    if b != NULL_BLOCK:
                        refs[b] += 1
            for block in pool.blocks:
                assert block.ref_count == refs[block.block_id]
                assert (block.ref_count == 0) == (block.block_id in pool.free_block_ids)
        for s in live:
            local = s.block_tables[1]
            first = max(0, allocated_at[s.seq_id] - window + 1) // BS
            # nothing before the window of the last allocation's first token is held, nothing after is missing
            assert all(b == NULL_BLOCK for b in local[:first])
            assert all(b != NULL_BLOCK for b in local[first:])
            assert bm.num_held_blocks(s, 1) <= sliding_window_blocks(window, 8, BS)
            assert len(s.block_tables[0]) >= (s.num_computed_tokens + BS - 1) // BS
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks
