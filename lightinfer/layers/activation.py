"""Gated activations of the MLPs (Shazeer 2020, "GLU variants"): SiLU-and-mul (SwiGLU: Llama, Qwen, Phi-3)
and tanh-GELU-and-mul (GeGLU: Gemma)."""

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


class GeluAndMul(nn.Module):
    """``x [..., 2 I]`` -> ``gelu_tanh(x[..., :I]) * x[..., I:]`` ``[..., I]`` (transformers' ``gelu_pytorch_tanh``).

    ``x`` may be a W4A16 GEMM's split-K partials on the Triton path (summed as they are loaded).
    """

    accepts_split_k_partials = True  # read by layers/fusion.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops_for(x).gelu_tanh_and_mul(x)


# Hugging Face ``hidden_act`` / ``hidden_activation`` names -> the gated activation that implements them.
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul, "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluAndMul, "gelu_tanh": GeluAndMul, "gelu_new": GeluAndMul,
}


def gated_activation(name: str) -> nn.Module:
    """The gated activation for a config's activation name.

    Raises:
        ValueError: a name lightinfer does not run (the message lists those it does).
    """
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported; lightinfer runs: "
                         f"{', '.join(sorted(GATED_ACTIVATIONS))}")
    return GATED_ACTIVATIONS[name]()
