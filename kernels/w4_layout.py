"""The W4 run-time weight layout: packing, AutoAWQ conversion, dequantization (plain PyTorch, any device).

Run-time layout (converted once at load time from AutoAWQ's disk layout by :func:`repack_awq_to_runtime`)::

    qweight  int32   [N, K // 8]   row n holds output channel n; nibble i (bits 4i..4i+3)
                                   of word j is the 4-bit code of input k = 8 j + i
    scales   fp16/bf16 [K // G, N]
    zeros    fp16/bf16 [K // G, N] the zero point z as a float: an integer (AWQ, GPTQ, compressed-tensors,
                                   GGUF Q4_0) or not (GGUF Q4_1 / Q4_K: -m / d); :func:`zeros_are_integers`
    w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]

Packing along K keeps each output row contiguous, which is what a GEMV reads. AutoAWQ's "gemm" disk
layout packs along N in the nibble order :data:`AWQ_ORDER` (``../shared/DESIGN.md``, "Formats").
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ "gemm": nibble j of a word holds column AWQ_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c lives in nibble AWQ_REVERSE_ORDER[c]


# ----------------------------------------------------------------------------- W4A16


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 words along the last dim into 8 natural-order nibbles.

    Args:
        packed: int32 ``[..., C // 8]``.
    Returns:
        uint8-valued int32 ``[..., C]`` where element ``8 j + i`` is nibble ``i`` of word ``j``.
    """
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_int4_rows`: ``[..., C]`` codes 0..15 -> int32 ``[..., C // 8]``."""
    if codes.shape[-1] % 8:
        raise ValueError(f"last dim {codes.shape[-1]} must be a multiple of 8 to pack 4-bit codes")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(-1)
    # Wrap into int32 range (bit 31 set -> negative), the AutoAWQ convention.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ "gemm" int32 ``[R, C // 8]`` -> codes int32 ``[R, C]`` in column order.

    Source: AutoAWQ ``awq/modules/linear/gemm.py`` (order ``[0, 2, 4, 6, 1, 3, 5, 7]``).
    """
    nat = unpack_int4_rows(packed).reshape(packed.shape[0], packed.shape[1], 8)
    idx = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nat.index_select(-1, idx).reshape(packed.shape[0], packed.shape[1] * 8)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """Codes int ``[R, C]`` (0..15) -> AutoAWQ "gemm" int32 ``[R, C // 8]``."""
    r, c = codes.shape
    if c % 8:
        raise ValueError(f"AWQ packing needs the packed dim ({c}) to be a multiple of 8")
    grouped = codes.reshape(r, c // 8, 8)
    idx = torch.tensor(AWQ_ORDER, device=codes.device)
    return pack_int4_rows(grouped.index_select(-1, idx).reshape(r, c))


def repack_awq_to_runtime(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert AutoAWQ disk tensors into the run-time layout (module docstring).

    Args:
        qweight: int32 ``[K, N // 8]``; qzeros: int32 ``[K // G, N // 8]``; scales: float ``[K // G, N]``.
        dtype: dtype of the returned scales/zeros (the activation dtype).
    Returns:
        ``(qweight_rt int32 [N, K // 8], scales [K // G, N], zeros [K // G, N])``.
    Raises:
        ValueError: on inconsistent shapes.
    """
    k, n8 = qweight.shape
    n = n8 * 8
    if scales.shape[1] != n or qzeros.shape != (scales.shape[0], n8) or k % scales.shape[0]:
        raise ValueError(
            f"inconsistent AWQ tensors: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    codes = unpack_awq(qweight)  # [K, N]
    qweight_rt = pack_int4_rows(codes.t().contiguous())  # [N, K // 8]
    zeros = unpack_awq(qzeros).to(dtype)  # [K // G, N]
    return qweight_rt.contiguous(), scales.to(dtype).contiguous(), zeros.contiguous()


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Run-time layout -> dense weight ``[N, K]`` (``nn.Linear`` orientation) in ``scales.dtype``."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 8
    group_size = k // scales.shape[0]
    codes = unpack_int4_rows(qweight).to(torch.float32)  # [N, K]
    s = scales.t().to(torch.float32).repeat_interleave(group_size, dim=1)  # [N, K]
    z = zeros.t().to(torch.float32).repeat_interleave(group_size, dim=1)
    assert codes.shape == (n, k)
    return ((codes - z) * s).to(scales.dtype)


def zeros_are_integers(zeros: torch.Tensor) -> bool:
    """Whether every zero point in ``zeros`` (any float dtype and device; a host sync on a GPU) is an integer:
    what the W4 kernels' cheaper decode needs (``w4a16_gemm(..., integer_zeros=True)``)."""
    return bool(torch.equal(zeros, zeros.round()))


def check_integer_zeros(zeros: torch.Tensor) -> None:
    """Raises ValueError unless every zero point is an integer (for callers that promised ``integer_zeros``)."""
    if not zeros_are_integers(zeros):
        frac = zeros[zeros != zeros.round()]
        raise ValueError(f"w4a16_gemm: integer_zeros=True, but {frac.numel()} zero points have a fraction (e.g. "
                         f"{float(frac[0]):g}); pass integer_zeros=False, which is exact for any zero point")
