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

from . import cpu_native

# Soft-capped attention has no SDPA kernel: its scores are computed explicitly, this many queries at a time
# (bounds the [H, rows, Lk] fp32 score block: 32 MiB for 8 heads over 2,048 keys).
SOFTCAP_QUERY_CHUNK = 512


def visible_mask(lq: int, lk: int, causal_offset: int, window: int, device: torch.device) -> torch.Tensor:
    """bool ``[lq, lk]``: query i sees key j when ``j <= causal_offset + i`` and, with ``window > 0``,
    ``j > causal_offset + i - window`` (the last ``window`` tokens, itself included)."""
    last = torch.arange(lq, device=device).unsqueeze(1) + causal_offset
    key = torch.arange(lk, device=device).unsqueeze(0)
    mask = key <= last
    if window > 0:
        mask &= key > last - window
    return mask


def attend_softcap(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int,
                   window: int, softcap: float) -> torch.Tensor:
    """:func:`attend` with ``softcap > 0``: scores ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2), computed
    explicitly in fp32, GQA heads as rows of their KV head (K/V never repeated)."""
    lq, h, d = q.shape
    hkv = k.shape[1]
    kf, vf = k.to(torch.float32).transpose(0, 1), v.to(torch.float32).transpose(0, 1)  # [Hkv, Lk, D]
    out = torch.empty_like(q)
    for a in range(0, lq, SOFTCAP_QUERY_CHUNK):
        b = min(lq, a + SOFTCAP_QUERY_CHUNK)
        qf = q[a:b].to(torch.float32).reshape(b - a, hkv, h // hkv, d).permute(1, 0, 2, 3)  # [Hkv, n, G, D]
        s = torch.einsum("hngd,hkd->hngk", qf, kf) * scale
        s = torch.tanh(s / softcap) * softcap
        mask = visible_mask(b - a, k.shape[0], causal_offset + a, window, q.device)
        s = s.masked_fill(~mask[None, :, None, :], float("-inf"))
        o = torch.einsum("hngk,hkd->hngd", torch.softmax(s, dim=-1), vf)  # [Hkv, n, G, D]
        out[a:b] = o.permute(1, 0, 2, 3).reshape(b - a, h, d).to(q.dtype)
    return out


def _work_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """fp32, or bf16 for bf16 inputs on a CPU that multiplies bf16 in hardware (``cpu_native.bf16_gemm_native``):
    torch's bf16 flash kernel keeps fp32 scores, softmax and sums and rounds only the probabilities to bf16 for
    the value product (as GPU flash attention does; ~0.2% of the output, its own bf16 rounding's size), and took
    0.4-0.5x the time of the fp32 kernel at 128-512 tokens (Intel Xeon with AMX, 2026-12-06)."""
    if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.bfloat16 and cpu_native.bf16_gemm_native():
        return torch.bfloat16
    return torch.float32


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int, window: int = 0,
           softcap: float = 0.0) -> torch.Tensor:
    """One sequence: q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]``; query i sees keys ``<= causal_offset + i`` (with
    ``window > 0`` only the last ``window`` of them); ``softcap > 0``: tanh-capped scores (:func:`attend_softcap`).
    fp32 softmax (bf16 probabilities for the value product where :func:`_work_dtype` says so); returns
    ``[Lq, H, D]`` in ``q.dtype``."""
    if softcap > 0:
        return attend_softcap(q, k, v, scale, causal_offset, window, softcap)
    lq, lk = q.shape[0], k.shape[0]
    # [1, H, L, D]: torch's fused CPU kernel (flash, GQA-aware) takes only 4-D inputs; 3-D falls
    # back to the unfused math path, ~3x slower at 300 tokens.
    work = _work_dtype(q, k, v)
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).to(work) for t in (q, k, v))
    mask = None
    # SDPA's is_causal aligns top-left; a cached prefix needs an offset, a window its lower bound
    if causal_offset != 0 or lq != lk or (0 < window < lk):
        mask = visible_mask(lq, lk, causal_offset, window, q.device)
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention without a cache within each of the sequences ``cu_seqlens`` cuts the batch into.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]`` (H a multiple of Hkv).
        cu_seqlens: int32 ``[num_seqs + 1]`` offsets into T.
        scale: softmax scale.
        window: sliding window (each query sees the last ``window`` tokens); 0 = none.
        softcap: tanh soft-capping of the scaled scores; 0 = none.
    Returns:
        ``[T, H, D]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        if q.is_cuda and softcap <= 0 and not 0 < window < b - a:
            out[a:b] = attend_gpu(q[a:b], k[a:b], v[a:b], scale)
        else:
            out[a:b] = attend(q[a:b], k[a:b], v[a:b], scale, causal_offset=0, window=window, softcap=softcap)
    return out
