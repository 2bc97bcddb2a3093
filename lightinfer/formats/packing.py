"""Pieces shared by the GPTQ and compressed-tensors readers: int32 unpacking along either dimension,
act-order group maps, group expansion, and the checks that name a bad tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from lightinfer.kernels import pack_int4_rows


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, length: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes packed in int32 words along ``dim`` -> int32 codes.

    Element ``i`` of a packed run sits at bit ``bits * (i % (32 // bits))`` of word ``i // (32 // bits)``
    (low bits first: GPTQ, AutoGPTQ and compressed-tensors all pack 4- and 8-bit codes this way).

    Args:
        packed: int32, 2-D.
        bits: 4 or 8.
        dim: the packed dimension (0 or 1).
        length: codes along ``dim`` after unpacking (the packed size times 32 // bits, or fewer).
    Returns:
        int32 with ``packed.shape[dim]`` replaced by ``length``.
    """
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        codes = (packed.unsqueeze(1) >> shifts.view(1, per_word, 1)) & mask  # [W, per_word, C]
        return codes.reshape(packed.shape[0] * per_word, packed.shape[1])[:length]
    codes = (packed.unsqueeze(2) >> shifts.view(1, 1, per_word)) & mask  # [R, W, per_word]
    return codes.reshape(packed.shape[0], packed.shape[1] * per_word)[:, :length]


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: unsigned codes -> int32 words along ``dim`` (its size a multiple of
    ``32 // bits``)."""
    if bits == 4 and dim == 1:
        return pack_int4_rows(codes)
    per_word = 32 // bits
    c = codes.to(torch.int64)
    if dim == 0:
        c = c.t()
    c = c.reshape(c.shape[0], c.shape[1] // per_word, per_word)
    words = (c << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words


def group_order(g_idx: torch.Tensor | None, k: int, num_groups: int, where: str) -> torch.Tensor | None:
    """Check an act-order ``g_idx`` and return the K order that makes its groups contiguous.

    Args:
        g_idx: int ``[K]``, the group of each input channel, or None (groups are ``k // G``).
        k: K. num_groups: rows of the scales.
        where: ``"<file>: <tensor>"`` for the errors.
    Returns:
        None when every group is already contiguous (``g_idx[k] == k // G``), else the int64
        permutation ``perm`` (stable sort of ``g_idx``): stored input ``j`` is original input ``perm[j]``.
    Raises:
        ValueError: wrong shape, groups outside ``[0, num_groups)``, or groups that are not all the same
            size (a ``g_idx`` that does not cover every group).
    """
    size = k // num_groups
    if g_idx is None:
        return None
    if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.dtype.is_floating_point:
        raise ValueError(f"{where} must be an integer tensor of {k} entries (one group index per input channel), "
                         f"got {tuple(g_idx.shape)} {g_idx.dtype}")
    g = g_idx.to(torch.int64)
    if int(g.min()) < 0 or int(g.max()) >= num_groups:
        raise ValueError(f"{where} holds group {int(g.min()) if int(g.min()) < 0 else int(g.max())}, outside the "
                         f"{num_groups} groups of its scales")
    counts = torch.bincount(g, minlength=num_groups)
    if bool((counts != size).any()):
        bad = int(torch.nonzero(counts != size)[0])
        raise ValueError(f"{where} does not cover every group with {size} input channels: group {bad} has "
                         f"{int(counts[bad])} (a corrupt or truncated g_idx)")
    natural = torch.arange(k, dtype=torch.int64) // size
    if torch.equal(g, natural):
        return None
    return torch.sort(g, stable=True).indices


def expand_groups(t: torch.Tensor, factor: int) -> torch.Tensor:
    """Each group row repeated ``factor`` times along dim 0 (a per-channel or 256-wide group stored as
    the W4 kernels' groups of 128/64/32: the same scale and zero, exactly)."""
    return t if factor == 1 else t.repeat_interleave(factor, dim=0)


def check_finite(t: torch.Tensor | np.ndarray, where: str, layer: str) -> None:
    """Raise when ``t`` holds NaN or inf, naming the tensor and the layer.

    Raises:
        ValueError: ``"<where> holds N NaN/inf values: layer <layer> would output garbage..."``.
    """
    bad = ~torch.isfinite(torch.as_tensor(t).to(torch.float32))
    if bool(bad.any()):
        raise ValueError(f"{where} holds {int(bad.sum())} NaN/inf value(s): layer {layer} cannot run "
                         f"(a corrupt download or a failed quantization run); re-download or re-quantize it")
