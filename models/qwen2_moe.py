"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 block (q/k/v bias) with a sparse MoE feed-forward
plus a shared expert every token passes through, scaled by ``sigmoid(shared_expert_gate(x))`` (``moe.py``)."""

from __future__ import annotations

from lightinfer.models.awq_tables import QWEN2_MOE_TABLE
from lightinfer.models.llama import LlamaForCausalLM
from lightinfer.models.moe import MoeCausalLMMixin, MoeDecoderMixin
from lightinfer.models.moe_spec import MoeSpec
from lightinfer.models.qwen2 import Qwen2DecoderLayer

QWEN2_MOE = MoeSpec(num_experts="num_experts", intermediate="moe_intermediate_size",
                    shared_intermediate="shared_expert_intermediate_size")


class Qwen2MoeDecoderLayer(MoeDecoderMixin, Qwen2DecoderLayer):
    """Qwen2 block whose feed-forward is sparse (with the shared expert) where the config says."""

    moe_spec = QWEN2_MOE


class Qwen2MoeForCausalLM(MoeCausalLMMixin, LlamaForCausalLM):
    """Qwen2-MoE causal LM (the :class:`~lightinfer.models.base.CausalLM` interface)."""

    moe_spec = QWEN2_MOE
    decoder_layer_cls = Qwen2MoeDecoderLayer
    awq_table = QWEN2_MOE_TABLE
