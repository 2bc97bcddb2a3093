"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.layers.ops import ops_for


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``x / rms(x) * weight`` over the last dim, fp32 inside.

    Args:
        hidden_size: size of the last dim.
        eps: added to the mean square.

    Its residual form takes a W4A16 GEMM's split-K partials as ``x`` (``fused_add_rms_norm`` sums
    them as it loads them), so ``layers/fusion.py`` may defer the reduction of a linear feeding it.
    """

    accepts_split_k_partials = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def kernel_weight(self) -> torch.Tensor:
        """The weight the kernels multiply by, ``[hidden]``: ``weight`` itself here."""
        return self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x [..., hidden]`` -> normed; with ``residual``: ``(norm(x + residual), x + residual)``."""
        ops = ops_for(x)
        if residual is None:
            if not isinstance(x, torch.Tensor):
                raise TypeError("RMSNorm without a residual got split-K partials: only the residual form "
                                "norm(x, residual) sums them; the model's fusion_plan declares a Feeds into "
                                "a norm it calls without a residual (drop that entry)")
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (Gemma's): ``x / rms(x) * (1 + weight)``, fp32 inside.

    ``weight`` keeps the checkpoint's value and name; the kernels get ``1 + weight`` in fp32 (Gemma computes
    the sum in fp32 too: ``1 + w`` rounded to fp16 would lose ~3 digits of a small ``w``), made once and kept
    until ``weight`` changes in place (a load, AWQ folding its scales: :attr:`weight_offset` tells it how).

    Args:
        hidden_size, eps, dtype: as :class:`RMSNorm`.
    """

    weight_offset = 1.0  # the norm multiplies by weight + weight_offset (read by the AWQ fold, quant/awq.py)

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()  # the identity, as Gemma initializes it
        self._effective: tuple[tuple[int, int], torch.Tensor] | None = None

    def effective_weight(self) -> torch.Tensor:
        """fp32 ``1 + weight`` ``[hidden]``, recomputed only when ``weight`` was changed in place."""
        w = self.weight
        version = -1 if w.is_inference() else w._version  # inference tensors keep no version counter
        key = (w.data_ptr(), version)
        if self._effective is None or self._effective[0] != key or version == -1:
            self._effective = (key, w.detach().float() + self.weight_offset)
        return self._effective[1]

    def kernel_weight(self) -> torch.Tensor:
        """:meth:`effective_weight`: the kernels multiply by ``1 + weight``."""
        return self.effective_weight()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`RMSNorm.forward`, with ``1 + weight``."""
        ops = ops_for(x)
        weight = self.effective_weight()
        if residual is None:
            if not isinstance(x, torch.Tensor):
                raise TypeError("OffsetRMSNorm without a residual got split-K partials: only the residual form "
                                "sums them")
            return ops.rms_norm(x, weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, weight, self.eps)
