"""What the layer-by-layer quantizer needs to know of a decoder layer: the shapes of its quantized linears
(before any weight is read) and how to fill it from a checkpoint (MoE experts included)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightinfer.layers.moe import FusedMoE
from lightinfer.layers.moe_loading import expert_views, stacked_parameter_names
from lightinfer.models.awq_tables import AwqTable


def quantized_linear_shapes(model_cls: type, hf_config: object) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """``(out_features, in_features)`` of every linear ``quantize`` quantizes, by path inside a decoder layer
    (experts as expert 0: ``mlp.experts.0.gate_proj``), and the first layer each path occurs in.

    Each distinct AWQ table of the model (a MoE model mixes sparse and dense layers) is read from its first
    layer, built on the meta device (nothing allocated).
    """
    shapes: dict[str, tuple[int, int]] = {}
    first: dict[str, int] = {}
    seen: list[AwqTable] = []
    for i in range(int(hf_config.num_hidden_layers)):
        table = model_cls.awq_table_for(hf_config, i)
        if table is None or table in seen:
            continue
        seen.append(table)
        with torch.device("meta"):
            layer = model_cls.decoder_layer_cls(hf_config, i, quant_config=None, dtype=torch.float32)
        found = {n: (m.out_features, m.in_features) for n, m in layer.named_modules()
                 if hasattr(m, "in_features") and hasattr(m, "out_features")}
        names = list(table.linears)
        if table.moe is not None:
            names += [*table.moe.expert_linears(1), *table.moe.shared_linears()]
            moe = layer.get_submodule(f"{table.moe.block}.experts")
            h, inter = moe.hidden_size, moe.intermediate_size
            found.update(dict(zip(table.moe.expert_linears(1), ((inter, h), (inter, h), (h, inter)))))
        for n in names:
            if n not in shapes:
                shapes[n], first[n] = found[n], i
    return shapes, first


def is_moe_linear(table: AwqTable | None, name: str) -> bool:
    """Whether ``name`` (a path inside the layer) is an expert projection or a shared-expert linear."""
    if table is None or table.moe is None:
        return False
    return name.startswith(f"{table.moe.block}.experts.") or name in table.moe.shared_linears()


@torch.no_grad()
def load_layer(layer: nn.Module, prefix: str, get_tensor: Callable[[str], torch.Tensor]) -> None:
    """Fill a full-precision decoder layer built by ``decoder_layer_cls`` from checkpoint tensors (fp32): its
    parameters by name under ``prefix``, MoE experts expert by expert into their stacks."""
    stacked = stacked_parameter_names(layer)
    for pname, p in layer.named_parameters():
        if pname not in stacked:
            p.copy_(get_tensor(f"{prefix}.{pname}").to(torch.float32))
    for name, view in expert_views(layer).items():
        view.load_dense(get_tensor(f"{name}.weight").to(torch.float32))


def count_experts(layer: nn.Module) -> int:
    """Experts in a decoder layer (0 for a dense one)."""
    return sum(m.num_experts for m in layer.modules() if isinstance(m, FusedMoE))


def per_expert_source(names: list[str], get_tensor: Callable[[str], torch.Tensor], num_experts: int,
                      suffix: str = "_exps") -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """A checkpoint whose experts are stacked per projection (a GGUF file: ``{prefix}.gate_exps`` ``[E, N, K]``)
    seen with Hugging Face's per-expert names (``{prefix}.{e}.gate_proj.weight``), each a slice of the stacked
    tensor, which is read once for all its experts. Checkpoints without stacked tensors pass through."""
    stacked = {n: n for n in names if n.endswith(suffix)}
    if not stacked:
        return names, get_tensor
    out = [n for n in names if n not in stacked]
    sources: dict[str, tuple[str, int]] = {}
    for n in stacked:
        prefix, part = n[: -len(suffix)].rsplit(".", 1)
        for e in range(num_experts):
            sources[f"{prefix}.{e}.{part}_proj.weight"] = (n, e)
    out += list(sources)
    cache: dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:
        if name not in sources:
            return get_tensor(name)
        src, e = sources[name]
        if src not in cache:
            cache.clear()  # one stacked tensor in memory at a time
            cache[src] = get_tensor(src)
        return cache[src][e]

    return out, read
