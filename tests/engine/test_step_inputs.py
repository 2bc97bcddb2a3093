"""The host-side step layout shared by the eager forward and the CUDA-graph decode."""

from __future__ import annotations

import pytest
import torch

from lightinfer.engine.scheduler import ScheduledSequence, SchedulerOutput
from lightinfer.engine.sequence import Sequence
from lightinfer.engine.step_inputs import block_table_tensor, build_step_inputs
from lightinfer.sampling_params import SamplingParams


def _seq(num_tokens: int, table: list[int]) -> Sequence:
    seq = Sequence("r", list(range(1000, 1000 + num_tokens)), SamplingParams())
    seq.block_table = table
    return seq


def _out() -> SchedulerOutput:
    # three decodes (context 10, 3, 7 before this token) then two prefill chunks
    d0, d1, d2 = _seq(11, [5, 6, 7]), _seq(4, [2]), _seq(8, [9, 1])
    p0, p1 = _seq(6, [3, 4]), _seq(20, [8, 0, 11])
    return SchedulerOutput([
        ScheduledSequence(d0, 10, 1), ScheduledSequence(d1, 3, 1), ScheduledSequence(d2, 7, 1),
        ScheduledSequence(p0, 0, 6), ScheduledSequence(p1, 4, 5),  # p1: a middle chunk, no logits
    ])


def test_decodes_sorted_by_context_and_logits_in_scheduled_order() -> None:
    step = build_step_inputs(_out(), all_logits=False, block_size=4)
    assert step.num_decodes == 3
    # rows: d1 (ctx 4), d2 (ctx 8), d0 (ctx 11), then p0's 6 tokens, p1's 5
    assert step.input_ids[:3] == [1003, 1007, 1010]
    assert step.positions == [3, 7, 10, *range(6), *range(4, 9)]
    assert step.context_lens == [4, 8, 11, 6, 9]
    assert step.block_tables == [[2], [9, 1], [5, 6, 7], [3, 4], [8, 0, 11]]
    assert step.slot_mapping[:3] == [2 * 4 + 3, 1 * 4 + 3, 7 * 4 + 2]
    assert step.slot_mapping[3:9] == [12, 13, 14, 15, 16, 17]
    assert step.cu_seqlens_q == [0, 6, 11]
    # scheduled order d0, d1, d2, p0 (p1 does not complete its prompt): rows 2, 0, 1, 8
    assert step.logits_idx == [2, 0, 1, 8]
    assert step.max_num_blocks == 3


def test_all_logits_gives_every_token_in_scheduled_order() -> None:
    step = build_step_inputs(_out(), all_logits=True, block_size=4)
    assert step.logits_idx == [2, 0, 1, *range(3, 14)]


def test_block_table_tensor_pads_rows_and_columns() -> None:
    t = block_table_tensor([[3], [1, 2]], num_rows=3, width=4, fill=-1)
    assert t.dtype == torch.int32
    assert t.tolist() == [[3, -1, -1, -1], [1, 2, -1, -1], [-1, -1, -1, -1]]
    with pytest.raises(ValueError, match="columns"):
        block_table_tensor([[1, 2, 3]], num_rows=1, width=2, fill=0)
    with pytest.raises(ValueError, match="rows"):
        block_table_tensor([[1], [2]], num_rows=1, width=2, fill=0)


def test_a_decode_with_drafts_is_one_decode_row_per_token() -> None:
    """Speculative decoding: a decode with 2 drafts is 3 decode rows at consecutive positions, each with the
    sequence's table and its own context length; all 3 rows' logits are returned, in scheduled order."""
    d0, d1, p0 = _seq(11, [5, 6, 7, 8]), _seq(4, [2, 3]), _seq(6, [3, 4])
    out = SchedulerOutput([ScheduledSequence(d0, 10, 3, [77, 78]), ScheduledSequence(d1, 3, 1),
                           ScheduledSequence(p0, 0, 6)])
    assert out.num_decodes == 2 and out.num_draft_tokens == 2 and out.scheduled[0].completes_prompt
    step = build_step_inputs(out, all_logits=False, block_size=4)
    assert step.num_decodes == 4
    # rows: d1 (ctx 4), then d0's last token and its two drafts, then p0
    assert step.input_ids[:4] == [1003, 1010, 77, 78]
    assert step.positions[:4] == [3, 10, 11, 12]
    assert step.context_lens == [4, 11, 12, 13, 6]
    assert step.block_tables == [[2, 3], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [3, 4]]
    assert step.slot_mapping[:4] == [2 * 4 + 3, 7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0]
    assert step.logits_idx == [1, 2, 3, 0, 9]
