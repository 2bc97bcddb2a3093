"""Mixture-of-experts data every backend shares: the stacked expert weights and the token sort of a routed batch.

Importing this module does not import Triton.

**Expert weights.** One linear of every expert of a layer is stored as one stacked tensor, so that a single
kernel launch reaches any expert by an offset and a checkpoint that stores experts stacked (GGUF's
``blk.N.ffn_gate_exps``) loads without reshuffling::

    dense  weight   [E, N, K]           expert e's nn.Linear weight
    W4     qweight  int32 [E, N, K // 8] the W4 run-time layout (``w4_layout.py``) of each expert,
           scales   [E, K // G, N]       stacked along a new first dimension
           zeros    [E, K // G, N]       (zeros may be fractional: the MoE kernels subtract them in fp32)

A MoE layer has two such linears: ``w13`` (gate and up projections of each expert, N = 2 I, gate rows first)
and ``w2`` (down projection, N = hidden, K = I).

**The token sort** (:func:`moe_align_block_size`, vLLM's ``moe_align_block_size``): the ``T x top_k`` (token,
slot) pairs of a batch are grouped by expert, each expert's group padded to a multiple of ``block_m``, so that
every tile of ``block_m`` rows of the fused kernel belongs to one expert. Computed on the device with tensor
ops only (no host synchronization: CUDA-graph safe), at a size that depends only on the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .w4_layout import dequantize_w4


@dataclass
class ExpertWeights:
    """One linear of every expert of a MoE layer, stacked (module docstring): ``weight`` (dense) or
    ``qweight``/``scales``/``zeros`` (W4). ``prepared`` holds a backend's own form of the same weights,
    made once (the ``torch_cpu`` backend's packed 4-bit or dense copy, ``moe_cpu.py``); None until then.
    """

    weight: torch.Tensor | None = None
    qweight: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    prepared: object | None = None

    @property
    def is_quantized(self) -> bool:
        return self.qweight is not None

    @property
    def num_experts(self) -> int:
        return int((self.qweight if self.is_quantized else self.weight).shape[0])

    @property
    def out_features(self) -> int:
        """N, the output size of one expert's linear."""
        return int((self.qweight if self.is_quantized else self.weight).shape[1])

    @property
    def in_features(self) -> int:
        """K, the input size of one expert's linear."""
        return int(self.qweight.shape[2] * 8 if self.is_quantized else self.weight.shape[2])

    @property
    def group_size(self) -> int:
        """G of the W4 layout (0 for dense weights)."""
        return self.in_features // int(self.scales.shape[1]) if self.is_quantized else 0

    @property
    def device(self) -> torch.device:
        return (self.qweight if self.is_quantized else self.weight).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' float dtype (the scales' for W4)."""
        return (self.scales if self.is_quantized else self.weight).dtype

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors (not ``prepared``)."""
        return [t for t in (self.weight, self.qweight, self.scales, self.zeros) if t is not None]

    def nbytes(self) -> int:
        """Bytes the stored tensors hold in memory; a tensor on the ``meta`` device (a stack a CPU engine released
        once its prepared copy replaced it, ``FusedMoE.pack_for_cpu``) holds none and counts 0."""
        return sum(t.numel() * t.element_size() for t in self.tensors() if t.device.type != "meta")

    def dense(self, expert: int) -> torch.Tensor:
        """Expert ``expert``'s weight ``[N, K]`` (dequantized for W4), in :attr:`dtype`."""
        if self.is_quantized:
            return dequantize_w4(self.qweight[expert], self.scales[expert], self.zeros[expert])
        return self.weight[expert]


def check_moe_args(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> tuple[int, int, int]:
    """Shapes of a ``fused_moe`` call; returns ``(T, hidden, intermediate)``.

    Raises:
        ValueError: inconsistent shapes (naming them).
    """
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [tokens, hidden], got {tuple(x.shape)}")
    t, h = x.shape
    inter2 = w13.out_features
    if w13.in_features != h or w2.out_features != h or 2 * w2.in_features != inter2:
        raise ValueError(f"fused_moe: w13 [E, {inter2}, {w13.in_features}] and w2 [E, {w2.out_features}, "
                         f"{w2.in_features}] do not fit hidden {h} (w13 must be [E, 2 I, H], w2 [E, H, I])")
    if w13.num_experts != w2.num_experts:
        raise ValueError(f"fused_moe: w13 has {w13.num_experts} experts, w2 {w2.num_experts}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [tokens={t}, top_k]")
    return t, h, inter2 // 2


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded (token, slot) list: every expert's group rounded up to ``block_m``, at most
    one partial block per expert, and at most one block per pair (few pairs, many experts)."""
    size = min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m)
    return -(-size // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs of a routed batch by expert, padding each expert's group to ``block_m``.

    Args:
        topk_ids: int ``[T, top_k]`` the experts of each token.
        block_m: rows per tile of the fused kernel.
        num_experts: E.
    Returns:
        ``(sorted_ids, expert_ids, num_tokens_post_padded)``: int32 ``[P]`` pair indices (``t * top_k + j``)
        grouped by expert, padding rows set to ``T * top_k``; int32 ``[P // block_m]`` the expert of each tile
        (tiles past the end name expert ``E - 1`` and are skipped); int32 ``[1]`` the rows in use. ``P`` is
        :func:`padded_size`.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, dev = flat.numel(), flat.device
    size = padded_size(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within a group
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[(pad_end - padded)[expert_of] + rank] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)
