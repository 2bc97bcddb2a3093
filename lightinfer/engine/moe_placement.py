"""Where a mixture-of-experts model's experts live: ``--cpu-experts N`` and the "how would it fit a 12 GB card"
advice of the start-up log.

A MoE model reads only ``top_k`` of its experts per token, but all of them must be somewhere: Qwen3-30B-A3B is
about 16 GiB at 4 bits, 3B parameters active. With ``cpu_experts = N`` the experts of the first N MoE layers
stay in host memory and run on the CPU (``layers/moe.py``: hidden states cross PCIe twice per such layer, a few
KiB per token); everything else (attention, routers, the other experts, the KV cache) stays on the GPU. The
CPU half streams about ``N x top_k x 3 x H x I / 2`` bytes of 4-bit expert weights per token from host memory,
which bounds its speed (``bench/kernels/moe_cpu.py --cpu-half`` measures it).
"""

from __future__ import annotations

import logging

from torch import nn

from lightinfer.engine.memory import GIB, module_bytes, moe_fit_advice
from lightinfer.layers.moe import FusedMoE

logger = logging.getLogger("lightinfer")


def host_expert_layers(model_cls: type, hf_config: object, cpu_experts: int) -> set[int]:
    """The decoder layers whose experts stay in host memory: the first ``cpu_experts`` MoE layers.

    Raises:
        ValueError: ``cpu_experts > 0`` for a model without MoE layers.
    """
    if cpu_experts <= 0:
        return set()
    moe_layers = model_cls.moe_layer_ids(hf_config)
    if not moe_layers:
        raise ValueError(f"cpu_experts={cpu_experts}: {model_cls.__name__} has no mixture-of-experts layers; "
                         f"--cpu-experts applies to MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral)")
    if cpu_experts > len(moe_layers):
        logger.info("cpu_experts=%d: the model has %d MoE layers; all their experts stay in host memory",
                    cpu_experts, len(moe_layers))
    return set(moe_layers[:cpu_experts])


def expert_bytes_by_layer(model: nn.Module) -> dict[int, int]:
    """Bytes of each MoE layer's stacked experts in the run-time layout, by decoder layer index: by the stacks'
    shapes, so a meta-device model works and a stack released after the CPU preparation (``FusedMoE.pack_for_cpu``)
    counts what it would take on a GPU (the card advice's unit), not the nothing it holds now."""
    return {m.layer_idx: sum(t.numel() * t.element_size() for t in m.expert_weights()[0].tensors() +
                             m.expert_weights()[1].tensors())
            for m in model.modules() if isinstance(m, FusedMoE)}


def expert_copy_bytes_by_layer(model: nn.Module) -> dict[int, int]:
    """Bytes the CPU copy each MoE layer's experts get once they compute on the CPU (``--cpu-experts``:
    :func:`prepare_host_experts`) adds beyond the W4 stacks it releases (``FusedMoE.cpu_copy_nbytes``), by
    decoder layer index: 0 for W4 experts with 16-bit activations (int4 codes and scale/offset pairs, the
    stacks' size) and for dense 16-bit ones. Arithmetic on the stacks' shapes: a meta-device model works."""
    return {m.layer_idx: m.cpu_copy_nbytes() for m in model.modules() if isinstance(m, FusedMoE)}


def prepare_host_experts(model: nn.Module) -> list[int]:
    """Prepare the host-resident experts for the CPU GEMMs once (``kernels/moe_cpu.py``; their W4 stacks then
    released, ``FusedMoE.pack_for_cpu``, so host memory holds them once); returns their layers."""
    layers = []
    for m in model.modules():
        if isinstance(m, FusedMoE) and m.on_host:
            m.pack_for_cpu()
            layers.append(m.layer_idx)
    return sorted(layers)


def moe_startup_report(model: nn.Module, weight_bytes: int, host_weight_bytes: int, kv_bytes_per_token: int,
                       max_model_len: int, gpu_memory_utilization: float, card_gib: float = 12.0) -> str:
    """Start-up lines for a MoE model: its experts (where they live) and how it would fit a ``card_gib`` card."""
    by_layer = expert_bytes_by_layer(model)
    if not by_layer:
        return ""
    on_host = sorted(m.layer_idx for m in model.modules() if isinstance(m, FusedMoE) and m.on_host)
    total = weight_bytes + host_weight_bytes
    # What a GPU engine holds on the device with every expert there: all but an untied input embedding, which
    # it keeps in host memory by default (EngineConfig.embedding_on_host).
    on_gpu = total - (0 if model.tie_word_embeddings else module_bytes(model.embed_tokens))
    lines = [(f"MoE: {len(by_layer)} layers of experts, {sum(by_layer.values()) / GIB:.2f} GiB of the "
              f"{total / GIB:.2f} GiB of weights")]
    if on_host:
        lines.append(f"  experts of layers {on_host[0]}..{on_host[-1]} ({len(on_host)} layers, "
                     f"{sum(by_layer[i] for i in on_host) / GIB:.2f} GiB) in host memory, computed on the CPU")
    lines.append("  " + moe_fit_advice(on_gpu, [by_layer[i] for i in sorted(by_layer)], kv_bytes_per_token,
                                       max_model_len, int(card_gib * GIB * gpu_memory_utilization),
                                       f"a {card_gib:g} GB card (x gpu_memory_utilization {gpu_memory_utilization:g})"))
    return "\n".join(lines)
