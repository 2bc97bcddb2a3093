"""Causal attention through torch's fused ``scaled_dot_product_attention`` (SDPA), on any device.

The ``torch_cpu`` backend attends with it (prefill over gathered cache blocks, cache-free attention), and
the ``triton`` backend uses :func:`varlen_causal_attention` for cache-free forwards (calibration, the
engine's memory profiling): that attention has no Triton kernel of ours, and on a GPU SDPA's flash kernel
is the fast one.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    """One sequence: q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]``; query i sees keys ``<= causal_offset + i``.
    fp32 softmax; returns ``[Lq, H, D]`` in ``q.dtype``."""
    lq, lk = q.shape[0], k.shape[0]
    # [1, H, L, D]: torch's fused CPU kernel (flash, GQA-aware) takes only 4-D inputs; 3-D falls
    # back to the unfused math path, ~3x slower at 300 tokens.
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).to(torch.float32) for t in (q, k, v))
    mask = None
    if causal_offset != 0 or lq != lk:  # SDPA's is_causal aligns top-left; a cached prefix needs an offset
        qi = torch.arange(lq, device=q.device).unsqueeze(1) + causal_offset
        mask = torch.arange(lk, device=q.device).unsqueeze(0) <= qi
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).to(q.dtype)


def attend_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence on a GPU, in its own dtype with K/V heads expanded.

    In fp32 with ``enable_gqa`` SDPA falls back to its math kernel and builds the whole
    ``[H, L, L]`` score matrix (1 GiB at 2,048 tokens and 32 heads), which the engine's profiling
    forward would then count as activation memory; fp16/bf16 without GQA take the flash kernel.
    """
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(group, 1),
                                                           v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention without a cache within each of the sequences ``cu_seqlens`` cuts the batch into.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]`` (H a multiple of Hkv).
        cu_seqlens: int32 ``[num_seqs + 1]`` offsets into T.
        scale: softmax scale.
    Returns:
        ``[T, H, D]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        if q.is_cuda:
            out[a:b] = attend_gpu(q[a:b], k[a:b], v[a:b], scale)
        else:
            out[a:b] = attend(q[a:b], k[a:b], v[a:b], scale, causal_offset=0)
    return out
