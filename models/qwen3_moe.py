"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 block (q/k RMSNorm) with a sparse MoE feed-forward
(``moe.py``): softmax top-k routing, renormalized when ``norm_topk_prob``; ``decoder_sparse_step`` and
``mlp_only_layers`` leave some layers dense."""

from __future__ import annotations

from lightinfer.models.awq_tables import QWEN3_MOE_TABLE
from lightinfer.models.llama import LlamaForCausalLM
from lightinfer.models.moe import MoeCausalLMMixin, MoeDecoderMixin
from lightinfer.models.moe_spec import MoeSpec
from lightinfer.models.qwen3 import Qwen3DecoderLayer

QWEN3_MOE = MoeSpec(num_experts="num_experts", intermediate="moe_intermediate_size")


class Qwen3MoeDecoderLayer(MoeDecoderMixin, Qwen3DecoderLayer):
    """Qwen3 block whose feed-forward is sparse where the config says."""

    moe_spec = QWEN3_MOE


class Qwen3MoeForCausalLM(MoeCausalLMMixin, LlamaForCausalLM):
    """Qwen3-MoE causal LM (the :class:`~lightinfer.models.base.CausalLM` interface)."""

    moe_spec = QWEN3_MOE
    decoder_layer_cls = Qwen3MoeDecoderLayer
    awq_table = QWEN3_MOE_TABLE
