"""SiLU-and-mul, the gated activation of Llama-family MLPs (Shazeer 2020, "GLU variants")."""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.layers.ops import ops_for


class SiluAndMul(nn.Module):
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]`` ``[..., I]``.

    ``x`` may be a W4A16 GEMM's split-K partials on the Triton path (summed as they are loaded).
    """

    accepts_split_k_partials = True  # read by layers/fusion.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops_for(x).silu_and_mul(x)
