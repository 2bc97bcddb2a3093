"""The host-side layout of one step: flat token lists in the order the forward runs them.

Both the eager forward (``ModelRunner``) and the CUDA-graph decode (``cuda_graph.py``) start
from the same :class:`StepInputs`, so the order of rows and the mapping of logits rows back
to ``out.scheduled`` exist in one place only::

    out.scheduled   [d0 d1 d2 | p0 p1]     decodes first (scheduler), then prefill chunks
    token rows      [d1 d2 d0 | p0... p1...] decodes sorted by context length (the CPU decode
                                            groups neighbours), prefills as scheduled
    logits_idx      rows of the sampled tokens, in ``out.scheduled`` order

A decode with ``k`` drafts (speculative decoding, ``engine/spec/``) is ``k + 1`` decode rows: its last token and
the drafts, at consecutive positions, each row with the sequence's block table and its own context length
(``start + 1 .. start + k + 1``). Every row's K/V is stored before any row attends, so each draft sees the ones
before it: causal attention inside the verified run, on every decode path (Triton, C, recorded CPU steps, CUDA
graphs) without a kernel of its own. All its rows are in ``logits_idx``.

A model with sliding-window layers has more than one KV-cache group (``block_manager.py``): each group's
slots and block tables come from its own ``seq.block_tables[g]``; group 0's are the fields below, the
others are in ``other_groups``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightinfer.engine.scheduler import SchedulerOutput


@dataclass
class GroupStepInputs:
    """One more KV-cache group's slots and tables for a step (rows as :class:`StepInputs`')."""

    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)


@dataclass
class StepInputs:
    """One step as Python lists (no tensors, no device).

    Attributes:
        input_ids: ``[num_tokens]`` token ids, decodes first.
        positions: ``[num_tokens]`` absolute position of each token.
        slot_mapping: ``[num_tokens]`` KV cache slot (``block * block_size + offset``) of each token.
        context_lens: ``[num_seqs]`` tokens in the cache per sequence after this step, row order.
        block_tables: ``num_seqs`` block-id lists, row order (ragged).
        cu_seqlens_q: ``[num_prefills + 1]`` offsets of the prefill chunks, from the first prefill token.
        num_decodes: rows (= tokens) at the front that are decodes: one per decoding sequence, plus its drafts.
        logits_idx: token rows whose logits are returned, in ``out.scheduled`` order.
        seq_rows: ``(first, end)`` token rows of each scheduled sequence, in ``out.scheduled`` order (pooling).
        other_groups: KV-cache groups 1.. (module docstring); the fields above are group 0's.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    num_decodes: int = 0
    logits_idx: list[int] = field(default_factory=list)
    seq_rows: list[tuple[int, int]] = field(default_factory=list)
    other_groups: list[GroupStepInputs] = field(default_factory=list)

    @property
    def max_num_blocks(self) -> int:
        """Longest block table of the step in any group (>= 1, so that a table tensor is never 0 wide)."""
        tables = [*self.block_tables, *(t for g in self.other_groups for t in g.block_tables)]
        return max([1, *(len(t) for t in tables)])


def build_step_inputs(out: SchedulerOutput, all_logits: bool, block_size: int, num_groups: int = 1) -> StepInputs:
    """Lay out ``out`` as flat lists (see the module docstring for the order).

    Args:
        out: the scheduled step (decodes first).
        all_logits: a logits row for every computed token (scoring) instead of one per
            sequence that completes its prompt.
        block_size: tokens per KV block.
        num_groups: KV-cache groups (each sequence has that many block tables).
    Returns:
        The step's :class:`StepInputs`.
    """
    nd = out.num_decodes
    step = StepInputs(num_decodes=nd + out.num_draft_tokens,
                      other_groups=[GroupStepInputs() for _ in range(num_groups - 1)])
    decode_order = sorted(range(nd), key=lambda i: out.scheduled[i].start)
    token_range: dict[int, tuple[int, int]] = {}
    for i in decode_order + list(range(nd, len(out.scheduled))):
        s = out.scheduled[i]
        seq, a, b = s.seq, s.start, s.start + s.num_new_tokens
        token_range[i] = (len(step.input_ids), len(step.input_ids) + s.num_new_tokens)
        step.input_ids += seq.token_ids[a:b - len(s.draft_ids)] + s.draft_ids
        step.positions += range(a, b)
        table = seq.block_table
        rows = s.num_new_tokens if i < nd else 1  # a decode's drafts are rows of their own
        step.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(a, b)]
        step.context_lens += range(b - rows + 1, b + 1)
        step.block_tables += [table] * rows
        for g, group in enumerate(step.other_groups, start=1):
            gtable = seq.block_tables[g]
            group.slot_mapping += [gtable[p // block_size] * block_size + p % block_size for p in range(a, b)]
            group.block_tables += [gtable] * rows
        if i >= nd:
            step.cu_seqlens_q.append(step.cu_seqlens_q[-1] + s.num_new_tokens)
    step.seq_rows = [token_range[i] for i in range(len(out.scheduled))]
    for i, s in enumerate(out.scheduled):
        first, end = token_range[i]
        if all_logits:
            step.logits_idx += range(first, end)
        elif s.draft_ids:
            step.logits_idx += range(end - len(s.draft_ids) - 1, end)
        elif s.completes_prompt:
            step.logits_idx.append(end - 1)
    return step


def block_table_tensor(tables: list[list[int]], num_rows: int, width: int, fill: int) -> torch.Tensor:
    """Ragged block tables -> int32 ``[num_rows, width]`` on the CPU, ``fill`` where no block is.

    Rows past ``len(tables)`` are all ``fill`` (the padding rows of a CUDA-graph batch).

    Raises:
        ValueError: a table longer than ``width`` or more tables than ``num_rows``.
    """
    if len(tables) > num_rows:
        raise ValueError(f"{len(tables)} block tables do not fit in {num_rows} rows")
    longest = max((len(t) for t in tables), default=0)
    if longest > width:
        raise ValueError(f"a block table of {longest} blocks does not fit in {width} columns")
    # One tensor from padded Python lists: a tensor per row costs ~5 us each, 1 ms at 256 rows.
    rows = [t + [fill] * (width - len(t)) for t in tables]
    rows += [[fill] * width] * (num_rows - len(tables))
    return torch.tensor(rows, dtype=torch.int32).reshape(num_rows, width)


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` along dim 0; ``x`` itself when ``rows`` is every row in order (a decode-only step
    samples each sequence once), which skips an index upload and a gather kernel."""
    if rows == list(range(x.shape[0])):
        return x
    return x[torch.tensor(rows, dtype=torch.long, device=x.device)]
