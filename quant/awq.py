"""AWQ: activation-aware weight quantization (Lin et al., "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration", MLSys 2024).

A few input channels carry much larger activations than the rest; the weights that multiply
them matter most. AWQ protects them by scaling: for the linears ``W`` that share an input
``X`` (a row of the table in ``models/awq_tables.py``) it searches per-input-channel scales
``s = mean|X|^alpha`` (alpha on an ``n_grid``-point grid in [0, 1)) minimising::

    L(s) = || Q(W · diag(s)) (diag(s)^-1 · X) − W · X ||²

where ``Q`` is the 4-bit group quantizer (``quant/primitives.py``), then folds ``diag(s)^-1``
into the op that produced ``X`` (an RMSNorm weight or the previous linear's output rows), so
the model computes the same function in full precision. It then searches, per output row and
group, how much to shrink the weight range before quantizing (the clip search, section 3.3
"clipping"), except for q/k, and quantizes.

The losses are computed from second moments: with ``H = X^T X`` (``[K, K]``, accumulated in
fp64 while the layer runs on the calibration batch), ``||D X^T||² = trace(D H D^T)`` for the
weight error ``D = W' − W``, so every calibration token counts at a cost independent of their
number. When there are fewer tokens than input channels the tokens themselves are kept
instead (``||D X^T||²`` directly: cheaper). The clip search uses the diagonal ``G x G``
blocks of ``H`` (per-group error, as in the paper). All search arithmetic is fp32 (fp64
accumulators): no fp16 overflow.

The model is processed one decoder layer at a time (the only one on the compute device),
its weights streamed from the checkpoint; the full-precision layer's output on the
calibration batch feeds the next layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightinfer.layers.attention import no_cache_context
from lightinfer.models.awq_tables import AwqTable
from lightinfer.quant.primitives import check_finite, fake_quantize, pack, quantize_groups


@dataclass
class InputStats:
    """Statistics of one shared linear input ``X [T, K]`` (fp64 accumulators on the compute device).

    Attributes:
        abs_sum: ``[K]`` sum over tokens of ``|x|``.
        gram: ``[K, K]`` ``X^T X`` (when tokens >= K), else None.
        rows: kept token rows ``[*, K]`` fp32 (when tokens < K), else empty.
        count: tokens seen.
    """

    abs_sum: torch.Tensor
    gram: torch.Tensor | None
    rows: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate ``x [..., K]``."""
        xf = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.abs_sum += xf.abs().sum(0, dtype=torch.float64)
        if self.gram is not None:
            self.gram += (xf.t() @ xf).to(torch.float64)
        else:
            self.rows.append(xf.clone())
        self.count += xf.shape[0]

    def mean_abs(self) -> torch.Tensor:
        """``[K]`` fp32 mean of ``|x|`` per input channel."""
        return (self.abs_sum / max(self.count, 1)).to(torch.float32)

    def rescale(self, s: torch.Tensor) -> None:
        """The input after folding: ``X -> X · diag(s)^-1``."""
        s64 = s.to(torch.float64)
        self.abs_sum /= s64
        if self.gram is not None:
            self.gram /= s64.unsqueeze(0) * s64.unsqueeze(1)
        self.rows = [r / s.to(r.dtype) for r in self.rows]

    def loss_factor(self) -> torch.Tensor:
        """``F [K, r]`` fp32 with ``F F^T = X^T X / T``: ``loss(D) = ||D F||²``."""
        if self.gram is not None:
            return (self.gram / max(self.count, 1)).to(torch.float32)  # then loss = sum((D @ H) * D)
        x = torch.cat(self.rows) if self.rows else torch.zeros(0, self.abs_sum.shape[0], device=self.abs_sum.device)
        return x.t() / max(self.count, 1) ** 0.5

    def group_blocks(self, group_size: int) -> torch.Tensor:
        """Diagonal ``G x G`` blocks of ``X^T X / T``: fp32 ``[K // G, G, G]``."""
        k = self.abs_sum.shape[0]
        ng = k // group_size
        if self.gram is not None:
            g = (self.gram / max(self.count, 1)).to(torch.float32)
            idx = torch.arange(ng, device=g.device)
            return g.reshape(ng, group_size, ng, group_size)[idx, :, idx, :]
        x = torch.cat(self.rows).reshape(-1, ng, group_size).permute(1, 0, 2)  # [ng, T, G]
        return (x.transpose(1, 2) @ x) / max(self.count, 1)


def _weighted_loss(d: torch.Tensor, stats: InputStats, factor: torch.Tensor) -> float:
    """``||D X^T||² / T`` for the weight error ``d [N, K]``."""
    if stats.gram is not None:
        return float(((d @ factor) * d).sum())
    return float((d @ factor).pow(2).sum())


def search_scales(
    weights: list[torch.Tensor], stats: InputStats, group_size: int, n_grid: int
) -> tuple[torch.Tensor, float, float, float]:
    """Grid search of ``s = mean|X|^alpha`` for linears sharing ``X`` (module docstring).

    Args:
        weights: fp32 ``[N_i, K]`` each (unchanged).
        stats: statistics of their shared input.
    Returns:
        ``(s fp32 [K], best alpha, loss at alpha=0 (plain RTN), best loss)``; alpha 0 gives
        ``s = 1``, so AWQ never does worse than RTN on the objective.
    """
    w = torch.cat(weights).to(torch.float32)  # [sum N, K]
    x_mean = stats.mean_abs().clamp(min=1e-6)
    factor = stats.loss_factor()
    best = (torch.ones_like(x_mean), 0.0, float("inf"))
    rtn_loss = float("inf")
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        d = fake_quantize(w * s, group_size) / s - w
        loss = _weighted_loss(d, stats, factor)
        if i == 0:
            rtn_loss = loss
        if loss < best[2]:  # NaN compares False: never chosen
            best = (s if i else torch.ones_like(x_mean), alpha, loss)
    return best[0], best[1], rtn_loss, best[2]


def search_clip(
    w: torch.Tensor, stats: InputStats, group_size: int, n_grid: int, max_shrink: float, row_batch: int = 2048
) -> torch.Tensor:
    """Per (output row, group) shrink of the weight range minimising that group's output error.

    Args:
        w: fp32 ``[N, K]`` (already scaled).
    Returns:
        ``w`` clamped to the best range per row and group: fp32 ``[N, K]``.
    """
    n, k = w.shape
    ng = k // group_size
    blocks = stats.group_blocks(group_size)  # [ng, G, G]
    out = torch.empty_like(w)
    steps = max(1, round(max_shrink * n_grid))
    for a in range(0, n, row_batch):
        wg = w[a : a + row_batch].reshape(-1, ng, group_size)  # [n_b, ng, G]
        hi0, lo0 = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
        best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
        best_hi, best_lo = hi0.clone(), lo0.clone()
        for i in range(steps):
            r = 1.0 - i / n_grid
            hi, lo = hi0 * r, lo0 * r
            wc = torch.clamp(wg, lo, hi)
            d = fake_quantize(wc.reshape(-1, k), group_size).reshape_as(wg) - wg  # [n_b, ng, G]
            err = ((d.transpose(0, 1) @ blocks).transpose(0, 1) * d).sum(-1)  # [n_b, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_hi = torch.where(better.unsqueeze(-1), hi, best_hi)
            best_lo = torch.where(better.unsqueeze(-1), lo, best_lo)
        out[a : a + row_batch] = torch.clamp(wg, best_lo, best_hi).reshape(-1, k)
    return out


def capture(
    layer: nn.Module,
    table: AwqTable,
    hidden: list[torch.Tensor],
    seq_len: int,
    total_tokens: int,
    moe_inputs: list[torch.Tensor] | None = None,
) -> tuple[dict[str, InputStats], list[torch.Tensor]]:
    """Run ``layer`` on the calibration batch, recording each scale group's input.

    Args:
        hidden: chunks of the residual stream, each ``[n_seqs * seq_len, hidden]`` (whole sequences).
        total_tokens: tokens over all chunks (chooses Gram vs kept rows).
        moe_inputs: where the table has a MoE block, a list that receives the block's input chunks.
    Returns:
        ``(stats by group's first linear, the layer's output chunks)``.
    """
    stats: dict[str, InputStats] = {}
    handles = []
    if table.moe is not None and moe_inputs is not None:
        handles.append(layer.get_submodule(table.moe.block).register_forward_pre_hook(
            lambda _m, args: moe_inputs.append(args[0].detach().clone())))
    for group in table.groups:
        lin = layer.get_submodule(group.linears[0])
        k = lin.in_features
        dev = lin.weight.device
        st = InputStats(
            abs_sum=torch.zeros(k, dtype=torch.float64, device=dev),
            gram=torch.zeros(k, k, dtype=torch.float64, device=dev) if total_tokens >= k else None,
        )
        stats[group.linears[0]] = st
        handles.append(lin.register_forward_pre_hook(lambda _m, args, st=st: st.add(args[0])))
    outputs: list[torch.Tensor] = []
    try:
        for x in hidden:
            n_seqs = x.shape[0] // seq_len
            positions = torch.arange(seq_len, device=x.device).repeat(n_seqs)
            cu = torch.arange(0, n_seqs + 1, device=x.device, dtype=torch.int32) * seq_len
            with no_cache_context(cu):
                outputs.append(layer(positions, x))
    finally:
        for h in handles:
            h.remove()
    return stats, outputs


@torch.no_grad()
def quantize_layer(
    layer: nn.Module,
    table: AwqTable,
    hidden: list[torch.Tensor],
    seq_len: int,
    group_size: int,
    n_grid: int,
    max_shrink: float,
    prefix: str,
    keep_fp: tuple[str, ...] = (),
    moe_quantizer: Callable[..., Any] | None = None,
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """AWQ on one decoder layer (fp32, on the layer's device).

    Args:
        layer: the full-precision decoder layer; modified in place (scales folded, clipped).
        hidden: the layer's input chunks (see :func:`capture`).
        prefix: ``model.layers.{i}`` for tensor names and error messages.
        keep_fp: linears of the table left in full precision (``modules_to_not_convert``); their
            scales are still folded, their weights stored as fp16 ``.weight``.
        moe_quantizer: for a table with a MoE block, what quantizes it (``quant/awq_moe.quantize_moe_block``,
            passed in so that this module does not import that one, which builds on this one).
    Returns:
        ``(tensors, output chunks, info)``: ``tensors`` maps checkpoint names to CPU tensors
        (``.qweight/.qzeros/.scales`` of each quantized linear; norms, biases and other
        parameters as they are after folding); ``info`` the alphas chosen and loss ratios.
    Raises:
        ValueError: NaN/inf in a weight or in the layer's output, naming it.
    """
    for name, p in layer.named_parameters():
        check_finite(p, f"{prefix}.{name}")
    total = sum(x.shape[0] for x in hidden)
    moe_inputs: list[torch.Tensor] = []
    stats, outputs = capture(layer, table, hidden, seq_len, total, moe_inputs)
    for out in outputs:
        check_finite(out, f"{prefix} output on the calibration batch")
    stats_of = {lin: stats[g.linears[0]] for g in table.groups for lin in g.linears}
    info: dict[str, float] = {}
    for group in table.groups:
        prev = layer.get_submodule(group.prev_op)
        lins = [layer.get_submodule(n) for n in group.linears]
        if hasattr(prev, "out_features") and prev.out_features != lins[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention: the shapes do not allow it
        st = stats[group.linears[0]]
        s, alpha, rtn_loss, loss = search_scales([m.weight.float() for m in lins], st, group_size, n_grid)
        info[f"{group.linears[0]}.alpha"] = alpha
        info[f"{group.linears[0]}.loss_ratio"] = loss / rtn_loss if rtn_loss > 0 else 1.0
        # fold: previous op's output / s, consumers' input columns * s
        if hasattr(prev, "out_features"):
            prev.weight.div_(s.unsqueeze(1).to(prev.weight.dtype))
            if getattr(prev, "bias", None) is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:
            prev.weight.div_(s.to(prev.weight.dtype))
        for m in lins:
            m.weight.mul_(s.unsqueeze(0).to(m.weight.dtype))
        st.rescale(s)
    tensors: dict[str, torch.Tensor] = {}
    for name in (n for n in table.linears if n not in keep_fp):
        lin = layer.get_submodule(name)
        w = lin.weight.float()
        check_finite(w, f"{prefix}.{name}.weight (after scaling)")
        if name not in table.no_clip and max_shrink > 0:
            w = search_clip(w, stats_of[name], group_size, n_grid, max_shrink)
        codes, scales, zeros = quantize_groups(w, group_size)
        qweight, qzeros, sc = pack(codes, scales, zeros)
        tensors[f"{prefix}.{name}.qweight"] = qweight.cpu()
        tensors[f"{prefix}.{name}.qzeros"] = qzeros.cpu()
        tensors[f"{prefix}.{name}.scales"] = sc.cpu()
    quantized_weights = {f"{n}.weight" for n in table.linears if n not in keep_fp}
    if table.moe is not None:  # the sparse block (after the attention groups, as in forward order)
        if moe_quantizer is None:
            raise ValueError(f"{prefix}: a MoE layer needs moe_quantizer (quant/awq_moe.quantize_moe_block)")
        moe = moe_quantizer(layer, table.moe, moe_inputs, prefix, group_size, n_grid, max_shrink)
        tensors.update(moe.tensors)
        quantized_weights |= moe.replaced
        info.update(moe.info)
        info["moe.rtn_experts"], info["moe.num_experts"] = float(moe.rtn_experts), float(moe.num_experts)
    for name, p in layer.named_parameters():
        if name not in quantized_weights:
            tensors[f"{prefix}.{name}"] = p.detach().to("cpu", torch.float16)
    return tensors, outputs, info
