"""How a paged-attention decode launch is split over the context (flash-decoding), decided on the host.

``paged_attention.py`` launches by this plan; the engine sizes the CUDA graphs' memory with
:func:`decode_workspace_bytes`. Torch only (no Triton import), so the engine can ask without paying it.
"""

from __future__ import annotations

import torch

from .launch_utils import cdiv, next_pow2, num_sms

# PROVISIONAL (one H200 run so far): tokens per decode partition. Contexts up to this length run in
# one kernel; longer ones are split and reduced. Small batches use shorter partitions (more programs).
PARTITION_SIZE = 512
MIN_PARTITION_SIZE = 128  # a multiple of every config's block_n
MAX_DECODE_SPLITS = 64  # partitions per sequence at most: the reduction holds [splits, head_dim] in registers


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_ctx: int, device: torch.device) -> tuple[int, int]:
    """``(num_splits, partition_size)`` of a decode launch; ``partition_size`` 0 = adaptive.

    Small batches (``num_seqs * num_kv_heads`` programs would not give every SM two) split each
    sequence's *real* context, read in the kernel, into ``cdiv(2 SMs, programs)`` (at most
    ``MAX_DECODE_SPLITS``) partitions of whole tiles. ``max_ctx`` (the block-table width) cannot size
    them: inside a CUDA graph it is ``max_model_len``, so fixed partitions derived from it either
    left a 300-token chat on one program per KV head (512-token partitions at batch 1 on
    Llama-2-7B: 32 of 132 SMs busy) or, made small, launched thousands of programs that exit at once.
    Larger batches have parallelism to spare: fixed ``PARTITION_SIZE`` partitions (fewer when
    ``max_ctx`` is short), which only split long contexts.
    """
    programs = max(1, num_seqs * num_kv_heads)
    if programs < 2 * num_sms(device):
        return min(MAX_DECODE_SPLITS, cdiv(2 * num_sms(device), programs)), 0
    ctx = max(max_ctx, 1)
    fewest = cdiv(cdiv(ctx, MAX_DECODE_SPLITS), MIN_PARTITION_SIZE) * MIN_PARTITION_SIZE
    part = max(fewest, min(PARTITION_SIZE, cdiv(ctx, MIN_PARTITION_SIZE) * MIN_PARTITION_SIZE))
    return cdiv(ctx, part), part


def decode_block_d(head_dim: int) -> int:
    """The decode kernel's head_dim tile: a power of two, at least 16 (``tl.dot``)."""
    return max(16, next_pow2(head_dim))


def decode_workspace_bytes(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_ctx: int,
                           device: torch.device) -> int:
    """Bytes of the fp32 partials a split decode launch allocates (0 when it does not split): the
    ``[num_seqs, num_heads, splits, block_d]`` accumulators and the ``[.., 2]`` running max and sum.

    Args:
        num_seqs: decodes in the launch; num_heads, num_kv_heads, head_dim: the layer's.
        max_ctx: the block-table bound in tokens (``blocks per row * block_size``).
        device: where it runs (its SM count shapes the plan).
    """
    splits, _ = decode_split_plan(num_seqs, num_kv_heads, max_ctx, device)
    if splits <= 1:
        return 0
    return num_seqs * num_heads * splits * (decode_block_d(head_dim) + 2) * 4
