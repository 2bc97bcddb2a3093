"""Mixture-of-experts layers: the router (``Router``, ``select_experts``) and the stacked experts (``FusedMoE``).

A MoE feed-forward block replaces one dense MLP by E expert MLPs and a router that sends each token to
``top_k`` of them, weighting their outputs (Shazeer et al. 2017; Mixtral, Qwen-MoE). The experts' weights
are stored stacked, ``[E, ...]`` per projection (``lightinfer.kernels.moe``), in one of two layouts:

* dense: ``w13_weight [E, 2 I, H]`` (each expert's gate rows, then its up rows) and ``w2_weight [E, H, I]``;
* W4: the W4 run-time layout of each expert stacked, ``w13_qweight [E, 2 I, H // 8]``, ``w13_scales`` /
  ``w13_zeros [E, H // G, 2 I]``, ``w2_qweight [E, H, I // 8]``, ``w2_scales`` / ``w2_zeros [E, I // G, H]``.

One launch of the fused kernel then reaches any expert, and a checkpoint that stacks its experts (GGUF's
``blk.N.ffn_gate_exps``) loads without reshuffling; per-expert checkpoints (Hugging Face's
``mlp.experts.{e}.gate_proj``, AWQ / GPTQ / compressed-tensors too) load into slices of the stacks through
:mod:`.moe_loading`'s views. The router always stays dense (and computes in fp32).

``--cpu-experts N``: the experts of the first N MoE layers can live in host memory
(:func:`experts_in_host_memory` while the model is built); such a layer copies its hidden states to the host,
computes its experts with the ``torch_cpu`` backend there and copies the result back, whatever device the
rest of the model runs on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lightinfer.kernels import ExpertWeights, get_backend
from lightinfer.layers.ops import ops_for

_host_layers: frozenset[int] = frozenset()


@contextlib.contextmanager
def experts_in_host_memory(layer_ids: set[int] | frozenset[int]) -> Iterator[None]:
    """While the block runs, the :class:`FusedMoE` of decoder layers ``layer_ids`` is built in host memory
    (whatever the default device, except ``meta``) and computes on the CPU. Not thread-safe."""
    global _host_layers
    previous, _host_layers = _host_layers, frozenset(layer_ids)
    try:
        yield
    finally:
        _host_layers = previous


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: the ``top_k`` most probable experts of each token and their weights.

    Args:
        router_logits: ``[T, E]``.
        top_k: experts per token.
        renormalize: divide the chosen probabilities by their sum (Mixtral; Qwen-MoE's ``norm_topk_prob``),
            which equals a softmax over the top-k logits; else keep the full-softmax probabilities.
    Returns:
        ``(topk_weights fp32 [T, top_k], topk_ids int64 [T, top_k])``.
    """
    probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_top_k(num_experts: int, top_k: int, where: str = "config") -> None:
    """Raises ValueError unless ``1 <= top_k <= num_experts``."""
    if not 1 <= int(top_k) <= int(num_experts):
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be between 1 and the number of experts "
                         f"({num_experts}); a token cannot be routed to more experts than the layer has. "
                         f"Fix config.json")


class Router(nn.Module):
    """The router (Hugging Face ``gate``): ``weight [E, H]``, logits ``x @ weight^T`` in fp32 (never quantized)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = hidden_size, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> fp32 logits ``[T, E]``."""
        return F.linear(x.to(torch.float32), self.weight.to(torch.float32))


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked (module docstring): ``forward(x [T, H], topk_weights, topk_ids)``
    -> ``[T, H]``, the routing-weighted sum of each token's experts' ``down(silu(gate(x)) * up(x))``.

    Args:
        num_experts, hidden_size, intermediate_size: E, H and I (one expert's MLP width).
        dtype: activation dtype (dense weights, W4 scales and zeros).
        group_size: None for dense experts, else the W4 group size of the gate/up projections (K = H) and,
            as ``down_group_size``, of the down projection (K = I).
        prefix: the experts' checkpoint prefix (``model.layers.0.mlp.experts``); expert e's projections are
            ``{prefix}.{e}.{name}`` for the three ``proj_names`` (gate, up, down: Mixtral's are w1, w3, w2).
        layer_idx: the decoder layer (for :func:`experts_in_host_memory`).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 group_size: int | None, down_group_size: int | None, prefix: str,
                 proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), layer_idx: int = -1) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.prefix, self.proj_names, self.layer_idx = prefix, proj_names, layer_idx
        self.on_host = layer_idx in _host_layers and torch.get_default_device().type != "meta"
        dev = torch.device("cpu") if self.on_host else None
        self.quantized = group_size is not None
        if self.quantized:
            g2 = down_group_size or group_size
            if h % group_size or i % g2 or i % 8 or h % 8:
                raise ValueError(f"{prefix}: hidden {h} / intermediate {i} do not fit 4-bit groups of {group_size} / {g2}")
            self.group_size, self.down_group_size = group_size, g2
            for name, (n, k, g) in (("w13", (2 * i, h, group_size)), ("w2", (h, i, g2))):
                self.register_buffer(f"{name}_qweight", torch.zeros(e, n, k // 8, dtype=torch.int32, device=dev))
                self.register_buffer(f"{name}_scales", torch.zeros(e, k // g, n, dtype=dtype, device=dev))
                self.register_buffer(f"{name}_zeros", torch.zeros(e, k // g, n, dtype=dtype, device=dev))
        else:
            self.group_size = self.down_group_size = 0
            self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=dev), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=dev), requires_grad=False)
        self._prepared: tuple[object | None, object | None] = (None, None)  # a backend's own copy (moe_cpu.py)

    @property
    def stacked_parameter_names(self) -> tuple[str, ...]:
        """Names of the stacked parameters, which no checkpoint holds by these names (the loader skips them)."""
        return () if self.quantized else ("w13_weight", "w2_weight")

    def expert_weights(self) -> tuple[ExpertWeights, ExpertWeights]:
        """``(w13, w2)`` as the ops take them (views of this module's tensors)."""
        p13, p2 = self._prepared
        if self.quantized:
            return (ExpertWeights(qweight=self.w13_qweight, scales=self.w13_scales, zeros=self.w13_zeros, prepared=p13),
                    ExpertWeights(qweight=self.w2_qweight, scales=self.w2_scales, zeros=self.w2_zeros, prepared=p2))
        return ExpertWeights(weight=self.w13_weight, prepared=p13), ExpertWeights(weight=self.w2_weight, prepared=p2)

    def weights_changed(self) -> None:
        """Drop prepared copies (after a load or an in-place change of the stacked tensors)."""
        self._prepared = (None, None)

    def pack_for_cpu(self) -> None:
        """Prepare the experts for the CPU GEMMs once (``kernels/moe_cpu.py``), for activations of this layer's
        dtype; a no-op for experts in GPU memory."""
        if self.device.type != "cpu":
            return
        from lightinfer.kernels.moe_cpu import prepare_experts

        w13, w2 = self.expert_weights()
        self._prepared = (prepare_experts(w13, self.dtype), prepare_experts(w2, self.dtype))

    @property
    def device(self) -> torch.device:
        return (self.w13_qweight if self.quantized else self.w13_weight).device

    @property
    def dtype(self) -> torch.dtype:
        return (self.w13_scales if self.quantized else self.w13_weight).dtype

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``topk_weights`` float ``[T, top_k]``, ``topk_ids`` int ``[T, top_k]`` -> ``[T, H]``."""
        w13, w2 = self.expert_weights()
        if self.on_host:  # hidden states to the host and back; the CPU computes these experts
            y = get_backend("torch_cpu").fused_moe(x.to("cpu"), w13, w2, topk_weights.to("cpu"), topk_ids.to("cpu"))
            y = y.to(x.device)
        else:
            y = ops_for(x).fused_moe(x, w13, w2, topk_weights, topk_ids)
        self._prepared = (w13.prepared, w2.prepared)  # what the op prepared, kept for the next call
        return y


def make_experts(num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 quant_config: dict | None, prefix: str, proj_names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                                             "down_proj"),
                 layer_idx: int = -1) -> FusedMoE:
    """The :class:`FusedMoE` for experts stored as ``quant_config`` says (``formats.scheme.linear_format`` of
    each expert projection ``{prefix}.{e}.{name}``): W4 or dense, one format for all of them.

    Raises:
        ValueError: experts stored in different formats, or in one the stacks cannot hold (8-bit).
    """
    from lightinfer.formats.scheme import linear_format

    formats = {}
    for e in range(num_experts if quant_config is not None else 0):
        for name, k in zip(proj_names, (hidden_size, hidden_size, intermediate_size)):
            fmt = linear_format(quant_config, f"{prefix}.{e}.{name}")
            formats[(fmt.kind, fmt.runtime_group_size(k) if fmt.kind == "w4" else 0, name == proj_names[2])] = fmt
    kinds = {kind for kind, _, _ in formats}
    if len(kinds) > 1 or len({key for key in formats if not key[2]}) > 1 or len({key for key in formats if key[2]}) > 1:
        raise ValueError(f"{prefix}: the experts are stored in several formats "
                         f"({', '.join(sorted({f.describe() for f in formats.values()}))}); the stacked experts of a "
                         f"layer need one (W4 with one group size, or dense)")
    if kinds - {"w4", "dense"}:
        raise ValueError(f"{prefix}: experts stored as {next(iter(formats.values())).describe()} are not supported; "
                         f"MoE experts run 4-bit (AWQ / GPTQ / compressed-tensors / GGUF 4-bit types) or dense")
    groups = {down: g for (kind, g, down) in formats if kind == "w4"}
    return FusedMoE(num_experts, hidden_size, intermediate_size, dtype, groups.get(False), groups.get(True), prefix,
                    proj_names, layer_idx)
