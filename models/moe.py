"""The sparse mixture-of-experts feed-forward block shared by Qwen3-MoE, Qwen2-MoE and Mixtral, and the
class-level facts of a MoE model (which layers are sparse, how many bytes its parts weigh).

``SparseMoeBlock``: ``x [T, H]`` -> router logits (fp32) -> softmax top-k (``norm_topk_prob``: the chosen
weights renormalized; Mixtral always) -> the experts (:class:`~lightinfer.layers.moe.FusedMoE`, stacked, W4 or
dense) -> their weighted sum; Qwen2-MoE adds a shared expert, a dense-shaped MLP every token goes through,
scaled by ``sigmoid(shared_expert_gate(x))``. The router and the shared-expert gate are never quantized.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from lightinfer.layers.fusion import RESIDUAL, Feeds, FusionPlan
from lightinfer.layers.linear import Linear, linear_nbytes
from lightinfer.layers.moe import Router, experts_nbytes, make_experts, select_experts
from lightinfer.models.awq_tables import LLAMA_TABLE, AwqTable
from lightinfer.models.llama import LlamaMLP
from lightinfer.models.moe_spec import MoeSpec
from lightinfer.models.sizes import llama_family_weight_bytes


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of decoder layer ``layer_idx``:
    ``forward(x [T, H]) -> [T, H]`` (module docstring). Parameter names are the checkpoint's under
    ``model.layers.{layer_idx}.{spec.block_name}``."""

    def __init__(self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype,
                 spec: MoeSpec) -> None:
        super().__init__()
        c = hf_config
        spec.check(c)
        prefix = f"model.layers.{layer_idx}.{spec.block_name}"
        self.num_experts, self.top_k = spec.num_experts_of(c), int(c.num_experts_per_tok)
        self.renormalize = spec.renormalize(c)
        self.gate = Router(c.hidden_size, self.num_experts, dtype)
        self.experts = make_experts(self.num_experts, c.hidden_size, int(getattr(c, spec.intermediate)), dtype,
                                    quant_config, f"{prefix}.experts", spec.proj_names, layer_idx)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if spec.shared_size(c):
            self.shared_expert = LlamaMLP(c, layer_idx, quant_config, dtype, spec.shared_size(c),
                                          f"{prefix}.shared_expert")
            self.shared_expert_gate = Linear(c.hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x).to(torch.float32)).to(x.dtype)
            out = out + gate * self.shared_expert(x)
        return out


def moe_layer_fusion_plan(sparse: bool, block_name: str = "mlp") -> FusionPlan:
    """The decoder layer's fusion plan: o_proj feeds the post-attention norm; a dense MLP's down_proj feeds the
    residual stream (a sparse block's output is a sum computed apart: no deferred split-K there)."""
    feeds = (Feeds("self_attn.o_proj", "post_attention_layernorm"),)
    return FusionPlan(feeds=feeds if sparse else (*feeds, Feeds(f"{block_name}.down_proj", RESIDUAL)))


class MoeDecoderMixin:
    """For a Llama-family decoder layer class: the feed-forward is a :class:`SparseMoeBlock` where
    ``moe_spec`` makes the layer sparse, else a dense :class:`LlamaMLP`; the fusion plan follows."""

    moe_spec: MoeSpec

    def build_mlp(self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype) -> nn.Module:
        sparse = self.moe_spec.is_sparse(hf_config, layer_idx)
        self.fusion_plan = moe_layer_fusion_plan(sparse, self.moe_spec.block_name)
        if sparse:
            return SparseMoeBlock(hf_config, layer_idx, quant_config, dtype, self.moe_spec)
        return LlamaMLP(hf_config, layer_idx, quant_config, dtype)


class MoeCausalLMMixin:
    """Class-level facts of a MoE causal LM (put before :class:`~lightinfer.models.llama.LlamaForCausalLM` in the
    bases): the config checked before anything is allocated, the sparse layers, the linears' input sizes with
    the experts', weight bytes by part."""

    moe_spec: ClassVar[MoeSpec]

    def __init__(self, hf_config: object, quant_config: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.moe_spec.check(hf_config)  # before the embedding is allocated
        super().__init__(hf_config, quant_config, dtype)  # type: ignore[call-arg]

    @classmethod
    def awq_table_for(cls, hf_config: object, layer_idx: int) -> AwqTable | None:
        """The layer's table: the class's where the layer is sparse, Llama's for its dense layers."""
        return cls.awq_table if cls.moe_spec.is_sparse(hf_config, layer_idx) else LLAMA_TABLE

    @classmethod
    def moe_layer_ids(cls, hf_config: object) -> list[int]:
        """The decoder layers with a sparse MoE block, in order."""
        return cls.moe_spec.sparse_layers(hf_config)

    @classmethod
    def linear_input_sizes(cls, hf_config: object) -> dict[str, int]:
        """The inputs of the quantized linears, by config field: attention's, the dense MLPs' (where some layers
        are dense), the experts' down projections' (``moe_intermediate_size``...) and the shared expert's."""
        sizes = dict(super().linear_input_sizes(hf_config))  # type: ignore[misc]
        spec, c = cls.moe_spec, hf_config
        if len(spec.sparse_layers(c)) == int(c.num_hidden_layers):
            sizes.pop("intermediate_size", None)
        if spec.sparse_layers(c):
            sizes[spec.intermediate] = int(getattr(c, spec.intermediate))
            if spec.shared_size(c):
                sizes[spec.shared_intermediate] = spec.shared_size(c)
        return sizes

    @classmethod
    def estimate_weight_bytes(cls, hf_config: object, quant_config: dict | None,
                              dtype: torch.dtype) -> tuple[int, int]:
        """The base class's arithmetic for attention, norms, embedding and head, with the feed-forward of every
        layer counted as that layer has it: a dense MLP, or the experts (stored as ``quant_config`` says, 4-bit
        or dense, like ``make_experts``), router and shared expert. Nothing is built.

        Returns:
            ``(weights, cpu_dense)``; ``cpu_dense`` adds what the CPU copy of the experts
            (``kernels/moe_cpu.py``) adds beyond the W4 stacks it replaces and releases
            (``layers.moe.experts_nbytes``): fp32 engines a prepacked fp32 copy less the W4 stacks; 16-bit
            engines 0 (a 4-bit copy for torch's int4 GEMM, the stacks' size); none for 16-bit dense experts.
        """
        spec, c = cls.moe_spec, hf_config
        weights, dense = super().estimate_weight_bytes(hf_config, quant_config, dtype)  # type: ignore[misc]
        # The base counted layer 0's feed-forward for every layer: take it out, then add each layer's own.
        h, inter = int(c.hidden_size), int(c.intermediate_size)
        elem = torch.empty(0, dtype=dtype).element_size()
        first_ffn = dict(cls.decoder_linear_shapes(c)).items()  # type: ignore[attr-defined]
        for name, (n, k) in first_ffn:
            if not name.startswith("self_attn."):
                stored, copy = linear_nbytes(k, n, False, dtype, quant_config, f"model.layers.0.{name}")
                weights, dense = weights - stored * int(c.num_hidden_layers), dense - copy * int(c.num_hidden_layers)
        e, i, shared = spec.num_experts_of(c), int(getattr(c, spec.intermediate)), spec.shared_size(c)
        for layer in range(int(c.num_hidden_layers)):
            prefix = f"model.layers.{layer}.{spec.block_name}"
            mlps: list[tuple[str, int]] = []
            if spec.is_sparse(c, layer):
                weights += e * h * elem + (h * elem if shared else 0)  # router, shared-expert gate
                mlps = [(f"{prefix}.shared_expert", shared)] if shared else []
                stored, copy = experts_nbytes(e, h, i, dtype, quant_config, f"{prefix}.experts", spec.proj_names)
                weights, dense = weights + stored, dense + copy
            else:
                mlps = [(prefix, inter)]
            for mlp_prefix, size in mlps:
                for proj, (n, k) in (("gate_proj", (size, h)), ("up_proj", (size, h)), ("down_proj", (h, size))):
                    stored, copy = linear_nbytes(k, n, False, dtype, quant_config, f"{mlp_prefix}.{proj}")
                    weights, dense = weights + stored, dense + copy
        return weights, dense

    @classmethod
    def weight_bytes_by_part(cls, hf_config: object, bits: int = 16, group_size: int = 128,
                             dtype_bytes: int = 2) -> dict[str, int]:
        """Weight bytes by part (``models/sizes.py``), experts included, the linears at ``bits``."""
        layer = cls.decoder_layer_cls  # type: ignore[attr-defined]
        return llama_family_weight_bytes(hf_config, cls.moe_spec, bits, group_size, dtype_bytes,
                                         qkv_bias=bool(layer.qkv_bias), qk_norm=bool(layer.qk_norm))
