"""Group-wise asymmetric 4-bit quantization and the AutoAWQ "gemm" disk layout.

Pure functions, no modules (the gpt-fast split: primitives / offline converter / load-time swap).

Quantization of a weight ``W [N, K]`` (``nn.Linear`` orientation: N outputs, K inputs) with
group size G, per output row ``n`` and group ``g`` of G consecutive input channels::

    s[n, g] = fp16((max(W[n, g]) - min(W[n, g])) / 15)     (>= 1e-5, so all-zero groups work)
    z[n, g] = clamp(round(-min(W[n, g]) / s[n, g]), 0, 15)
    q[n, k] = clamp(round(W[n, k] / s[n, g]) + z[n, g], 0, 15)
    W'[n, k] = (q[n, k] - z[n, g]) * s[n, g]

The scale is rounded to fp16 *before* the codes are computed, so the codes are the best ones
for the scale that is actually stored.

Disk layout (DESIGN.md "Formats", AutoAWQ ``WQLinear_GEMM``): ``qweight`` int32 ``[K, N // 8]``,
``qzeros`` int32 ``[K // G, N // 8]``, ``scales`` fp16 ``[K // G, N]``; packing along N with the
nibble order of :data:`kernels.reference.AWQ_ORDER` (reused here, not duplicated).
"""

from __future__ import annotations

import torch

from lightinfer.kernels import pack_awq, unpack_awq

MIN_SCALE = 1e-5


def check_finite(w: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` when ``w`` holds NaN or inf."""
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{name}: {bad} non-finite value(s) (NaN/inf) in the weight; cannot quantize it")


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not divisible by group_size {group_size}")
    return w.reshape(n, k // group_size, group_size)


def quantize_groups(
    w: torch.Tensor, group_size: int, w_bit: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise quantization (module docstring).

    Args:
        w: float ``[N, K]``; any float dtype (computed in fp32).
        group_size: G, divides K.
        w_bit: bits per code (4).
    Returns:
        ``(codes int32 [N, K], scales fp16 [N, K // G], zeros int32 [N, K // G])``.
    Raises:
        ValueError: K not divisible by G.
    """
    qmax = 2**w_bit - 1
    wg = _grouped(w.to(torch.float32), group_size)  # [N, K/G, G]
    lo, hi = torch.aminmax(wg, dim=-1)
    scales = ((hi - lo) / qmax).clamp_(min=MIN_SCALE).to(torch.float16)
    s = scales.to(torch.float32).unsqueeze(-1)
    zeros = torch.round(-lo.unsqueeze(-1) / s).clamp_(0, qmax)
    codes = torch.div(wg, s).round_().add_(zeros).clamp_(0, qmax)
    return codes.reshape(w.shape).to(torch.int32), scales, zeros.squeeze(-1).to(torch.int32)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: -> fp32 ``[N, K]``."""
    n, k = codes.shape
    g = k // scales.shape[1]
    cg = codes.to(torch.float32).reshape(n, k // g, g)
    return ((cg - zeros.to(torch.float32).unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)).reshape(n, k)


def fake_quantize(w: torch.Tensor, group_size: int, w_bit: int = 4) -> torch.Tensor:
    """Quantize then dequantize: fp32 ``[N, K]`` -> fp32 ``[N, K]`` (what the kernel will compute with).

    Same arithmetic as :func:`quantize_groups` + :func:`dequantize_groups`, without the int copies.
    """
    qmax = 2**w_bit - 1
    wg = _grouped(w.to(torch.float32), group_size)
    lo, hi = torch.aminmax(wg, dim=-1)
    s = ((hi - lo) / qmax).clamp_(min=MIN_SCALE).to(torch.float16).to(torch.float32).unsqueeze(-1)
    zeros = torch.round(-lo.unsqueeze(-1) / s).clamp_(0, qmax)
    q = torch.div(wg, s).round_().add_(zeros).clamp_(0, qmax)
    return q.sub_(zeros).mul_(s).reshape(w.shape)


def pack(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nn.Linear``-oriented codes -> AutoAWQ gemm tensors.

    Args:
        codes: int ``[N, K]`` in 0..15; scales: ``[N, K // G]``; zeros: int ``[N, K // G]``.
    Returns:
        ``(qweight int32 [K, N // 8], qzeros int32 [K // G, N // 8], scales fp16 [K // G, N])``.
    Raises:
        ValueError: N not a multiple of 8, or a code outside 0..15.
    """
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")
    qweight = pack_awq(codes.t().contiguous())
    qzeros = pack_awq(zeros.t().contiguous())
    return qweight, qzeros, scales.t().contiguous().to(torch.float16)


def unpack(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: -> ``(codes int32 [N, K], scales fp16 [N, K // G], zeros int32 [N, K // G])``."""
    codes = unpack_awq(qweight).t().contiguous()
    zeros = unpack_awq(qzeros).t().contiguous()
    return codes, scales.t().contiguous(), zeros


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """AutoAWQ gemm tensors -> dense fp32 weight ``[N, K]`` (``w = (q - z) * s``)."""
    codes, s, z = unpack(qweight, qzeros, scales)
    return dequantize_groups(codes, s, z)


def quantize_linear_weight(
    w: torch.Tensor, group_size: int, name: str = "weight"
) -> dict[str, torch.Tensor]:
    """One linear's weight ``[N, K]`` -> ``{"qweight", "qzeros", "scales"}`` on the CPU.

    Raises:
        ValueError: naming ``name`` on NaN/inf, K not divisible by G, or N not a multiple of 8.
    """
    check_finite(w, name)
    if w.shape[0] % 8:
        raise ValueError(f"{name}: out_features {w.shape[0]} must be a multiple of 8 for the AWQ format")
    if w.shape[1] % group_size:
        raise ValueError(f"{name}: in_features {w.shape[1]} is not divisible by group_size {group_size}")
    codes, scales, zeros = quantize_groups(w, group_size)
    qweight, qzeros, s = pack(codes, scales, zeros)
    return {"qweight": qweight.cpu(), "qzeros": qzeros.cpu(), "scales": s.cpu()}
