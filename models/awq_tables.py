"""Per-architecture AWQ tables: which linears of a decoder layer share one input, and the op
whose output is that input (where AWQ folds the inverse of its per-channel scales). The quantizer
reaches a model's table through its class (``CausalLM.awq_table``, ``models/base.py``).

Names are submodule paths inside one decoder layer (Hugging Face names, as in ``llama.py``).
``prev_op`` is an RMSNorm (its ``weight`` is divided by the scales) or a linear (its output
rows, and bias, are divided by the scales). A group whose ``prev_op`` is a linear is used
only where the shapes allow (``prev_op.out_features == in_features`` of the group: not with
grouped-query attention for ``v_proj -> o_proj``). Source: Lin et al., "AWQ: Activation-aware
Weight Quantization for LLM Compression and Acceleration", MLSys 2024, section 3.2; the table
layout follows AutoAWQ's ``get_layers_for_scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input.

    Attributes:
        prev_op: the submodule producing the shared input (scales folded into it).
        linears: the linears reading that input (their weight columns are multiplied by the scales).
    """

    prev_op: str
    linears: tuple[str, ...]


@dataclass(frozen=True)
class MoeAwq:
    """A sparse MoE feed-forward, for AWQ (``quant/awq_moe.py`` handles it; its linears are not in ``groups``).

    The block's input (the post-attention norm's output) is shared by every expert's gate and up projections,
    the router and the shared expert: one set of scales, folded into that norm, searched on each expert's
    routed tokens; the router (and the shared-expert gate) are scaled to match but stay dense. Each expert's
    down projection gets its own scales, folded into that expert's up projection, searched on its tokens.

    Attributes:
        block: the block's path in the decoder layer (``mlp``, Mixtral's ``block_sparse_moe``).
        proj_names: an expert's gate, up and down projections (checkpoint names under ``experts.{e}``).
        shared: the shared expert's path (Qwen2-MoE ``mlp.shared_expert``), or None.
        dense: paths of the block's linears that read its input and stay dense (router, shared-expert gate).
    """

    block: str
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str | None = None
    dense: tuple[str, ...] = ()
    prev_op: str = "post_attention_layernorm"

    def expert_linears(self, num_experts: int) -> tuple[str, ...]:
        """Every expert projection's path (checkpoint names: ``mlp.experts.3.gate_proj``), expert by expert."""
        return tuple(f"{self.block}.experts.{e}.{p}" for e in range(num_experts) for p in self.proj_names)

    def shared_linears(self) -> tuple[str, ...]:
        """The shared expert's gate, up and down projections (none without a shared expert)."""
        return tuple(f"{self.shared}.{p}" for p in ("gate_proj", "up_proj", "down_proj")) if self.shared else ()


@dataclass(frozen=True)
class AwqTable:
    """The AWQ description of one decoder-layer architecture.

    Attributes:
        groups: scale groups, in the order of the layer's forward.
        no_clip: linears whose clipping range is not searched (q/k: their outputs meet in a
            softmax, where a per-linear output error is a poor proxy).
        moe: the layer's sparse MoE block, or None (a dense MLP, in ``groups``).
    """

    groups: tuple[ScaleGroup, ...]
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    moe: MoeAwq | None = None

    @property
    def linears(self) -> tuple[str, ...]:
        """Every quantized linear of the layer, each once, in forward order."""
        seen: list[str] = []
        for g in self.groups:
            seen += [n for n in g.linears if n not in seen]
        return tuple(seen)


# Llama and Mistral; Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm after the projections) have the
# same sharing, so their classes inherit it: the biases are handled by the fold, and q_norm/k_norm
# act per head after q_proj/k_proj, which does not touch their input.
LLAMA_TABLE = AwqTable(
    groups=(
        ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)),
        ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ScaleGroup("mlp.up_proj", ("mlp.down_proj",)),
    )
)

# MoE layers: attention as Llama's; the sparse block as MoeAwq says (its router stays dense).
_ATTENTION_GROUPS = LLAMA_TABLE.groups[:2]
QWEN3_MOE_TABLE = AwqTable(groups=_ATTENTION_GROUPS, moe=MoeAwq("mlp", dense=("mlp.gate",)))
QWEN2_MOE_TABLE = AwqTable(groups=_ATTENTION_GROUPS, moe=MoeAwq("mlp", shared="mlp.shared_expert",
                                                               dense=("mlp.gate", "mlp.shared_expert_gate")))
MIXTRAL_TABLE = AwqTable(groups=_ATTENTION_GROUPS, moe=MoeAwq("block_sparse_moe", ("w1", "w3", "w2"),
                                                             dense=("block_sparse_moe.gate",)))
