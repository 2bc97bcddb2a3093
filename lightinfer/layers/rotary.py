"""Rotary position embedding (Su et al. 2021), rotate-half (HF Llama) convention, with every RoPE scaling
of ``rope_scaling.py`` and partial rotation (only the first ``rotary_dim`` dims of a head turn).

The model holds a precomputed cos/sin table per distinct RoPE (one for Llama; Gemma 3's local and global
layers have one each); the kernels gather it at each token's position. Scalings that multiply cos and sin
(YaRN's and LongRoPE's attention factor) are folded into the table.
"""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.layers.ops import ops_for
from lightinfer.layers.rope_scaling import RopeSpec, inv_freq_and_scale, rope_spec

__all__ = ["RopeSpec", "RotaryEmbedding", "rope_spec"]


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 tables ``cos_cache``, ``sin_cache`` ``[max_position, rotary_dim // 2]``, applied to q/k.

    Args:
        spec: the layer type's :class:`RopeSpec` (``rope_spec(hf_config, layer_type)``).
        max_position: table rows (default: the config's own limit, ``spec.max_positions()``).

    The tables first follow transformers' choice for sequences within the original length;
    :meth:`set_max_model_len` fixes them for an engine (``rope_scaling`` module docstring).
    """

    def __init__(self, spec: RopeSpec, max_position: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.head_dim, self.rotary_dim = spec.head_dim, spec.rotary_dim
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self._build(max_position or spec.max_positions(), None)

    @property
    def is_partial(self) -> bool:
        """Whether only part of each head rotates (``rotary_dim < head_dim``)."""
        return self.rotary_dim < self.head_dim

    def _build(self, num_positions: int, max_model_len: int | None) -> None:
        device = self.cos_cache.device
        if device.type == "meta":  # shapes only (a meta-device model for sizing)
            self.cos_cache = torch.empty(num_positions, self.rotary_dim // 2, device=device)
            self.sin_cache = torch.empty(num_positions, self.rotary_dim // 2, device=device)
            return
        with torch.device("cpu"):  # fp32 angles on the host whatever the ambient device, then moved
            inv_freq, scale = inv_freq_and_scale(self.spec, max_model_len)
            freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
            cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.cos_cache, self.sin_cache = cos.to(device), sin.to(device)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Size the tables to ``max_model_len`` positions and fix the length-dependent scalings (LongRoPE's
        short/long factors, dynamic NTK's base) for an engine whose sequences reach ``max_model_len``."""
        self._build(int(max_model_len), int(max_model_len))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]``; q ``[T, H, D]``, k ``[T, Hkv, D]`` -> rotated q, k (same shapes/dtypes; dims past
        ``rotary_dim`` unchanged)."""
        return ops_for(q).rotary_qk(positions, q, k, self.cos_cache, self.sin_cache)
