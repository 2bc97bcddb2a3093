"""Rotary position embedding (Su et al. 2021) with the Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightinfer.layers.ops import ops_for


def rope_parameters(hf_config: object) -> tuple[float, dict | None]:
    """``(rope_theta, scaling dict or None)`` from a transformers config of either era.

    transformers >= 5 keeps both in ``rope_parameters``; older releases use ``rope_theta`` and
    ``rope_scaling``.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    scaling = dict(params) if params.get("rope_type", "default") != "default" else None
    if scaling is None:
        old = getattr(hf_config, "rope_scaling", None)
        if old and old.get("rope_type", old.get("type", "default")) != "default":
            scaling = dict(old)
    return theta, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by ``factor``, high kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table ``[max_position, head_dim // 2]`` (fp32), applied to q and k.

    Raises:
        ValueError: a rope scaling type other than default / llama3 / linear.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        positions = torch.arange(max_position, dtype=torch.float32)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                positions = positions / float(scaling["factor"])
            else:
                raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, llama3, linear)")
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]``; q ``[T, H, D]``, k ``[T, Hkv, D]`` -> rotated q, k (same shapes/dtypes)."""
        return ops_for(q).rotary_qk(positions, q, k, self.cos_cache, self.sin_cache)
