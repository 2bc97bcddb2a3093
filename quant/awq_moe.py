"""AWQ for a sparse mixture-of-experts block (``models/awq_tables.MoeAwq``): every expert quantized on the
calibration tokens the router actually sends it.

The block's input ``X`` (the post-attention norm's output) is routed as the model routes it (softmax top-k of the
router on the calibration batch); expert e sees ``X_e``, its tokens. Then, as in ``awq.py`` (same objective,
same grids):

1. **Shared input scales.** Every expert's gate and up projections, the router and (Qwen2-MoE) the shared
   expert read ``X``, so one per-channel scale ``s = mean|X|^alpha`` can be folded into the norm before them.
   It minimises the sum over experts of ``||Q(W_e diag(s)) (diag(s)^-1 X_e^T) - W_e X_e^T||²`` (each expert on
   its own tokens) plus the shared expert's term on all tokens. The router and the shared-expert gate are
   scaled to match and stay dense (full precision: routing is unchanged).
2. **Per expert** with at least :data:`MIN_EXPERT_TOKENS` routed tokens: a scale for the down projection on the
   expert's intermediate activations ``silu(gate(X_e)) * up(X_e)``, folded into that expert's up projection;
   then the clip search of each of its three projections on its own inputs, and the 4-bit quantization.
3. **Experts with fewer tokens** (rarely chosen ones, or a short calibration text) are quantized with RTN (round
   to nearest, full range) after the shared scales: searching scales and clip ranges on a handful of tokens fits
   those tokens, not the expert's inputs at large (with fewer than 64 rows, the per-group error blocks
   ``X_g^T X_g`` of the clip search have rank < 64 of their 128 dimensions at G=128), and RTN has no such
   bias. The summary counts them.

Works on the stacked dense fp32 experts of :class:`~lightinfer.layers.moe.FusedMoE` in place (the same fold
arithmetic as ``awq.py``) and returns AutoAWQ tensors under the checkpoint's per-expert names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lightinfer.layers.moe import select_experts
from lightinfer.models.awq_tables import MoeAwq
from lightinfer.quant.awq import InputStats, search_clip, search_scales
from lightinfer.quant.primitives import check_finite, fake_quantize, pack, quantize_groups

MIN_EXPERT_TOKENS = 64  # fewer routed calibration tokens: RTN (module docstring)


@dataclass
class MoeQuantResult:
    """What :func:`quantize_moe_block` produced.

    Attributes:
        tensors: checkpoint name -> CPU tensor (``.qweight/.qzeros/.scales`` of every expert projection and of
            the shared expert's linears).
        replaced: the block's parameter paths (relative to the decoder layer) these tensors stand for.
        info: alphas and loss ratios; rtn_experts: experts quantized with RTN; num_experts: E.
        tokens_per_expert: routed calibration tokens of each expert.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)
    info: dict[str, float] = field(default_factory=dict)
    rtn_experts: int = 0
    num_experts: int = 0
    tokens_per_expert: list[int] = field(default_factory=list)


def input_stats(x: torch.Tensor) -> InputStats:
    """:class:`~lightinfer.quant.awq.InputStats` of the rows ``x [T, K]`` (Gram matrix when T >= K)."""
    k = x.shape[-1]
    st = InputStats(abs_sum=torch.zeros(k, dtype=torch.float64, device=x.device),
                    gram=torch.zeros(k, k, dtype=torch.float64, device=x.device) if x.shape[0] >= k else None)
    st.add(x)
    return st


def search_routed_scales(terms: list[tuple[torch.Tensor, torch.Tensor]], x_mean: torch.Tensor, group_size: int,
                         n_grid: int) -> tuple[torch.Tensor, float, float, float]:
    """The grid search of ``awq.search_scales`` for linears that share an input channel space but see different
    tokens: ``terms`` are ``(W [N, K], X [T, K])`` pairs (an expert's gate and up rows with its routed tokens);
    the loss is the sum of ``||(Q(W s)/s - W) X^T||²`` over the terms, divided by the tokens in all of them.

    Returns:
        ``(s fp32 [K], best alpha, loss at alpha=0, best loss)`` (alpha 0: ``s = 1``, plain RTN).
    """
    total = max(1, sum(x.shape[0] for _, x in terms))
    mean = x_mean.clamp(min=1e-6)
    best = (torch.ones_like(mean), 0.0, float("inf"))
    rtn_loss = float("inf")
    for i in range(n_grid):
        alpha = i / n_grid
        s = mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        loss = sum(float(((fake_quantize(w * s, group_size) / s - w) @ x.t()).pow(2).sum()) for w, x in terms
                   if x.shape[0]) / total
        if i == 0:
            rtn_loss = loss
        if loss < best[2]:
            best = (s if i else torch.ones_like(mean), alpha, loss)
    return best[0], best[1], rtn_loss, best[2]


def _quantized(w: torch.Tensor, group_size: int, name: str) -> dict[str, torch.Tensor]:
    check_finite(w, name)
    qweight, qzeros, scales = pack(*quantize_groups(w, group_size))
    return {f"{name}.qweight": qweight.cpu(), f"{name}.qzeros": qzeros.cpu(), f"{name}.scales": scales.cpu()}


def _intermediate(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ gate.t()) * (x @ up.t())


@torch.no_grad()
def quantize_moe_block(layer: nn.Module, moe: MoeAwq, inputs: list[torch.Tensor], prefix: str, group_size: int,
                       n_grid: int, max_shrink: float, awq: bool = True) -> MoeQuantResult:
    """AWQ (or, ``awq=False``, RTN) of the MoE block of one decoder layer, in place (module docstring).

    Args:
        layer: the full-precision decoder layer (its norm, router and experts are modified by the folds).
        moe: the table's description of the block.
        inputs: the block's input chunks on the calibration batch, each ``[T_i, H]``.
        prefix: ``model.layers.{i}`` for tensor names and errors.
    Raises:
        ValueError: NaN/inf in a weight, naming it.
    """
    block = layer.get_submodule(moe.block)
    experts = block.experts
    if experts.quantized:
        raise ValueError(f"{prefix}.{moe.block}: the experts are already quantized; give full-precision weights")
    inter, e_count = experts.intermediate_size, experts.num_experts
    w13, w2 = experts.w13_weight, experts.w2_weight  # [E, 2I, H], [E, H, I] fp32, folded in place
    out = MoeQuantResult(num_experts=e_count, replaced={f"{moe.block}.experts.{n}" for n in ("w13_weight", "w2_weight")})
    x = torch.cat(inputs).to(torch.float32) if inputs else torch.zeros(0, experts.hidden_size, device=w13.device)
    _, ids = select_experts(block.gate(x), block.top_k, block.renormalize)
    routed = [torch.where((ids == e).any(dim=-1))[0] for e in range(e_count)]
    out.tokens_per_expert = [int(r.numel()) for r in routed]
    searched = [awq and n >= MIN_EXPERT_TOKENS for n in out.tokens_per_expert]
    shared = block.shared_expert
    if awq and x.shape[0]:
        terms = [(w13[e], x[routed[e]]) for e in range(e_count) if out.tokens_per_expert[e]]
        if shared is not None:
            terms.append((torch.cat([shared.gate_proj.weight, shared.up_proj.weight]), x))
        s, alpha, rtn_loss, loss = search_routed_scales(terms, x.abs().mean(0), group_size, n_grid)
        out.info[f"{moe.block}.experts.alpha"] = alpha
        out.info[f"{moe.block}.experts.loss_ratio"] = loss / rtn_loss if rtn_loss > 0 else 1.0
        layer.get_submodule(moe.prev_op).weight.div_(s)  # the fold: norm / s, readers' columns * s
        w13.mul_(s)
        for path in moe.dense:
            layer.get_submodule(path).weight.mul_(s)
        if shared is not None:
            shared.gate_proj.weight.mul_(s)
            shared.up_proj.weight.mul_(s)
        x = x / s
    names = moe.proj_names
    for e in range(e_count):
        base = f"{prefix}.{moe.block}.experts.{e}"
        gate, up, down = w13[e, :inter], w13[e, inter:], w2[e]
        if not searched[e]:
            out.rtn_experts += 1
            for name, w in zip(names, (gate, up, down)):
                out.tensors.update(_quantized(w, group_size, f"{base}.{name}"))
            continue
        xe = x[routed[e]]
        h = _intermediate(xe, gate, up)
        s2, _, _, _ = search_scales([down], input_stats(h), group_size, n_grid)
        up.div_(s2.unsqueeze(1))  # up's output rows / s2, down's input columns * s2
        down.mul_(s2)
        x_stats, h_stats = input_stats(xe), input_stats(h / s2)
        for name, w, st in zip(names, (gate, up, down), (x_stats, x_stats, h_stats)):
            clipped = search_clip(w, st, group_size, n_grid, max_shrink) if max_shrink > 0 else w
            out.tensors.update(_quantized(clipped, group_size, f"{base}.{name}"))
    if shared is not None:
        out.tensors.update(_quantize_shared(layer, moe, x, prefix, group_size, n_grid, max_shrink, awq))
        out.replaced |= {f"{p}.weight" for p in moe.shared_linears()}
    experts.weights_changed()  # the stacks were folded in place: a CPU copy made by a forward is stale
    return out


def _quantize_shared(layer: nn.Module, moe: MoeAwq, x: torch.Tensor, prefix: str, group_size: int, n_grid: int,
                     max_shrink: float, awq: bool) -> dict[str, torch.Tensor]:
    """The shared expert (its input already scaled): down's scales folded into up, clip search, quantization."""
    gate_p, up_p, down_p = (layer.get_submodule(p) for p in moe.shared_linears())
    tensors: dict[str, torch.Tensor] = {}
    if awq and x.shape[0]:
        h = _intermediate(x, gate_p.weight, up_p.weight)
        s2, _, _, _ = search_scales([down_p.weight], input_stats(h), group_size, n_grid)
        up_p.weight.div_(s2.unsqueeze(1))
        down_p.weight.mul_(s2)
        stats = (input_stats(x), input_stats(x), input_stats(h / s2))
    for i, (path, lin) in enumerate(zip(moe.shared_linears(), (gate_p, up_p, down_p))):
        w = lin.weight
        if awq and x.shape[0] and max_shrink > 0:
            w = search_clip(w, stats[i], group_size, n_grid, max_shrink)
        tensors.update(_quantized(w, group_size, f"{prefix}.{path}"))
    return tensors
