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
