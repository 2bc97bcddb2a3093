"""Loading experts that a checkpoint stores one by one into :class:`~lightinfer.layers.moe.FusedMoE`'s stacks.

Hugging Face checkpoints (and the AWQ / GPTQ / compressed-tensors ones made from them) name every expert's
projections apart: ``model.layers.0.mlp.experts.3.gate_proj.weight`` (``.qweight`` / ``.qzeros`` /
``.scales``... when quantized; Mixtral: ``block_sparse_moe.experts.3.w1``). :func:`expert_views` gives, for
each such name, an :class:`ExpertLinearView`: a slice of the stacked tensors with the loading interface of a
linear layer (``load_dense``; ``load_awq`` and ``load_runtime`` as :class:`~lightinfer.layers.linear.W4A16Linear`
has them), so the loaders treat an expert like any other linear and its tensors land in place, converted
once, with no per-expert module and no restacking copy.
"""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.kernels import repack_awq_to_runtime
from lightinfer.layers.moe import FusedMoE

PARTS = ("gate", "up", "down")


class ExpertLinearView:
    """Expert ``expert``'s ``part`` (``"gate"``, ``"up"`` or ``"down"``) projection inside ``moe``'s stacks.

    Attributes:
        in_features, out_features: K and N of the projection; group_size: its W4 group (0 for dense);
        bias: None (experts have none). ``scales`` / ``qweight`` / ``weight``: views of the slice.
    """

    def __init__(self, moe: FusedMoE, part: str, expert: int) -> None:
        if part not in PARTS:
            raise ValueError(f"expert projection part must be one of {PARTS}, got {part!r}")
        h, i = moe.hidden_size, moe.intermediate_size
        self.moe, self.part, self.expert = moe, part, expert
        self.stack = "w2" if part == "down" else "w13"
        self.rows = slice(0, h) if part == "down" else slice(0, i) if part == "gate" else slice(i, 2 * i)
        self.in_features, self.out_features = (i, h) if part == "down" else (h, i)
        self.quantized = moe.is_quantized(self.stack)
        self.group_size = moe.group_sizes[self.stack]
        self.bias = None
        self.name = f"{moe.prefix}.{expert}.{moe.proj_names[PARTS.index(part)]}"

    def _stack(self, leaf: str) -> torch.Tensor:
        return getattr(self.moe, f"{self.stack}_{leaf}")[self.expert]

    @property
    def weight(self) -> torch.Tensor:
        """Dense experts: ``[out, in]`` view."""
        return self._stack("weight")[self.rows]

    @property
    def qweight(self) -> torch.Tensor:
        """W4 experts: int32 ``[out, in // 8]`` view."""
        return self._stack("qweight")[self.rows]

    @property
    def scales(self) -> torch.Tensor:
        """W4 experts: ``[in // G, out]`` view."""
        return self._stack("scales")[:, self.rows]

    @property
    def zeros(self) -> torch.Tensor:
        return self._stack("zeros")[:, self.rows]

    def _check(self, what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if tuple(got) != tuple(want):
            raise ValueError(f"{self.name}: {what} has shape {tuple(got)}, the model expects {tuple(want)} "
                             f"(expert {self.part} projection {self.in_features} -> {self.out_features})")

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor) -> None:
        """``weight [out, in]`` (``nn.Linear`` orientation) into a dense stack.

        Raises:
            ValueError: a shape mismatch, or experts stored 4-bit.
        """
        if self.quantized:
            raise ValueError(f"{self.name}: a dense weight for experts the model holds in 4 bits; the checkpoint's "
                             f"experts must all share one format")
        self._check("weight", weight.shape, (self.out_features, self.in_features))
        self.weight.copy_(weight)
        self.moe.weights_changed()

    @torch.no_grad()
    def load_awq(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
        """AutoAWQ "gemm" tensors (``W4A16Linear.load_awq``) into the W4 stacks."""
        self._check("qweight", qweight.shape, (self.in_features, self.out_features // 8))
        qw, s, z = repack_awq_to_runtime(qweight.to(torch.int32), qzeros.to(torch.int32), scales, self.scales.dtype)
        self.load_runtime(qw, s, z)

    @torch.no_grad()
    def load_runtime(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     input_perm: torch.Tensor | None = None) -> None:
        """Tensors already in the W4 run-time layout (``W4A16Linear.load_runtime``) into the stacks.

        Raises:
            ValueError: shapes that do not match, experts stored dense, or an act-order ``input_perm``
                (each expert would need its own input order: not supported for experts).
        """
        if not self.quantized:
            raise ValueError(f"{self.name}: 4-bit tensors for experts the model holds dense")
        if input_perm is not None:
            raise ValueError(f"{self.name}: act-order (GPTQ desc_act / compressed-tensors actorder) experts are not "
                             f"supported: the stacked experts read one input order. Use a checkpoint quantized "
                             f"without act-order")
        self._check("qweight", qweight.shape, self.qweight.shape)
        self._check("scales", scales.shape, self.scales.shape)
        self._check("zeros", zeros.shape, self.zeros.shape)
        self.qweight.copy_(qweight)
        self.scales.copy_(scales)
        self.zeros.copy_(zeros)
        self.moe.weights_changed()

    def dense_weight(self) -> torch.Tensor:
        """The projection's weight ``[out, in]`` (dequantized for W4) in the layer's dtype."""
        if not self.quantized:
            return self.weight
        from lightinfer.kernels import dequantize_w4

        return dequantize_w4(self.qweight, self.scales, self.zeros)


def expert_views(model: nn.Module) -> dict[str, ExpertLinearView]:
    """Every expert projection of ``model`` by checkpoint module name (``model.layers.0.mlp.experts.3.gate_proj``)."""
    views: dict[str, ExpertLinearView] = {}
    for m in model.modules():
        if isinstance(m, FusedMoE):
            for e in range(m.num_experts):
                for part in PARTS:
                    v = ExpertLinearView(m, part, e)
                    views[v.name] = v
    return views


def stacked_parameter_names(model: nn.Module) -> set[str]:
    """Full names of the stacked expert parameters (dense experts), which checkpoints do not hold as such."""
    return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, FusedMoE)
            for p in m.stacked_parameter_names}
